"""The judges: classifiers trained on the worlds' ground truth that read what a generated sample shows
(:mod:`.video_judge`, :mod:`.image_judge`, their training in :mod:`.judge_training`), serve as feature networks
for ``mhla_diffusion.eval`` (:mod:`.judge_features`), are saved and loaded (:mod:`.judge_io`), and say what they
read in one sample, with its confidence (:mod:`.judge_reading`)."""
