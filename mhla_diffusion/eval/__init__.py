"""ADM-compatible FID / sFID / IS / precision-recall evaluation.

Definitions follow OpenAI's ADM evaluator (the numbers in the ADM, DiT and MHLA papers); the
Inception network is torch-fidelity's TF-compatible port, loaded from a weights file the user
supplies (``--inception-weights`` / ``$MHLA_INCEPTION_WEIGHTS``); nothing is downloaded.

``ADMFrechetInceptionDistance``, ``SpatialFID``, ``ADMInceptionScore`` and ``ADMPrecisionRecall`` are
the same metrics as torchmetrics ``Metric`` classes (DDP-synchronised states), for use inside training.

Names are re-exported lazily (PEP 562): ``python -m mhla_diffusion.eval --help`` and the ``mhla``
command do not import torch until an evaluation runs.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["Activations", "compute_activations", "evaluate", "make_reference"], ".evaluate"),
    **dict.fromkeys(
        ["ADMFrechetInceptionDistance", "ADMInceptionScore", "ADMPrecisionRecall", "SpatialFID", "extract_features"],
        ".metrics",
    ),
    **dict.fromkeys(["Reference", "load_reference"], ".reference"),
    **dict.fromkeys(
        ["FeatureExtractor", "TensorFeatures", "exact_float32", "flatten_spatial", "spatial_features"], ".features"
    ),
    **dict.fromkeys(["GaussianStats", "RunningGaussian", "frechet_distance", "gaussian_stats"], ".frechet"),
    **dict.fromkeys(["FVD_FRAMES", "I3DFeatures", "fvd_stats", "load_fvd_reference", "save_fvd_reference"], ".fvd"),
    **dict.fromkeys(["VideoCLIPScore"], ".clip_score"),
    **dict.fromkeys(["evaluate_videos"], ".video"),
    **dict.fromkeys(["I3D_WEIGHTS_ENV", "resolve_clip_model", "resolve_i3d_weights"], ".video_weights"),
    **dict.fromkeys(["ArrayImages", "FolderImages", "ImageSource", "NpzImages", "open_images"], ".images"),
    **dict.fromkeys(["InceptionV3Features"], ".inception"),
    **dict.fromkeys(["INCEPTION_WEIGHTS_ENV", "resolve_inception_weights"], ".inception_weights"),
    **dict.fromkeys(["inception_score", "inception_score_splits", "inception_score_warnings"], ".inception_score"),
    **dict.fromkeys(["AdmNpzWriter", "iter_npz_batches", "read_npz_stats"], ".npz"),
    **dict.fromkeys(["manifold_radii", "precision_recall"], ".precision_recall"),
    **dict.fromkeys(["SamplingConfig", "class_labels", "pack_samples", "sample_for_evaluation"], ".sample"),
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
