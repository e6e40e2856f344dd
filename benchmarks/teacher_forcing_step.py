"""Seconds per teacher-forced training step of a block-causal MHLA Wan transformer (forward and backward).

    python benchmarks/teacher_forcing_step.py runs/pilot-tf-2/start/long-mhla --batch 8 --frames 9 --latent 24 \
        --chunks 1,4,4

The model folder is a saved pipeline (or transformer) converted with ``MHLAConfig(causal=True)``, e.g. a stream
pilot's causal start. Inputs are random latents ``(batch, C, 2 x frames, latent, latent)`` (the clean and the noisy
copy), per-token timesteps and text embeddings; the step is timed after ``--warmup`` steps and the median of
``--runs`` is printed with the torch thread count. The long-video pilot log (docs/long-video-pilots.md) quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="a saved causal MHLA Wan pipeline or transformer folder")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--frames", type=int, default=9, help="latent frames of one copy of the clip")
    p.add_argument("--latent", type=int, default=24, help="latent height and width")
    p.add_argument("--chunks", default="1,4,4", help="latent frames per chunk, adding up to --frames")
    p.add_argument("--text-tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)

    import torch

    from mhla_diffusion.loaders.loading import load_transformer_file
    from mhla_diffusion.models.teacher_forcing import TeacherForcing

    chunks = [int(c) for c in args.chunks.split(",")]
    if sum(chunks) != args.frames:
        p.error(f"--chunks {args.chunks} must add up to --frames {args.frames}")
    folder = args.model / "transformer" if (args.model / "transformer").is_dir() else args.model
    transformer = load_transformer_file(folder).train()
    config = transformer.config
    patch = config.patch_size
    tokens = 2 * args.frames * (args.latent // patch[1]) * (args.latent // patch[2])
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(args.batch, config.in_channels, 2 * args.frames, args.latent, args.latent, generator=g)
    timesteps = torch.rand(args.batch, tokens, generator=g) * 1000
    text = torch.randn(args.batch, args.text_tokens, config.text_dim, generator=g)

    def step() -> float:
        began = time.perf_counter()
        with TeacherForcing(transformer, chunks):
            out = transformer(hidden_states=latents, timestep=timesteps, encoder_hidden_states=text, return_dict=False)
        out[0].pow(2).mean().backward()
        transformer.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    for _ in range(args.warmup):
        step()
    seconds = [step() for _ in range(args.runs)]
    print(
        f"teacher-forced step, batch {args.batch}, {tokens} tokens ({args.frames} latent frames x 2 copies), chunks "
        f"{chunks}: median {statistics.median(seconds):.3f} s of {args.runs} ({torch.get_num_threads()} torch threads)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
