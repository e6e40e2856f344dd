"""The GPU session of issues 34 and 49: what MHLA does on a lent GPU, measured in one call of under 10 minutes.

How to run it (one NVIDIA H200 is lent to some tasks: 15 minutes of device time per session, at most 10 per
command, the machine's start of one to two minutes included). The machine's image (device README, KINDS.md):
Python 3.12, torch 2.11 (CUDA 13) and Triton 3.6, no Diffusers, no FlashAttention-2 (``flash_attn``) or -3
(``flash_attn_interface``), no package registry. This tree travels with the call and is imported through
PYTHONPATH (no install); Diffusers is the one package to carry.

1. Here, once, before the call::

       bash benchmarks/gpu_session.sh --fetch-wheels

   saves Diffusers' wheel (the version installed here, 0.42.1: ``diffusers-0.42.1-py3-none-any.whl``, pure
   Python, about 6 MB) into ``benchmarks/wheels/``, which git ignores. Its needs (huggingface-hub >= 1.32,
   safetensors >= 0.8, numpy, regex, requests, filelock, Pillow) are in the image; nothing else is carried.
   (The tree that travels was about 24 MB on 2026-12-04; with the wheel it stays under the 64 MiB limit.)
2. One call of the device tool, from the repository root::

       run(command='set -o pipefail; bash benchmarks/gpu_session.sh "$OUT" 2>&1 | tee "$OUT/gpu_session.log"',
           carry=["benchmarks/wheels"], timeout_s=450)

   The wrapper installs the carried wheel into /tmp and gives the stages 400 s (``GPU_SESSION_BUDGET_S``)
   under an outer limit of 430 s. ``$OUT`` gets ``gpu_session.json`` and ``gpu_session.md`` (rewritten after
   every stage and row, so a cut run keeps what it measured) and the log; the reply's output_tail ends with
   the Markdown. With the machine's start the call stays under 10 minutes of device time, leaving about 5 of
   the session's 15 for a shorter second try (e.g. ``... gpu_session.sh "$OUT" --stages versions,timing``).
3. ``give_back``; copy ``gpu_session.json`` from the reply's files_at to
   ``benchmarks/results/gpu_session-YYYY-MM-DD.json``, then
   ``python benchmarks/gpu_session.py --report benchmarks/results/gpu_session-YYYY-MM-DD.json --write-doc
   docs/speed.md`` and commit both.

``python benchmarks/gpu_session.py OUT [--smoke]`` works too where this tree's packages are importable.

Stages, in the order they run. Each has a time limit and a share of the budget it needs to start
(:data:`STAGES`); a stage never takes the time the later ones need to start (:func:`stage_limit`,
:func:`plan_budget`), so the compile stage, third, cannot starve the timing stages and they cannot starve it.
On CUDA each stage runs in its own process under its limit (a kernel fault or a hung compile costs one stage).

``versions``     torch, CUDA, cuDNN, Triton, Diffusers, the GPU; which SDPA kernels run (flash, cuDNN,
                 memory-efficient, math, each alone), whether FlashAttention-2 / -3 import (without FA3,
                 cuDNN SDPA stands in for it), which MHLA paths exist (fused forward, its custom op
                 ``mhla_diffusion.ops.fused_op``, the fused backward ``mhla_diffusion.ops.triton_mhla_backward``);
                 the copy bandwidth and bf16 matmul rate.
``correctness``  bf16 on the device against float64 on the CPU, on even, uneven and empty-block grids, paper
                 and released settings, autocast off and on: the operator, the Wan processor's whole path
                 and the fused Triton kernel.
``endtoend``     a 30-block Wan2.1-1.3B-shaped transformer (random weights) at 21x30x52 tokens with 512 text
                 tokens: eager, stock per SDPA backend against MHLA paper (fused kernel, and with it switched
                 off: the eager operator) and released; then the converted transformer compiled by block
                 (``compile_repeated_blocks(fullgraph=True)``: one Wan block compiled, reused by all 30; MHLA
                 paper, stock, MHLA released, as long as the stage's time allows): compile time, compiled
                 against eager time and output, and which attention path the compiled graph holds
                 (:class:`GraphRecorder`: the MHLA custom op's calls, or none when Dynamo traced the eager
                 operator; the fused kernels' launches in one profiled compiled forward).
``gradients``    before the attention is timed: the fused bf16 forward and backward at the first timing grid
                 with signed mixing, output and ``dq, dk, dv, dW`` against a float32 eager reference, beside
                 the bf16 eager operator's errors (a row passes within 1.5x of eager's).
``timing``       attention forwards at 21x30x50 and 21x30x52 (B=1, H=12, D=128, bf16): the MHLA operator
                 (plan per call, precomputed, with RoPE), the Wan processor's path in both settings, the
                 fused kernel, a plain einsum linear attention, SDPA flash / cuDNN / memory-efficient,
                 FlashAttention-2 / -3 where they import; TF32 off and on; GB/s against the bytes counted on
                 meta tensors; each also replayed from a CUDA graph.
``training``     forward and forward + backward of the attention for fine-tuning (same shapes, inputs and
                 mixing requiring grad): the public fused entry ``mhla_attention_fused`` (whose autograd uses
                 the fused backward where one is registered, else recomputes eagerly), the eager operator,
                 SDPA's backward per kernel, FlashAttention-2 / -3; which kernels the fused backward launched.
``profile``      torch.profiler's top ops of one processor call and one fused call.
``families``     each model family's self-attention at its published size (``mhla bench --families``: Wan,
                 SkyReels-V2, HunyuanVideo, LTX-Video, CogVideoX, SANA-Video, Flux; the joint ones with their
                 text tokens), SDPA against global linear attention and the eager MHLA operator; last, on what
                 time is left, one family after the other.

Timing (:func:`time_loops`): after warm-up calls, each method is timed as a loop of back-to-back calls with one
pair of CUDA events around the whole loop (not around each sub-millisecond call, which would put the host's
launch time inside the window); the calls per loop are chosen so that a loop lasts about
``LoopPlan.target_s``; the loops of all methods are interleaved over ``repeats`` rounds; a row reports the
median loop time / calls and the spread (slowest / fastest loop). The attention rows are timed again as CUDA
graph replays (device time without host launches) where the call can be captured.

Compile choice: Diffusers' regional compilation, ``transformer.compile_repeated_blocks(fullgraph=True)``: every
``WanTransformerBlock`` is compiled with ``torch.compile``, and the 30 identical blocks share one compiled graph
(Dynamo treats their parameters as inputs), so a cold compile costs one block, not 30, and leaves the later
stages their time (issue 61); embeddings and the output head stay eager. In Inductor's default mode, not
``mode="max-autotune-no-cudagraphs"``. The GEMMs of a 1536-wide model at 32k tokens are large, and cuBLAS
runs them near the matmul ceiling already; max-autotune would benchmark Triton templates for every GEMM
shape on a cold machine, minutes of the lease for little, and leave no time for a comparison compile of the
stock model. CUDA graphs ("reduce-overhead") gain nothing on forwards of 0.1 s and more. ``fullgraph=True``
turns any graph break in a block into the row's error. The backend is Inductor wrapped in :class:`GraphRecorder`
(Dynamo's ``lookup_backend("inductor")``: what ``backend="inductor"`` compiles with in the default mode).

Then the Markdown (:func:`render_markdown`) goes into ``docs/speed.md`` between ``<!-- mhla-bench:cuda -->`` and
``<!-- /mhla-bench:cuda -->`` with ``--write-doc docs/speed.md`` (also from a saved JSON: ``--report``).

``--smoke`` runs every stage at tiny sizes on the CPU, in one process (the test suite does, in
``tests/bench/test_gpu_session.py``), timed by the wall clock around the same loops; parts that need CUDA are
skipped with a note saying so.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # run as a script: import mhla_diffusion from this tree and the stages beside it
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from gpu_stages import *  # noqa: E402,F403 -- every name of the session, as this script had them
from gpu_stages.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
