"""``mhla bench --load``: peak memory and time of loading a full-size Wan transformer with MHLA.

The weights are made here, never downloaded: the published Wan2.1-T2V-1.3B transformer config with
random weights, converted with the released Wan-MHLA setting, written once into a work folder in
the forms users load:

* ``whole``: a converted transformer saved with ``save_mhla(..., include_base=True)``, loaded with
  ``load_mhla(folder)``;
* ``base+mhla``: a plain Diffusers transformer folder plus an MHLA-only folder, loaded with
  ``load_mhla(mhla_folder, load_transformer(base_folder))``;

each in float32 and bfloat16 (the dtype the files hold and the model is loaded in), plus two
comparisons: the float32 folder loaded as bfloat16, and the float32 folder read without
memory-mapping (``disable_mmap=True``, how this library loaded before).

Every load runs in a fresh Python process (:func:`measure_load`), which reports its resident memory
after the imports (the baseline), the peak resident memory during the load (``VmHWM`` of
``/proc/self/status``; memory-mapped file pages the load touches count), the peak after one small
forward pass (which touches every weight), the load time and the bytes of the loaded weights. The
table's ratio is ``(peak - baseline) / weight bytes``. Linux only (``/proc``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "LOAD_COLUMNS",
    "LoadCase",
    "default_cases",
    "in_weight_file_mapping",
    "load_table",
    "mapped_fraction",
    "measure_load",
    "parameter_count",
    "write_weights",
]

#: The marker file of a work folder this module wrote (a folder without it is never written into).
MARKER = "mhla_load_benchmark.json"

#: Table columns: (key, header, format).
LOAD_COLUMNS = (
    ("case", "case", ""),
    ("weights_gb", "weights GB", ".2f"),
    ("load_s", "load s", ".1f"),
    ("load_peak_gb", "peak GB (load)", ".2f"),
    ("load_ratio", "peak / weights (load)", ".2f"),
    ("forward_peak_gb", "peak GB (+1 forward)", ".2f"),
    ("forward_ratio", "peak / weights (+1 forward)", ".2f"),
    ("mapped", "weights memory-mapped", ".0%"),
)


@dataclass(frozen=True)
class LoadCase:
    """One way of loading: the folder ``form`` (``whole`` / ``base+mhla``) stored in ``stored`` dtype,
    loaded in ``dtype`` (``None``: as stored; passed as ``dtype=`` as a user does, since Diffusers
    otherwise loads in float32), with or without memory-mapping."""

    form: str
    stored: str
    dtype: str | None = None
    mmap: bool = True

    @property
    def name(self) -> str:
        loaded = f" -> {self.dtype}" if self.dtype and self.dtype != self.stored else ""
        return f"{self.form} {self.stored}{loaded}{'' if self.mmap else ', disable_mmap (old path)'}"


def default_cases() -> list[LoadCase]:
    """The table's rows: both forms in both dtypes, then the dtype change and the old path."""
    return [
        LoadCase("whole", "float32"),
        LoadCase("whole", "bfloat16"),
        LoadCase("base+mhla", "float32"),
        LoadCase("base+mhla", "bfloat16"),
        LoadCase("whole", "float32", dtype="bfloat16"),
        LoadCase("whole", "float32", mmap=False),
    ]


def _rss_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak) of this process in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident size (Linux: write 5 to ``clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def write_weights(
    work_dir: Path,
    config: dict[str, Any],
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Make the model from ``config`` with random weights and write every folder form into ``work_dir``.

    Returns ``{"whole-float32": path, "base-float32": path, "mhla-float32": path, ...}``. Folders
    already written for the same config (``MARKER``) are reused; a non-empty ``work_dir`` without the
    marker is refused, so user files are never written over.
    """
    import torch
    from diffusers import WanTransformer3DModel

    from ..config import MHLAConfig
    from ..loaders.weights import save_mhla
    from ..models.conversion import convert_to_mhla

    work_dir = Path(work_dir)
    marker = work_dir / MARKER
    wanted = json.loads(
        json.dumps({"config": config, "dtypes": list(dtypes), "mhla_config": MHLAConfig.released_wan().to_dict()})
    )
    folders = {
        f"{form}-{dtype}": work_dir / f"{form}-{dtype}" for dtype in dtypes for form in ("whole", "base", "mhla")
    }
    ours = json.loads(marker.read_text()) if marker.is_file() else None
    if ours is not None and ours.get("complete") and ours.get("spec") == wanted:
        log(f"reusing the weights in {work_dir}")
        return folders
    if ours is None and work_dir.exists() and any(work_dir.iterdir()):
        raise FileExistsError(
            f"{work_dir} is not empty and was not written by this benchmark; give an empty or new --work-dir "
            "(nothing in it is changed)"
        )
    if ours is not None:  # our own folder, for another config or left half-written: start it again
        for name in ours.get("folders", []):
            shutil.rmtree(work_dir / name, ignore_errors=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(
        json.dumps({"spec": wanted, "folders": sorted({*folders, "base-float32"}), "complete": False}, indent=2) + "\n"
    )
    log("making the model (random weights, published config) ...")
    torch.manual_seed(0)
    model = WanTransformer3DModel(**config).eval()
    base_float32 = work_dir / "base-float32"
    model.save_pretrained(base_float32, safe_serialization=True)
    for dtype in dtypes:
        if dtype != "float32":  # as Diffusers makes it: Wan's float32 modules stay float32
            del model
            model = WanTransformer3DModel.from_pretrained(base_float32, dtype=getattr(torch, dtype)).eval()
            model.save_pretrained(folders[f"base-{dtype}"], safe_serialization=True)
        log(f"writing {dtype} folders ...")
        convert_to_mhla(model, MHLAConfig.released_wan())
        save_mhla(model, folders[f"mhla-{dtype}"])
        save_mhla(model, folders[f"whole-{dtype}"], include_base=True)
    if "float32" not in dtypes:
        shutil.rmtree(base_float32)
    del model
    marker.write_text(
        json.dumps({"spec": wanted, "folders": sorted({*folders, "base-float32"}), "complete": True}, indent=2) + "\n"
    )
    return folders


def _load(case: LoadCase, folders: dict[str, str]) -> Any:
    """The load being measured (runs in the worker process)."""
    import torch

    from ..loaders.weights import load_mhla, load_transformer

    kwargs: dict[str, Any] = {"dtype": getattr(torch, case.dtype or case.stored)}  # Diffusers' default is float32
    if not case.mmap:
        kwargs["disable_mmap"] = True
    if case.form == "whole":
        return load_mhla(folders[f"whole-{case.stored}"], **kwargs)
    return load_mhla(folders[f"mhla-{case.stored}"], load_transformer(folders[f"base-{case.stored}"], **kwargs))


def in_weight_file_mapping(tensors: Iterable[Any], files: Iterable[str | os.PathLike] | None = None) -> list[bool]:
    """For each tensor, whether all its memory lies in one memory-mapped region of ``files`` (default:
    any ``.safetensors`` file) in this process, i.e. the load left it in the file's pages instead of
    copying it. Linux only (``/proc/self/maps``)."""
    targets = None if files is None else {os.path.realpath(f) for f in files}
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        mapped = fields[5].strip()
        if mapped in targets if targets is not None else mapped.endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.append((start, end))
    flags = []
    for t in tensors:
        first = t.data_ptr()
        last = first + t.numel() * t.element_size()
        flags.append(any(start <= first and last <= end for start, end in regions))
    return flags


def mapped_fraction(model: Any) -> float:
    """Share of ``model``'s weight bytes left memory-mapped by the load."""
    tensors = list(model.state_dict().values())
    sizes = [t.numel() * t.element_size() for t in tensors]
    mapped = sum(size for size, inside in zip(sizes, in_weight_file_mapping(tensors)) if inside)
    return mapped / max(sum(sizes), 1)


def _warm_up(case: LoadCase) -> None:
    """Save, load and run a tiny model the same way, so that lazy imports and one-time initialisation
    (Diffusers' lazy modules, kernels) belong to the baseline and not to the measured load."""
    import torch

    from ..config import MHLAConfig
    from ..loaders.weights import save_mhla
    from ..models.conversion import convert_to_mhla
    from ..models.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(num_layers=2).to(getattr(torch, case.stored))
    with tempfile.TemporaryDirectory() as root:
        model.save_pretrained(Path(root, f"base-{case.stored}"))
        convert_to_mhla(model, MHLAConfig.released_wan(layout=(1, 2, 2)))
        save_mhla(model, Path(root, f"mhla-{case.stored}"))
        save_mhla(model, Path(root, f"whole-{case.stored}"), include_base=True)
        loaded = _load(case, {name: str(Path(root, name)) for name in os.listdir(root)})
        _forward(loaded)


def _forward(model: Any) -> None:
    """One denoising forward on a small input (one latent frame of 8 x 8): touches every weight."""
    import torch

    dtype = model.patch_embedding.weight.dtype  # some small Wan modules stay float32 (_keep_in_fp32_modules)
    latents = torch.randn(1, model.config.in_channels, 1, 8, 8, dtype=dtype)
    text = torch.randn(1, 4, model.config.text_dim, dtype=dtype)
    with torch.no_grad():
        model(latents, torch.tensor([500]), text, return_dict=False)


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one load in this (fresh) process; ``spec`` holds the case and the folders."""
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    case = LoadCase(**spec["case"])
    _warm_up(case)
    baseline = _rss_status()["VmRSS"]
    _reset_peak()
    start = time.perf_counter()
    model = _load(case, spec["folders"])
    seconds = time.perf_counter() - start
    load_peak = _rss_status()["VmHWM"]
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    mapped = mapped_fraction(model)
    dtype = model.patch_embedding.weight.dtype
    _forward(model)
    forward_peak = _rss_status()["VmHWM"]
    return {
        "case": case.name,
        "dtype": str(dtype).replace("torch.", ""),
        "weights_gb": weight_bytes / 1e9,
        "load_s": seconds,
        "baseline_gb": baseline / 1e9,
        "load_peak_gb": (load_peak - baseline) / 1e9,
        "load_ratio": (load_peak - baseline) / weight_bytes,
        "forward_peak_gb": (forward_peak - baseline) / 1e9,
        "forward_ratio": (forward_peak - baseline) / weight_bytes,
        "mapped": mapped,
    }


def measure_load(case: LoadCase, folders: dict[str, Path], threads: int = 1) -> dict[str, Any]:
    """Run one load in a fresh Python process and return its measurements (see the module docstring)."""
    spec = {"case": case.__dict__, "folders": {k: str(v) for k, v in folders.items()}, "threads": threads}
    done = subprocess.run(
        [sys.executable, "-m", "mhla_diffusion.benchmarks.load", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load of {case.name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_table(
    config: dict[str, Any],
    cases: Sequence[LoadCase] | None = None,
    work_dir: Path | None = None,
    threads: int = 1,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Write the weights (into ``work_dir``, or a temporary folder removed afterwards) and measure each case."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("the load benchmark reads /proc/self/status and runs on Linux only")
    cases = list(cases or default_cases())
    dtypes = sorted({c.stored for c in cases}, key=["float32", "bfloat16"].index)
    temporary = work_dir is None
    root = Path(tempfile.mkdtemp(prefix="mhla-load-bench-")) if temporary else Path(work_dir)
    try:
        folders = write_weights(root, config, dtypes, log)
        rows = []
        for case in cases:
            log(f"loading: {case.name} ...")
            rows.append(measure_load(case, folders, threads))
        return rows
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a ``WanTransformer3DModel`` with ``config``, counted on the meta device (no memory)."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    return sum(math.prod(p.shape) for p in model.parameters())


if __name__ == "__main__":  # the worker: python -m mhla_diffusion.benchmarks.load '<spec json>'
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
