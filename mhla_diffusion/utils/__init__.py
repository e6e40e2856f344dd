"""Rules that need no torch: sizes -> token grids, published model sizes, model defaults, the
sequence split of context parallelism and the Diffusers warning filter."""
