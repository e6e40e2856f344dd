"""Reading and writing weights: MHLA weight folders, checkpoint files, the original Wan and DiT
formats, and loading pipelines or transformers from folders and hub ids."""
