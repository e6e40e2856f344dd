"""The embedded demonstration models: where they are (:mod:`.locations`; the weights in ``models/``), and, in
one subpackage per job, everything that makes them (no downloads):

* :mod:`.worlds`: the synthetic data (moving and bouncing shapes, handwritten digits) and their folders;
* :mod:`.judges`: classifiers trained on that ground truth, as readers of one sample and as feature networks;
* :mod:`.builds`: ``mhla build-embedded``'s stages, the tiny VAEs, the streaming student, the long-video
  measures, the side-by-side figure and the reproduction table.

Names are re-exported lazily: ``from mhla_diffusion.embedded import embedded_model`` does not import torch.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        [
            "latent_statistics",
            "reconstruct_clips",
            "reconstruct_images",
            "tiny_image_vae",
            "tiny_video_vae",
            "train_image_vae",
            "train_video_vae",
        ],
        ".builds.autoencoders",
    ),
    **dict.fromkeys(
        ["DIGIT_SIZE", "NUM_DIGIT_CLASSES", "DigitSplit", "load_digits_images", "split_digits", "write_digits_folder"],
        ".worlds.digits",
    ),
    **dict.fromkeys(["ImageJudge", "class_accuracy", "predict_classes", "train_image_judge"], ".judges.image_judge"),
    **dict.fromkeys(
        ["ImageJudgeFeatures", "VideoJudgeFeatures", "clips_to_filmstrips", "filmstrips_to_clips", "judge_features"],
        ".judges.judge_features",
    ),
    **dict.fromkeys(["load_judge", "load_judge_features", "save_judge"], ".judges.judge_io"),
    **dict.fromkeys(
        [
            "ATTRIBUTES",
            "BACKGROUND",
            "COLOURS",
            "DIRECTIONS",
            "FRAME_SIZE",
            "NUM_COMBINATIONS",
            "NUM_FRAMES",
            "SHAPES",
            "ShapeClip",
            "caption_for",
            "generate_clips",
            "parse_caption",
            "render_clip",
            "shape_clip",
        ],
        ".worlds.moving_shapes",
    ),
    **dict.fromkeys(["write_shapes_dataset"], ".worlds.shapes_dataset"),
    **dict.fromkeys(
        ["VideoJudge", "predict_attributes", "prompt_accuracy", "train_video_judge"], ".judges.video_judge"
    ),
    **dict.fromkeys(
        [
            "EMBEDDED_ROOT",
            "EmbeddedDefaults",
            "EmbeddedFolder",
            "embedded_defaults",
            "embedded_folder",
            "embedded_judge",
            "embedded_model",
        ],
        ".locations",
    ),
    **dict.fromkeys(["ImageReading", "JudgeReader", "VideoReading", "requested_attributes"], ".judges.judge_reading"),
    **dict.fromkeys(
        [
            "LongVideoMeasures",
            "TimedCall",
            "WindowReading",
            "centroids",
            "independent_clips",
            "measure_long_video",
            "stream_frames",
            "timed",
            "window_readings",
        ],
        ".builds.long_video",
    ),
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
