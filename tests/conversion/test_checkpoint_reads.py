"""Every checkpoint file the package reads goes through one reader
(:func:`mhla_diffusion.loaders.weight_files.read_checkpoint_file`): LoRA files and latent-cache entries
as well as weight folders and the importers. A damaged file is one line naming it and the fix."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mhla_diffusion.finetune.latent_cache import LatentCache
from mhla_diffusion.pipelines.lora import mark_mhla_lora, read_lora_mark


def test_lora_files_are_marked_and_read_through_the_one_reader(tmp_path):
    path = tmp_path / "pytorch_lora_weights.safetensors"
    tensors = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(2, 8)}
    save_file(tensors, path, metadata={"format": "pt"})
    mark_mhla_lora(path, None)
    assert read_lora_mark(path) == {"requires_mhla": False}
    path.write_bytes(path.read_bytes()[:40])  # truncated by an interrupted copy
    for read in (read_lora_mark, lambda p: mark_mhla_lora(p, None)):
        with pytest.raises(ValueError) as error:
            read(path)
        assert str(error.value) == f"{path} is not a readable PyTorch/safetensors checkpoint (corrupt or truncated?)"


def test_a_damaged_cache_entry_names_the_file_and_the_fix(tmp_path):
    cache = LatentCache(tmp_path / "cache", {})
    cache.write("latents", {"sample": 0}, {"latents": torch.ones(2, 3)})
    assert torch.equal(cache.read("latents", {"sample": 0})["latents"], torch.ones(2, 3))
    entry = cache.path("latents", {"sample": 0})
    entry.write_bytes(entry.read_bytes()[:30])
    with pytest.raises(ValueError) as error:
        cache.read("latents", {"sample": 0})
    assert str(error.value) == (
        f"cache entry {entry} is not a readable PyTorch/safetensors checkpoint (corrupt or "
        f"truncated?): delete {tmp_path / 'cache' / 'index.json'} to rebuild the cache"
    )
