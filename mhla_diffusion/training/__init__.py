"""What the from-scratch trainings of this library share (the embedded models' builds and ``mhla reproduce``):
resumable units of work whose results are kept on disk (:mod:`.stages`) and a training loop with per-step seeds,
checkpoints and resume inside a unit, and a progress bar (:mod:`.loop`)."""
