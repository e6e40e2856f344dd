"""MHLA in Diffusers models: the attention processors, conversion of softmax self-attention, the
MHLA-preserving transformer classes, context parallelism and tiny test-size models."""
