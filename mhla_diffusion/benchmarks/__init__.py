"""What ``mhla bench`` measures: operator and model speed, memory traffic, loading and context
parallelism."""
