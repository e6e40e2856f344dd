"""The torchmetrics metrics (`mhla_diffusion.eval.metrics`): same numbers as `evaluate()` / `mhla eval`,
reference statistics from ADM `.npz` files, and two real processes (gloo) equal to one over the union."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics import Metric

from helpers.features import StandInFeatures
from helpers.media import random_images, smooth_images
from helpers.web import free_port
from mhla_diffusion.eval import (
    ADMFrechetInceptionDistance,
    ADMInceptionScore,
    ADMPrecisionRecall,
    ArrayImages,
    Reference,
    SpatialFID,
    evaluate,
    load_reference,
    make_reference,
)

TESTS = Path(__file__).resolve().parents[1]


def samples_and_reference() -> tuple[np.ndarray, np.ndarray]:
    """More images than the stand-in's 112 sFID dimensions: with rank-deficient covariances the distance
    depends on round-off through the square roots of zero eigenvalues, and sums in another order (other
    batches, other processes) would agree only to ~1e-8."""
    samples = np.concatenate([smooth_images(150, seed=1), random_images(100, seed=2)])
    reference = np.concatenate([smooth_images(120, seed=3, brightness=20), random_images(100, seed=4)])
    return samples, reference


def assert_close(value, expected, rtol=1e-10):
    assert isinstance(value, torch.Tensor) and value.dtype == torch.float64
    assert abs(float(value) - expected) <= rtol * abs(expected), (float(value), expected)


def test_metrics_equal_evaluate_with_an_adm_reference_file(standin, tmp_path):
    samples, ref_images = samples_and_reference()
    ref_path = tmp_path / "ref.npz"
    make_reference(ArrayImages(ref_images), standin, ref_path, pr_images=len(ref_images), batch_size=8, progress=False)
    expected = evaluate(
        ArrayImages(samples), load_reference(ref_path), standin, batch_size=32, split_size=100, progress=False
    )["metrics"]

    fid = ADMFrechetInceptionDistance(standin, reference=ref_path)
    sfid = SpatialFID(standin, reference=load_reference(ref_path))
    inception = ADMInceptionScore(standin, split_size=100)
    pr = ADMPrecisionRecall(standin, reference=ref_path)
    assert all(isinstance(m, Metric) for m in (fid, sfid, inception, pr))
    for start in range(0, len(samples), 32):  # evaluate's batches; NHWC arrays and NCHW tensors
        batch = samples[start : start + 32]
        for metric in (fid, sfid, inception, pr):
            metric.update(batch if start % 64 else torch.from_numpy(batch).permute(0, 3, 1, 2))
    assert_close(fid.compute(), expected["fid"])
    assert_close(sfid.compute(), expected["sfid"])
    assert float(inception.compute()) == expected["inception_score"]
    result = pr.compute()
    assert (float(result["precision"]), float(result["recall"])) == (expected["precision"], expected["recall"])
    assert expected["fid"] > 0.01 and expected["sfid"] > 0.01  # not a trivial comparison


def test_real_updates_equal_evaluate_with_reference_images_and_batches_do_not_matter(standin):
    samples, ref_images = samples_and_reference()
    expected = evaluate(
        ArrayImages(samples),
        Reference("images", ArrayImages(ref_images)),
        standin,
        batch_size=6,
        split_size=1000,
        progress=False,
    )["metrics"]
    fid, sfid, pr = ADMFrechetInceptionDistance(standin), SpatialFID(standin), ADMPrecisionRecall(standin)
    for metric in (fid, sfid, pr):
        for start in range(0, len(samples), 6):
            metric.update(samples[start : start + 6])
        for start in range(0, len(ref_images), 6):
            metric.update(ref_images[start : start + 6], real=True)
    assert_close(fid.compute(), expected["fid"])
    assert_close(sfid.compute(), expected["sfid"])
    assert {k: float(v) for k, v in pr.compute().items()} == {
        "precision": expected["precision"],
        "recall": expected["recall"],
    }
    other = ADMFrechetInceptionDistance(standin)  # other batch sizes: the same up to float64 round-off
    for images, real in ((samples, False), (ref_images, True)):
        for start in range(0, len(images), 11):
            other.update(images[start : start + 11], real=real)
    assert_close(other.compute(), expected["fid"])
    # a Reference with images but no stored statistics is run through the network once
    from_images = ADMFrechetInceptionDistance(standin, reference=Reference("images", ArrayImages(ref_images)))
    from_images.update(samples)
    assert_close(from_images.compute(), expected["fid"])


def test_reset_keeps_reference_statistics_and_real_updates_are_refused(standin, tmp_path):
    samples, ref_images = samples_and_reference()
    ref_path = tmp_path / "stats.npz"
    make_reference(
        ArrayImages(ref_images), standin, ref_path, pr_images=0, progress=False
    )  # mu/sigma/mu_s/sigma_s only
    fid = ADMFrechetInceptionDistance(standin, reference=ref_path)
    fid.update(samples[:10])
    first = fid.compute()
    fid.reset()
    assert int(fid.fake_count) == 0 and fid.reference is not None
    fid.update(samples[:10])
    assert float(fid.compute()) == float(first)
    with pytest.raises(ValueError, match="real images cannot be added"):
        fid.update(ref_images, real=True)
    with pytest.raises(ValueError, match="no images"):
        ADMPrecisionRecall(standin, reference=ref_path)
    inception = ADMInceptionScore(standin)
    inception.update(ref_images, real=True)  # ignored: the score is of samples only
    assert inception.logits == []


def test_bad_inputs(standin):
    fid = ADMFrechetInceptionDistance(standin)
    with pytest.raises(ValueError, match="uint8"):
        fid.update(np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\) or \(N, 3, H, W\)"):
        fid.update(np.zeros((2, 8, 8, 4), np.uint8))
    with pytest.raises(ValueError, match="another network"):
        from mhla_diffusion.eval import GaussianStats

        SpatialFID(standin, reference=GaussianStats(np.zeros(3), np.eye(3)))
    with pytest.raises(TypeError, match=r"FeatureExtractor .* or an nn.Module"):
        ADMInceptionScore(lambda images: images)
    with pytest.raises(ValueError, match=r"must return an \(N, D\) tensor"):  # Identity gives (N, 3, H, W)
        ADMInceptionScore(torch.nn.Identity())


class SmallFeatures(torch.nn.Module):
    """A plain feature module as torchmetrics' ``feature=`` takes: uint8 (N, 3, 8, 8) -> (N, 5)."""

    def __init__(self, num_features: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.project = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5))
        if num_features:
            self.num_features = 5

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.project(images.float() / 255)


def test_a_plain_feature_module_gives_the_fid_of_its_features():
    from torchmetrics.image.fid import FrechetInceptionDistance

    from mhla_diffusion.eval import TensorFeatures, frechet_distance, gaussian_stats

    samples = smooth_images(40, seed=1, size=8)
    real = random_images(30, seed=2, size=8)
    net = SmallFeatures()
    nchw = [torch.from_numpy(x).permute(0, 3, 1, 2).contiguous() for x in (samples, real)]
    with torch.no_grad():
        expected = frechet_distance(*(gaussian_stats(net(x).double().numpy()) for x in nchw))
    theirs = FrechetInceptionDistance(feature=net)  # torchmetrics' own metric on the same module
    ours = ADMFrechetInceptionDistance(net)
    for metric in (theirs, ours):
        metric.update(nchw[0], real=False)
        metric.update(nchw[1], real=True)
    assert_close(ours.compute(), expected)
    assert float(theirs.compute()) == pytest.approx(expected, rel=1e-6) and expected > 0.01
    # without `num_features` the size comes from one forward at the given input size (torchmetrics' rule)
    bare = SmallFeatures(num_features=False)
    with pytest.raises(ValueError, match=r"input_img_size=\(3, H, W\)"):  # the default probe is 299 x 299
        ADMPrecisionRecall(bare)
    pr = ADMPrecisionRecall(TensorFeatures(bare, input_img_size=(3, 8, 8)))
    pr.update(samples)
    pr.update(real, real=True)
    assert set(pr.compute()) == {"precision", "recall"}


def count_forwards(network: torch.nn.Module) -> list:
    """A list that grows by one at every forward of ``network``."""
    calls: list = []
    network.register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_a_metric_collection_runs_the_shared_feature_network_once_per_update(standin):
    from torchmetrics import MetricCollection

    samples, _ = samples_and_reference()
    separate = {"fid": ADMFrechetInceptionDistance(StandInFeatures()), "is": ADMInceptionScore(StandInFeatures(), 50)}
    calls = count_forwards(standin)
    collection = MetricCollection(
        {
            "fid": ADMFrechetInceptionDistance(standin),
            "sfid": SpatialFID(standin),
            "is": ADMInceptionScore(standin, split_size=50),
            "pr": ADMPrecisionRecall(standin, k=2),
        }
    )
    for batch in (samples[:20], samples[20:50]):
        collection.update(batch)
        collection.update(batch, real=True)  # the same pixels as reference images: no new forward
        for metric in separate.values():
            metric.update(batch)
            metric.update(batch, real=True)
    assert len(calls) == 2  # main: 4 metrics x 4 updates = 16 forwards
    result = collection.compute()
    assert float(result["fid"]) == float(separate["fid"].compute())
    assert float(result["is"]) == float(separate["is"].compute())
    changed = samples[20:50]  # the same array object changed in place: a new forward
    changed[0] ^= 255
    collection.update(changed)
    collection.update(changed)
    assert len(calls) == 3
    with torch.no_grad():  # new weights, same pixels: a new forward
        standin.conv1.bias.add_(1.0)
    collection.update(changed)
    assert len(calls) == 4
    # a plain module shared by the metrics (each wraps it) is shared the same way
    plain = SmallFeatures()
    plain_calls = count_forwards(plain)
    small = MetricCollection([ADMFrechetInceptionDistance(plain), ADMPrecisionRecall(plain, k=2)])
    small.update(random_images(6, seed=1, size=8))
    small.update(random_images(6, seed=2, size=8))
    assert len(plain_calls) == 2


WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from helpers.features import StandInFeatures
    from mhla_diffusion.eval import ADMFrechetInceptionDistance, ADMInceptionScore, ADMPrecisionRecall, SpatialFID

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = np.load(sys.argv[1])
    cut_s, cut_r = int(data["cut_s"]), int(data["cut_r"])
    samples = data["samples"][:cut_s] if rank == 0 else data["samples"][cut_s:]
    real = data["real"][:cut_r] if rank == 0 else data["real"][cut_r:]
    net = StandInFeatures()
    metrics = {"fid": ADMFrechetInceptionDistance(net), "sfid": SpatialFID(net),
               "is": ADMInceptionScore(net, split_size=70), "pr": ADMPrecisionRecall(net)}
    for metric in metrics.values():
        for start in range(0, len(samples), 16):
            metric.update(samples[start:start + 16])
        for start in range(0, len(real), 16):
            metric.update(real[start:start + 16], real=True)
    result = {name: metric.compute() for name, metric in metrics.items()}
    result = {"fid": float(result["fid"]), "sfid": float(result["sfid"]), "is": float(result["is"]),
              "precision": float(result["pr"]["precision"]), "recall": float(result["pr"]["recall"]),
              "local_count": int(metrics["fid"].fake_count)}
    with open(sys.argv[2] + f".{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_two_gloo_processes_equal_one_process_over_the_union(standin, tmp_path):
    samples, real = samples_and_reference()
    data = tmp_path / "data.npz"
    np.savez(data, samples=samples, real=real, cut_s=120, cut_r=100)  # uneven shards
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "result.json"
    port = free_port()
    env_base = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    runs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "worker.py"), str(data), str(out)],
            env={**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [run.communicate(timeout=240) for run in runs]
    for run, (stdout, stderr) in zip(runs, outputs):
        assert run.returncode == 0, stdout[-2000:] + stderr[-4000:]
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    assert (results[0]["local_count"], results[1]["local_count"]) == (120, len(samples) - 120)

    # one process over the union; the union's order is the gathered order (rank 0's images, then rank 1's)
    fid, sfid = ADMFrechetInceptionDistance(standin), SpatialFID(standin)
    inception, pr = ADMInceptionScore(standin, split_size=70), ADMPrecisionRecall(standin)
    for metric in (fid, sfid, inception, pr):
        metric.update(samples)
        metric.update(real, real=True)
    for result in results:  # every process gets the synchronised value
        assert abs(result["fid"] - float(fid.compute())) <= 1e-10 * float(fid.compute())
        assert abs(result["sfid"] - float(sfid.compute())) <= 1e-10 * float(sfid.compute())
        assert result["is"] == pytest.approx(float(inception.compute()), rel=1e-12)
        expected = pr.compute()
        assert (result["precision"], result["recall"]) == (float(expected["precision"]), float(expected["recall"]))
