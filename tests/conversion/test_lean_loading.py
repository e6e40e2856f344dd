"""Loading leaves the weights in the memory-mapped files (no second copy), keeps reloads exact, never
writes into the user's files, and the load benchmark measures it in fresh processes."""

from __future__ import annotations

import hashlib
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.models import run, wan_inputs
from mhla_diffusion import MHLAConfig, convert_to_mhla, load_mhla, load_transformer, save_mhla
from mhla_diffusion.benchmarks.load import LoadCase, in_weight_file_mapping, measure_load, write_weights
from mhla_diffusion.models.tiny import tiny_wan_transformer
from mhla_diffusion.pipelines import MHLAWanPipeline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")


def converted_wan():
    model = tiny_wan_transformer(num_layers=2)
    convert_to_mhla(model, MHLAConfig.released_wan(layout=(1, 2, 2)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def unmapped(model, dtype=None):
    """Weights (base and MHLA) of ``dtype`` that the load copied instead of leaving them in the file."""
    items = [(k, v) for k, v in model.state_dict().items() if dtype is None or v.dtype == dtype]
    return [k for (k, _), inside in zip(items, in_weight_file_mapping(v for _, v in items)) if not inside]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_and_base_plus_mhla_loads_leave_the_weights_in_the_files(tmp_path, dtype):
    model = converted_wan().to(dtype)
    save_mhla(model, tmp_path / "whole", include_base=True)
    save_mhla(model, tmp_path / "mhla")
    base = tiny_wan_transformer(num_layers=2).to(dtype)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if ".processor." not in k})
    base.save_pretrained(tmp_path / "base")

    whole = load_mhla(tmp_path / "whole", dtype=dtype)
    assert whole.patch_embedding.weight.dtype == dtype
    # Wan keeps a few small modules in float32 (copied when the file holds bf16): every weight
    # stored in the requested dtype stays in the file's pages
    assert unmapped(whole, dtype) == []
    split = load_mhla(tmp_path / "mhla", load_transformer(tmp_path / "base", dtype=dtype))
    assert unmapped(split, dtype) == []
    # the same numbers as reading the files into memory (Diffusers' disable_mmap, the old path), which
    # for float32 are the saved model's own
    copied = load_mhla(tmp_path / "whole", dtype=dtype, disable_mmap=True)
    assert unmapped(copied, dtype) != []
    inputs = {k: x.to(dtype) if x.is_floating_point() else x for k, x in wan_inputs(3, 4, 4).items()}
    expected = run(copied, inputs)
    assert torch.equal(run(whole, inputs), expected) and torch.equal(run(split, inputs), expected)
    if dtype == torch.float32:
        assert torch.equal(run(model, inputs), expected)


def test_pipeline_from_pretrained_is_lean_and_exact(pipeline_dirs):
    pipe = MHLAWanPipeline.from_pretrained(pipeline_dirs["wan"], mhla_weights=pipeline_dirs["wan_mhla"])
    assert unmapped(pipe.transformer, torch.float32) == []


def test_training_a_loaded_model_and_saving_over_its_folder_keeps_the_files_safe(tmp_path):
    model = converted_wan()
    save_mhla(model, tmp_path, include_base=True)
    weights = tmp_path / "diffusion_pytorch_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    loaded = load_mhla(tmp_path)
    with torch.no_grad():  # an optimizer step writes into the mapped pages: private copies, not the file
        for p in loaded.parameters():
            p.add_(1.0)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    # saving over the folder the weights are mapped from writes the new values, readable afterwards
    save_mhla(loaded, tmp_path, include_base=True, overwrite=True)
    again = load_mhla(tmp_path)
    inputs = wan_inputs(3, 4, 4)
    assert torch.equal(run(again, inputs), run(loaded, inputs))


SMALL_WAN = dict(  # Wan2.1-1.3B's width with one block: ~0.2 GB in float32, enough to see a copy
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=256,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=1,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)


@pytest.mark.slow
def test_load_benchmark_peak_memory_in_fresh_processes(tmp_path):
    folders = write_weights(tmp_path / "work", SMALL_WAN, log=lambda _: None)
    # one fresh single-threaded process per load, run side by side: each reads only its own peak memory
    cases = (LoadCase("whole", "float32"), LoadCase("base+mhla", "bfloat16"), LoadCase("whole", "float32", mmap=False))
    with ThreadPoolExecutor(len(cases)) as pool:
        lean, bf16, old = pool.map(lambda case: measure_load(case, folders), cases)
    # bf16: Wan's float32 modules (time embedder, norms) are copies; at one block they are ~10 % of the bytes
    assert lean["mapped"] > 0.95 and bf16["mapped"] > 0.8 and old["mapped"] < 0.1  # only the MHLA weights
    assert lean["load_ratio"] <= 1.25 and bf16["load_ratio"] <= 1.25, (lean, bf16)
    # a forward touches every weight: the weights' pages become resident (plus activations, which at
    # one block are not small next to the weights; `mhla bench --load` shows the full-size ratio)
    assert lean["forward_peak_gb"] > 0.9 * lean["weights_gb"] > 0
    assert old["load_ratio"] > 1.5  # reading the file into memory first: bytes plus tensors
    # the folders are reused, and a folder the benchmark did not write is refused untouched
    assert write_weights(tmp_path / "work", SMALL_WAN, log=lambda _: None) == folders
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not written by this benchmark"):
        write_weights(tmp_path / "mine", SMALL_WAN, log=lambda _: None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
