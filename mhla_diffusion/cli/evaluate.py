"""``mhla eval``, ``mhla eval-ref`` and ``mhla eval-sample``: ADM-style evaluation from the command line.

    mhla eval-sample --pipeline facebook/DiT-XL-2-256 --output-dir samples/ --num-samples 50000
    mhla eval --samples samples.npz --ref VIRTUAL_imagenet256_labeled.npz --inception-weights W.pth
    mhla eval-ref --images imagenet256/ --output my_ref.npz --inception-weights W.pth

The same commands run as ``python -m mhla_diffusion.eval ...`` (:mod:`mhla_diffusion.eval.__main__`),
the form ``accelerate launch -m`` and ``torchrun -m`` take. Each handler takes the parsed namespace and
returns an exit code, raising ``ValueError`` / ``FileNotFoundError`` / ``FileExistsError`` for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..utils.choices import WEIGHT_DTYPES
from ..utils.options import at_least, number
from .arguments import add_command, non_negative_float, parse_device, positive_int, seed

__all__ = ["add_sample_arguments", "load_feature_extractor", "register", "run_eval", "run_eval_ref", "run_sample"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``eval``, ``eval-ref`` and ``eval-sample`` to a parser's subcommands."""
    add_command(
        subparsers,
        "eval",
        configure_eval,
        help="FID, sFID, Inception Score, precision/recall of samples against a reference (ADM evaluator)",
        description="Evaluate generated images against a reference batch with the ADM evaluator's definitions: "
        "FID and sFID (Frechet distances of Inception pool_3 and mixed_6/conv features), Inception Score "
        "(consecutive 5000-sample splits) and improved precision/recall (k = 3).",
    )
    add_command(
        subparsers,
        "eval-ref",
        configure_eval_ref,
        help="compute reference statistics once and save them as an ADM .npz",
        description="Compute mu, sigma, mu_s, sigma_s over all images of a folder or .npz and save them, with a "
        "random subset of the images as arr_0 (for precision/recall), in ADM's reference-batch format.",
    )
    add_command(
        subparsers,
        "eval-sample",
        add_sample_arguments,
        help="generate N class-to-image samples for evaluation (resumable, multi-process)",
        description="Generate class-conditional samples with a DiT-style pipeline into a folder, one PNG per "
        "sample with a per-sample seed, skipping samples already there, then pack them into an ADM .npz. Run with "
        "`accelerate launch` to spread the samples over processes.",
    )


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def load_feature_extractor(weights: str | None, device: str):
    """The Inception network for the CLI (tests replace this with a stand-in)."""
    from ..eval.inception import InceptionV3Features

    return InceptionV3Features(weights, device=device)


def _add_network_arguments(p: argparse.ArgumentParser) -> None:
    from ..eval.inception_weights import INCEPTION_WEIGHTS_ENV, INCEPTION_WEIGHTS_NAMES

    p.add_argument(
        "--inception-weights",
        metavar="PATH",
        help=f"FID Inception-v3 weights ({INCEPTION_WEIGHTS_NAMES[0]}); default ${INCEPTION_WEIGHTS_ENV}",
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per Inception batch (ADM: 64)")
    p.add_argument("--device", type=parse_device, help="cuda / cpu / cuda:1 ... (default: cuda if available)")
    p.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="skip unreadable image files (listed in the output) instead of stopping",
    )
    p.add_argument("--workers", type=positive_int, default=4, help="threads that decode image files")
    p.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def configure_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", required=True, type=Path, help="folder of images or ADM .npz (arr_0 uint8 NHWC)")
    p.add_argument(
        "--ref",
        required=True,
        type=Path,
        help="reference: ADM .npz (mu/sigma/mu_s/sigma_s and/or arr_0) or a folder of images",
    )
    p.add_argument("--output", type=Path, help="JSON file for the results (default: <samples>_eval.json)")
    p.add_argument("--split-size", type=positive_int, default=5000, help="Inception Score split size (ADM: 5000)")
    p.add_argument("--k", type=positive_int, default=3, help="nearest neighbour for precision/recall (ADM: 3)")
    p.add_argument("--no-pr", dest="precision_recall", action="store_false", help="skip precision/recall")
    p.add_argument("--pr-block-size", type=positive_int, default=10000, help="rows per distance block for P/R")
    p.add_argument(
        "--pr-dtype",
        choices=("float32", "float16"),
        default="float32",
        help="precision of the P/R distances: float32 (default) or float16 as ADM's evaluator "
        "(its P/R come out about 0.001-0.005 higher than float32)",
    )
    _add_network_arguments(p)
    p.set_defaults(func=run_eval)


def configure_eval_ref(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", required=True, type=Path, help="folder of images or ADM .npz")
    p.add_argument("--output", required=True, type=Path, help="reference .npz to write")
    p.add_argument(
        "--pr-images",
        type=number(int, at_least(0, zero="statistics only, no arr_0")),
        default=10000,
        help="images stored as arr_0 for precision/recall (ADM: 10000)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the arr_0 subset")
    _add_network_arguments(p)
    p.set_defaults(func=run_eval_ref)


def add_sample_arguments(p: argparse.ArgumentParser) -> None:
    """The sampler's options and handler (``mhla eval-sample`` and ``python -m mhla_diffusion.eval eval-sample``)."""
    p.add_argument("--pipeline", required=True, help="DiT pipeline folder or hub id (DiTPipeline.from_pretrained)")
    p.add_argument("--mhla-weights", help="MHLA weights folder applied with load_mhla(DIR, pipe.transformer)")
    p.add_argument("--output-dir", required=True, type=Path, help="folder for the PNG samples (resumed if present)")
    p.add_argument("--npz", type=Path, help="packed ADM .npz (default: <output-dir>.npz)")
    p.add_argument("--num-samples", type=positive_int, default=50000, help="number of samples (ADM/DiT: 50000)")
    p.add_argument("--num-classes", type=positive_int, help="classes to draw from (default: the transformer's, 1000)")
    p.add_argument(
        "--classes",
        choices=("uniform", "balanced"),
        default="uniform",
        help="uniform: i.i.d. random labels (DiT); balanced: N/K per class, shuffled",
    )
    p.add_argument("--seed", type=seed, default=0, help="global seed; sample i uses a seed derived from (seed, i)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="samples per pipeline call and process")
    p.add_argument("--num-inference-steps", type=positive_int, default=250, help="denoising steps (DiT paper: 250)")
    p.add_argument(
        "--guidance-scale", type=non_negative_float, default=1.5, help="classifier-free guidance (DiT FID-50K: 1.5)"
    )
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, default="float32", help="pipeline weights dtype")
    p.add_argument("--overwrite", action="store_true", help="replace the .npz if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_sample)


def _format(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _print_network(extractor) -> None:
    info = extractor.info()
    print(f"feature network: {info['name']}")
    if info.get("weights_path"):
        print(f"weights: {info['weights_path']} sha256={info['weights_sha256']}")


def run_eval(args: argparse.Namespace) -> int:
    from ..eval.evaluate import evaluate, load_reference
    from ..eval.images import open_images
    from ..eval.inception_weights import resolve_inception_weights

    started = time.perf_counter()
    for name, path in (("--samples", args.samples), ("--ref", args.ref)):
        if not path.exists():
            raise FileNotFoundError(f"{name} {path} does not exist")
    output = args.output or args.samples.with_name(args.samples.stem + "_eval.json")
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} already exists; choose another --output or pass --overwrite")
    weights = resolve_inception_weights(args.inception_weights)
    samples = open_images(args.samples, skip_corrupt=args.skip_corrupt, workers=args.workers)
    reference = load_reference(args.ref, skip_corrupt=args.skip_corrupt, workers=args.workers)
    extractor = load_feature_extractor(str(weights), _device(args.device))
    _print_network(extractor)
    result = evaluate(
        samples,
        reference,
        extractor,
        batch_size=args.batch_size,
        split_size=args.split_size,
        k=args.k,
        with_precision_recall=args.precision_recall,
        pr_block_size=args.pr_block_size,
        pr_dtype=args.pr_dtype,
        progress=not args.quiet,
    )
    m = result["metrics"]
    print(
        f"samples: {result['samples']['count']} from {args.samples}; reference: {args.ref} "
        f"({result['reference']['statistics']})"
    )
    for kind in ("samples", "reference"):
        skipped = result[kind]["skipped"]
        if skipped:
            print(
                f"skipped {len(skipped)} unreadable {kind} images: {', '.join(skipped[:10])}"
                + (" ..." if len(skipped) > 10 else "")
            )
    print(f"{'metric':<18}{'value':>12}")
    for label, key in (
        ("Inception Score", "inception_score"),
        ("FID", "fid"),
        ("sFID", "sfid"),
        ("Precision", "precision"),
        ("Recall", "recall"),
    ):
        print(f"{label:<18}{_format(m[key]):>12}")
    for message in result["warnings"]:
        print(f"warning: {message}")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output} ({time.perf_counter() - started:.1f} s)")
    return 0


def run_eval_ref(args: argparse.Namespace) -> int:
    from ..eval.evaluate import make_reference
    from ..eval.images import open_images
    from ..eval.inception_weights import resolve_inception_weights

    if not args.images.exists():
        raise FileNotFoundError(f"--images {args.images} does not exist")
    if args.output.suffix != ".npz":
        raise ValueError(f"--output {args.output}: the reference file must end in .npz")
    if args.output.exists() and not args.overwrite:
        raise FileExistsError(f"{args.output} already exists; choose another --output or pass --overwrite")
    weights = resolve_inception_weights(args.inception_weights)
    source = open_images(args.images, skip_corrupt=args.skip_corrupt, workers=args.workers)
    extractor = load_feature_extractor(str(weights), _device(args.device))
    _print_network(extractor)
    summary = make_reference(
        source,
        extractor,
        args.output,
        pr_images=args.pr_images,
        seed=args.seed,
        batch_size=args.batch_size,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(
        f"wrote {summary['output']}: mu/sigma and mu_s/sigma_s over {summary['images']} images, "
        f"{summary['arr_0']} images as arr_0"
        + (f", {len(summary['skipped'])} unreadable skipped" if summary["skipped"] else "")
    )
    return 0


def _as_recorded(location: str | None) -> str | None:
    """Local paths are recorded absolute (so a resume from another directory matches); hub ids as given."""
    if location is None:
        return None
    return os.path.abspath(location) if os.path.exists(location) else location


def run_sample(args: argparse.Namespace) -> int:
    import torch

    from ..eval.sample import SamplingConfig, num_classes_of, pack_samples, process_state, sample_for_evaluation
    from ..loaders.loading import load_pipeline
    from ..pipelines.dit import MHLADiTPipeline

    npz = args.npz or args.output_dir.with_name(args.output_dir.name + ".npz")
    if npz.suffix != ".npz":
        raise ValueError(f"--npz {npz}: the packed file must end in .npz")
    if npz.exists() and not args.overwrite:
        raise FileExistsError(f"{npz} already exists; choose another --npz or pass --overwrite")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        raise ValueError(f"--output-dir {args.output_dir} exists and is not a folder")
    state = process_state()
    pipe = load_pipeline(
        MHLADiTPipeline, args.pipeline, mhla_weights=args.mhla_weights, attention=None, dtype=getattr(torch, args.dtype)
    )
    config = SamplingConfig(
        num_samples=args.num_samples,
        num_classes=args.num_classes or num_classes_of(pipe),
        class_mode=args.classes,
        seed=args.seed,
        num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale,
        pipeline=_as_recorded(args.pipeline),
        mhla_weights=_as_recorded(args.mhla_weights),
    )
    started = time.perf_counter()
    counts = sample_for_evaluation(
        pipe, args.output_dir, config, batch_size=args.batch_size, state=state, progress=not args.quiet
    )
    print(
        f"process {state.process_index}/{state.num_processes}: {counts['generated']} generated, "
        f"{counts['existing']} already there ({time.perf_counter() - started:.1f} s)"
    )
    if state.is_main_process:
        path = pack_samples(args.output_dir, npz, overwrite=args.overwrite, progress=not args.quiet)
        print(f"wrote {path}: {config.num_samples} samples ({config.class_mode} classes of {config.num_classes})")
    return 0
