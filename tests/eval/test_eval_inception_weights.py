"""The real Inception extractor: weights only from a local file, clear errors, SHA-256 logged, shapes."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from helpers.features import inception_template_state_dict
from mhla_diffusion.eval.inception import (
    INCEPTION_WEIGHTS_ENV,
    InceptionV3Features,
    load_inception_state_dict,
    resolve_inception_weights,
)


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory):
    """A weights file with the real keys and shapes and random values (the real file is not available)."""
    path = tmp_path_factory.mktemp("inception") / "random-inception.pth"
    torch.save(inception_template_state_dict(), path)
    return path


def test_missing_weights_error_names_the_file_and_where_to_put_it(monkeypatch):
    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)
    with pytest.raises(FileNotFoundError) as error:
        InceptionV3Features()
    message = str(error.value)
    for needed in (
        "weights-inception-2015-12-05-6726825d.pth",
        "--inception-weights",
        INCEPTION_WEIGHTS_ENV,
        "https://",
    ):
        assert needed in message


def test_weights_path_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(INCEPTION_WEIGHTS_ENV, str(tmp_path / "nowhere.pth"))
    with pytest.raises(FileNotFoundError, match=f"nowhere.pth \\(from \\${INCEPTION_WEIGHTS_ENV}\\) does not exist"):
        resolve_inception_weights()
    real = tmp_path / "w.pth"
    real.write_bytes(b"x")
    monkeypatch.setenv(INCEPTION_WEIGHTS_ENV, str(real))
    assert resolve_inception_weights() == real
    assert resolve_inception_weights(str(real)) == real


def test_a_file_that_is_not_a_state_dict_is_rejected(tmp_path):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(ValueError, match="is not a PyTorch weights file"):
        InceptionV3Features(garbage)
    not_tensors = tmp_path / "dict.pth"
    torch.save({"epoch": 3}, not_tensors)
    with pytest.raises(ValueError, match="plain state dict of tensors"):
        InceptionV3Features(not_tensors)


def test_a_state_dict_of_another_network_is_rejected(tmp_path):
    wrong = tmp_path / "resnet.pth"
    torch.save(torch.nn.Linear(4, 2).state_dict(), wrong)
    with pytest.raises(ValueError, match="is not the FID Inception-v3 weights file.*Missing key"):
        InceptionV3Features(wrong)
    wrong_shape = tmp_path / "wrong-fc.pth"
    state = inception_template_state_dict()
    state["fc.weight"] = torch.zeros(1000, 2048)  # torchvision's 1000-class head instead of 1008
    torch.save(state, wrong_shape)
    with pytest.raises(ValueError, match="size mismatch for fc.weight"):
        InceptionV3Features(wrong_shape)


def test_random_weights_give_adm_feature_shapes_and_log_the_sha256(random_weights, caplog):
    with caplog.at_level(logging.INFO, logger="mhla_diffusion.eval.inception"):
        net = InceptionV3Features(random_weights)
    sha256 = hashlib.sha256(random_weights.read_bytes()).hexdigest()
    assert sha256 in caplog.text
    assert net.info()["weights_sha256"] == sha256 and net.weights_path == str(random_weights)
    assert net.pool_dim == 2048 and net.spatial_dim == 2023 and net.num_logits == 1008

    mixed_6d = []
    net.net.Mixed_6d.register_forward_hook(lambda _m, _i, out: mixed_6d.append(out))
    images = torch.randint(0, 256, (2, 3, 24, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    features = net(images)
    assert features["pool"].shape == (2, 2048) and features["pool"].dtype == torch.float32
    assert features["spatial"].shape == (2, 17, 17, 7)
    assert features["logits_unbiased"].shape == (2, 1008)
    # mixed_6/conv = Mixed_6d.branch1x1 = the first 192 channels of Mixed_6d's output (post-ReLU).
    torch.testing.assert_close(features["spatial"], mixed_6d[0][:, :7].permute(0, 2, 3, 1))
    assert (features["spatial"] >= 0).all()
    pool = features["pool"].double()
    torch.testing.assert_close(
        features["logits_unbiased"].double(),
        pool @ net.net.fc.weight.double().T,
        rtol=1e-4,
        atol=1e-6 * pool.abs().max().item(),
    )
    assert not net.train().training


def test_loading_hashes_exactly_the_bytes_it_loads(random_weights):
    state_dict, sha256 = load_inception_state_dict(random_weights)
    assert sha256 == hashlib.sha256(random_weights.read_bytes()).hexdigest()
    assert state_dict["fc.weight"].shape == (1008, 2048)
