"""ADM-compatible FID / sFID / IS / precision-recall evaluation.

Definitions follow OpenAI's ADM evaluator (the numbers in the ADM, DiT and MHLA papers); the
Inception network is torch-fidelity's TF-compatible port, loaded from a weights file the user
supplies (``--inception-weights`` / ``$MHLA_INCEPTION_WEIGHTS``); nothing is downloaded.
"""

from .evaluate import Activations, Reference, compute_activations, evaluate, load_reference, make_reference
from .features import FeatureExtractor, exact_float32, flatten_spatial, spatial_features
from .frechet import GaussianStats, RunningGaussian, frechet_distance, gaussian_stats
from .images import ArrayImages, FolderImages, ImageSource, NpzImages, open_images
from .inception import INCEPTION_WEIGHTS_ENV, InceptionV3Features, resolve_inception_weights
from .inception_score import inception_score, inception_score_splits
from .npz import AdmNpzWriter, iter_npz_batches, read_npz_stats
from .precision_recall import manifold_radii, precision_recall
from .sample import SamplingConfig, class_labels, pack_samples, sample_for_evaluation

__all__ = [
    "INCEPTION_WEIGHTS_ENV",
    "Activations",
    "AdmNpzWriter",
    "ArrayImages",
    "FeatureExtractor",
    "FolderImages",
    "GaussianStats",
    "ImageSource",
    "InceptionV3Features",
    "NpzImages",
    "Reference",
    "RunningGaussian",
    "SamplingConfig",
    "class_labels",
    "compute_activations",
    "evaluate",
    "exact_float32",
    "flatten_spatial",
    "frechet_distance",
    "gaussian_stats",
    "inception_score",
    "inception_score_splits",
    "iter_npz_batches",
    "load_reference",
    "make_reference",
    "manifold_radii",
    "open_images",
    "pack_samples",
    "precision_recall",
    "read_npz_stats",
    "resolve_inception_weights",
    "sample_for_evaluation",
    "spatial_features",
]
