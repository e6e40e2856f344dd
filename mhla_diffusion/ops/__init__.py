"""The MHLA operator: one implementation of block regrouping, summaries, mixing and output.

- :mod:`~mhla_diffusion.ops.attention`: ``mhla_attention``, the O(N) operator (CPU and eager GPU).
- :mod:`~mhla_diffusion.ops.causal`: block-causal MHLA (``mhla_causal_attention`` over a whole clip,
  ``mhla_causal_step`` chunk by chunk with a carried ``CausalMHLAState``), on the same block math.
- :mod:`~mhla_diffusion.ops.naive`: the O(N^2) definitions the fast paths are tested against.
- :mod:`~mhla_diffusion.ops.triton_mhla`, :mod:`~mhla_diffusion.ops.triton_mhla_backward`: the fused Triton
  forward and backward (CUDA); :mod:`~mhla_diffusion.ops.fused_op` wraps them as one custom op
  (``mhla_attention_fused``) that ``torch.compile`` keeps.
- :mod:`~mhla_diffusion.ops.cpu_workers`: the worker threads of the CPU operator's chunk loops.
- :mod:`~mhla_diffusion.ops.context_parallel`: the split-sequence hook (partial summaries all-reduced).
- :mod:`~mhla_diffusion.ops.block_layout`, :mod:`~mhla_diffusion.ops.mixing`: blocks of the token grid
  and the locality initialisation of the mixing coefficients.
- :mod:`~mhla_diffusion.ops.traffic`: bytes moved by an attention call, counted on meta tensors.
- :mod:`~mhla_diffusion.ops.cpu_memory`: the CPU allocator setting applied at the first CPU call.
"""
