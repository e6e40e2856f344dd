"""Self-contained demonstration data and quality judges (no downloads).

* :mod:`.moving_shapes` / :mod:`.shapes_dataset`: procedural text-to-video clips and their folder;
* :mod:`.digits`: scikit-learn's handwritten digits as a class-to-image folder;
* :mod:`.video_judge` / :mod:`.image_judge`: classifiers trained on that ground truth;
* :mod:`.judge_features` / :mod:`.judge_io`: the judges as ``mhla_diffusion.eval`` feature networks, save/load;
* :mod:`.autoencoders`: tiny Wan (video) and SD-style (image) VAEs trained here on that data.
"""

from .autoencoders import (latent_statistics, reconstruct_clips, reconstruct_images, tiny_image_vae, tiny_video_vae,
                           train_image_vae, train_video_vae)
from .digits import DIGIT_SIZE, NUM_DIGIT_CLASSES, DigitSplit, load_digits_images, split_digits, write_digits_folder
from .image_judge import ImageJudge, class_accuracy, predict_classes, train_image_judge
from .judge_features import (ImageJudgeFeatures, VideoJudgeFeatures, clips_to_filmstrips, filmstrips_to_clips,
                             judge_features)
from .judge_io import load_judge, load_judge_features, save_judge
from .moving_shapes import (ATTRIBUTES, BACKGROUND, COLOURS, DIRECTIONS, FRAME_SIZE, NUM_COMBINATIONS, NUM_FRAMES,
                            SHAPES, ShapeClip, caption_for, generate_clips, parse_caption, render_clip, shape_clip)
from .shapes_dataset import write_shapes_dataset
from .video_judge import VideoJudge, predict_attributes, prompt_accuracy, train_video_judge

__all__ = [
    "ATTRIBUTES", "BACKGROUND", "COLOURS", "DIGIT_SIZE", "DIRECTIONS", "FRAME_SIZE", "NUM_COMBINATIONS",
    "NUM_DIGIT_CLASSES", "NUM_FRAMES", "SHAPES", "DigitSplit", "ImageJudge", "ImageJudgeFeatures", "ShapeClip",
    "VideoJudge", "VideoJudgeFeatures", "caption_for", "class_accuracy", "clips_to_filmstrips",
    "filmstrips_to_clips", "generate_clips", "judge_features", "latent_statistics", "load_digits_images", "load_judge",
    "load_judge_features", "parse_caption", "predict_attributes", "predict_classes", "prompt_accuracy",
    "reconstruct_clips", "reconstruct_images", "render_clip", "save_judge", "shape_clip", "split_digits",
    "tiny_image_vae", "tiny_video_vae", "train_image_judge", "train_image_vae", "train_video_judge",
    "train_video_vae", "write_digits_folder", "write_shapes_dataset",
]
