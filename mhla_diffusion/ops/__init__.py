"""The MHLA operator's companions: counting the memory traffic of an attention call
(:mod:`~mhla_diffusion.ops.traffic`)."""
