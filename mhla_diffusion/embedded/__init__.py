"""The embedded demonstration models: where they are, and everything that builds them (no downloads).

``mhla build-embedded`` (:mod:`.build`) trains them from scratch into ``mhla_diffusion/embedded/models/``:

* :mod:`.locations`: the model folders, the judges and the settings the models were trained for;
* :mod:`.moving_shapes` / :mod:`.shapes_dataset`: procedural text-to-video clips and their folder;
* :mod:`.digits`: scikit-learn's handwritten digits as a class-to-image folder;
* :mod:`.video_judge` / :mod:`.image_judge`: classifiers trained on that ground truth;
* :mod:`.judge_features` / :mod:`.judge_io`: the judges as ``mhla_diffusion.eval`` feature networks, save/load;
* :mod:`.judge_reading`: what a judge reads in one generated sample, with its confidence;
* :mod:`.long_video`: a long video's measures (judged windows, centroid jumps, speed drift) and the ways to make one;
* :mod:`.autoencoders`: tiny Wan (video) and SD-style (image) VAEs trained here on that data;
* :mod:`.build` / :mod:`.reproduction`: the build's stages and the reproduction table.

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
        ".autoencoders",
    ),
    **dict.fromkeys(
        ["DIGIT_SIZE", "NUM_DIGIT_CLASSES", "DigitSplit", "load_digits_images", "split_digits", "write_digits_folder"],
        ".digits",
    ),
    **dict.fromkeys(["ImageJudge", "class_accuracy", "predict_classes", "train_image_judge"], ".image_judge"),
    **dict.fromkeys(
        ["ImageJudgeFeatures", "VideoJudgeFeatures", "clips_to_filmstrips", "filmstrips_to_clips", "judge_features"],
        ".judge_features",
    ),
    **dict.fromkeys(["load_judge", "load_judge_features", "save_judge"], ".judge_io"),
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
        ".moving_shapes",
    ),
    **dict.fromkeys(["write_shapes_dataset"], ".shapes_dataset"),
    **dict.fromkeys(["VideoJudge", "predict_attributes", "prompt_accuracy", "train_video_judge"], ".video_judge"),
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
    **dict.fromkeys(["ImageReading", "JudgeReader", "VideoReading", "requested_attributes"], ".judge_reading"),
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
        ".long_video",
    ),
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
