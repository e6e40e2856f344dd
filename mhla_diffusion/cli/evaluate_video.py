"""``mhla eval-video``: FVD, CLIP score and (for the embedded models) judge metrics of a folder of videos.

    mhla eval-video --samples videos/ --ref real_videos/ --i3d-weights i3d_torchscript.pt \\
        --clip-model clip-vit-large-patch14/ --save-ref real_fvd.npz
    mhla eval-video --samples videos/ --ref real_fvd.npz --i3d-weights i3d_torchscript.pt --metrics fvd
    mhla eval-video --samples shapes/ --judge embedded --metrics judge

Prompts (CLIP score, judge accuracy) come from each video's sidecar ``.json`` (written by
``mhla text-to-video``) or ``--prompts FILE``. Nothing is downloaded: a missing network names the
file to fetch and the option that takes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .arguments import add_command, parse_device, parse_names, positive_int

__all__ = ["METRICS", "register", "run_eval_video"]

METRICS = ("fvd", "clip", "judge")


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "eval-video",
        configure,
        help="FVD, CLIP score and embedded-judge metrics of a folder of generated videos",
        description="Evaluate a folder of .mp4 videos: FVD against a reference folder or .npz (I3D TorchScript file "
        "you supply), CLIP score of the videos' prompts (a local CLIP folder), and for the embedded moving-shapes "
        "models the judge's per-attribute accuracy and judge FID. Nothing is downloaded.",
    )


def configure(p: argparse.ArgumentParser) -> None:
    from ..eval.video_weights import CLIP_MODEL_ENV, I3D_WEIGHTS_ENV, I3D_WEIGHTS_NAME

    p.add_argument("--samples", required=True, type=Path, help='folder of .mp4 videos (sidecar .json with "prompt")')
    p.add_argument("--ref", type=Path, help="FVD reference: folder of .mp4 videos or an .npz of I3D mu/sigma")
    p.add_argument(
        "--prompts",
        type=Path,
        help="text file, one prompt a line in the sorted order of the video names (default: sidecar JSONs)",
    )
    p.add_argument(
        "--i3d-weights",
        metavar="PATH",
        help=f"FVD I3D TorchScript file ({I3D_WEIGHTS_NAME}); default ${I3D_WEIGHTS_ENV}",
    )
    p.add_argument("--clip-model", metavar="FOLDER", help=f"local CLIP model folder; default ${CLIP_MODEL_ENV}")
    p.add_argument("--judge", choices=("embedded",), help="also score with the embedded moving-shapes video judge")
    p.add_argument(
        "--metrics",
        type=parse_names(METRICS),
        help="comma-separated subset of fvd, clip, judge (default: fvd,clip, plus judge with --judge)",
    )
    p.add_argument("--save-ref", type=Path, help="write the I3D statistics of a --ref folder to this .npz")
    p.add_argument("--output", type=Path, help="JSON file for the results (default: <samples>_eval_video.json)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="clips per I3D batch")
    p.add_argument("--device", type=parse_device, help="cuda / cpu / cuda:1 ... (default: cuda if available)")
    p.add_argument("--overwrite", action="store_true", help="replace the output files if they exist")
    p.set_defaults(func=run_eval_video)


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _judge_metrics(samples: Path, ref: Path | None, prompts: list[str]) -> tuple[dict, dict]:
    """Per-attribute accuracy and judge-feature FID / precision / recall (``embedded.builds.reproduction.score_clips``),
    with a note where precision/recall are not computed and warnings for sets too small for FID; and the
    judge's network record."""
    import numpy as np

    from ..embedded.builds.build_settings import REFERENCE_SEED, BuildSettings
    from ..embedded.builds.reproduction import PR_K, score_clips
    from ..embedded.judges.judge_io import load_judge_features
    from ..embedded.locations import embedded_judge
    from ..embedded.worlds.moving_shapes import generate_clips, parse_caption
    from ..eval.video import iter_videos
    from ..eval.video_files import list_videos

    features = load_judge_features(embedded_judge("video"))
    judge = features.judge
    shape = (judge.config["num_frames"], judge.config["frame_size"], judge.config["frame_size"], 3)

    def clips_of(paths) -> np.ndarray:
        clips = list(iter_videos(paths))
        bad = [p.name for p, c in zip(paths, clips) if c.shape != shape]
        if bad:
            raise ValueError(
                f"the embedded video judge takes clips of {shape[0]} frames of {shape[1]}x{shape[2]} "
                f"(the embedded models' size); {', '.join(bad[:5])} differ"
            )
        return np.stack(clips)

    attributes = [parse_caption(text) for text in prompts]
    clips = clips_of(list_videos(samples))
    if ref is not None and ref.is_dir():
        reference, source = clips_of(list_videos(ref)), str(ref)
    else:  # the ground-truth generator's held-out clips, the reference of the build's reproduction table
        reference, _, _ = generate_clips(BuildSettings().reference_clips, seed=REFERENCE_SEED)
        source = f"procedural moving-shapes clips (seed {REFERENCE_SEED}, as the reproduction table)"
    accuracy, metrics = score_clips(clips, attributes, reference, judge)
    note = None
    if metrics.get("precision") is None:
        note = (
            f"not computed: improved precision/recall take each clip's k-th nearest neighbour (k={PR_K}, as the "
            f"reproduction table) and need more than {PR_K} clips on each side; got {len(clips)} samples and "
            f"{len(reference)} reference clips"
        )
    result = {
        "accuracy": accuracy,
        "fid": metrics["fid"],
        "precision": metrics.get("precision"),
        "recall": metrics.get("recall"),
        "precision_recall_note": note,
        "reference": source,
        "reference_count": int(len(reference)),
        "warnings": _small_set_warnings(len(clips), len(reference), features.pool_dim, BuildSettings().eval_clips),
    }
    return result, features.info()


def _small_set_warnings(samples: int, reference: int, dim: int, table_clips: int) -> list[str]:
    """A warning per side with at most ``dim`` clips: their covariance (rank <= clips - 1) is singular in the
    judge's ``dim``-d feature space, and the FID mostly reflects the set size (``table_clips``: the set size
    of the reproduction table, named as the comparable one)."""
    return [
        f"judge FID on {count} {side}: with at most {dim} clips (the judge's feature size) the covariance is "
        f"singular and FID is dominated by the set size, not comparable with other sets; use more than {dim} "
        f"clips (the reproduction table uses {table_clips} clips)"
        for side, count in (("sample clips", samples), ("reference clips", reference))
        if count <= dim
    ]


def run_eval_video(args: argparse.Namespace) -> int:
    from ..eval.video_files import list_videos, read_prompts
    from ..eval.video_weights import resolve_clip_model, resolve_i3d_weights

    started = time.perf_counter()
    metrics = args.metrics or (("fvd", "clip") + (("judge",) if args.judge else ()))
    if "judge" in metrics and args.judge is None:
        args.judge = "embedded"
    if not args.samples.is_dir():
        raise FileNotFoundError(f"--samples {args.samples} is not a folder of videos")
    if "fvd" in metrics and args.ref is None:
        raise ValueError("FVD needs --ref (a folder of videos or an FVD .npz); or choose --metrics without fvd")
    if args.ref is not None and not args.ref.exists():
        raise FileNotFoundError(f"--ref {args.ref} does not exist")
    if args.save_ref is not None and "fvd" not in metrics:
        raise ValueError("--save-ref writes FVD statistics: include fvd in --metrics")
    output = args.output or args.samples.with_name(args.samples.name + "_eval_video.json")
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} already exists; choose another --output or pass --overwrite")
    # Every network file and the prompts the metrics need are checked before any work starts.
    i3d_path = resolve_i3d_weights(args.i3d_weights) if "fvd" in metrics else None
    clip_path = resolve_clip_model(args.clip_model) if "clip" in metrics else None
    needs_prompts = "clip" in metrics or "judge" in metrics
    prompts = read_prompts(list_videos(args.samples), args.prompts) if needs_prompts else args.prompts

    from ..eval.clip_score import VideoCLIPScore
    from ..eval.fvd import I3DFeatures
    from ..eval.video import evaluate_videos

    device = _device(args.device)
    i3d = I3DFeatures(i3d_path, device=device) if i3d_path else None
    clip = VideoCLIPScore(clip_path, device=device) if clip_path else None
    if i3d is not None:
        print(f"I3D: {i3d.weights_path} sha256={i3d.weights_sha256}")
    result = evaluate_videos(
        args.samples,
        args.ref,
        i3d=i3d,
        clip=clip,
        prompts=prompts,
        batch_size=args.batch_size,
        save_ref=args.save_ref,
        overwrite=args.overwrite,
    )
    if "judge" in metrics:
        result["judge"], result["networks"]["judge"] = _judge_metrics(args.samples, args.ref, prompts)
    result["seconds"] = round(time.perf_counter() - started, 2)
    m = result["metrics"]
    print(f"videos: {result['samples']['count']} from {args.samples}")
    if m["fvd"] is not None:
        print(f"FVD{'':<15}{m['fvd']:>12.4f}  (reference: {result['reference']['path']})")
        if "saved_to" in result["reference"]:
            print(f"wrote FVD reference {result['reference']['saved_to']}")
    if m["clip_score"] is not None:
        print(f"CLIP score{'':<8}{m['clip_score']:>12.4f}")
    if "judge" in result:
        judge = result["judge"]
        for name, value in judge["accuracy"].items():
            print(f"{'judge acc ' + name:<18}{value:>12.4f}")
        print(f"{'judge FID':<18}{judge['fid']:>12.4f}  (reference: {judge['reference']})")
        for name in ("precision", "recall"):
            value = judge[name]
            shown = f"{value:>12.4f}" if value is not None else f"{'-':>12}  ({judge['precision_recall_note']})"
            print(f"{'judge ' + name:<18}{shown}")
        for message in judge["warnings"]:
            print(f"warning: {message}", file=sys.stderr)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output} ({result['seconds']:.1f} s)")
    return 0
