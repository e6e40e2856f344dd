"""Latent / text-embedding cache: an optional pre-pass that encodes the data set once, so training
needs neither the VAE encoder nor the text encoder in memory.

Layout of ``cache_dir``::

    cache_config.json           settings the tensors depend on (model, sizes, dtypes); a mismatch is an error
    latents/<xx>/<sha1>.safetensors   one entry per sample and bucket
    prompts/<xx>/<sha1>.safetensors   one entry per distinct caption (plus "" and validation prompts)
    index.json                  the sample index; written last, so its presence means the cache is complete

Entries are named by a hash of what they depend on (file, bucket; caption text), written to a
temporary name and renamed, so an interrupted pre-pass resumes where it stopped and a changed
caption or bucket gets a fresh entry. Processes split the missing entries (``i % world == rank``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..loaders.weight_files import read_checkpoint_file

__all__ = ["LatentCache", "encoder_identity", "fill_entries", "remove_leftovers", "run_prepass"]

logger = logging.getLogger(__name__)

_CONFIG, _INDEX = "cache_config.json", "index.json"


def _digest(value: Any) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()


#: Config keys that record where or with which version a component was saved, not what it computes.
_SAVE_BOOKKEEPING = frozenset(
    {"_name_or_path", "_diffusers_version", "transformers_version", "is_local", "local_files_only"}
)


def encoder_identity(source: str, revision: str | None, components: Sequence[str]) -> dict[str, Any]:
    """What identifies the encoders of ``source`` for the cache.

    A hub id is named by id and revision. A local pipeline folder is named by the contents of its
    encoder ``components``: JSON files by content minus save bookkeeping such as ``_name_or_path``,
    other files by name, size and a hash of their first MiB (an 11 GB text encoder is not read). So
    two pipelines that share their VAE and text encoder -- a teacher and the models fine-tuned from
    it -- share one cache.
    """
    folder = Path(source)
    if not folder.is_dir():
        return {"pretrained_model": source, "revision": revision}
    summary: dict[str, Any] = {}
    for name in components:
        for file in sorted(p for p in (folder / name).rglob("*") if p.is_file()):
            key = file.relative_to(folder).as_posix()
            if file.suffix == ".json":  # without the bookkeeping that saving again changes
                try:
                    content = json.loads(file.read_text())
                except ValueError:
                    content = file.read_text()
                if isinstance(content, dict):
                    content = {k: v for k, v in content.items() if k not in _SAVE_BOOKKEEPING}
                summary[key] = _digest(content)
                continue
            with file.open("rb") as handle:
                head = handle.read(1 << 20)
            summary[key] = [file.stat().st_size, hashlib.sha1(head).hexdigest()]
    return {"encoders": _digest(summary)}


class LatentCache:
    """A cache folder tied to ``settings`` (a JSON-able dict of everything the tensors depend on)."""

    def __init__(self, folder: str | Path, settings: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.settings = json.loads(json.dumps(settings))  # normalise tuples -> lists

    # ------------------------------------------------------------------ settings and index

    def check_settings(self) -> None:
        """Raise when the folder holds a cache built with other settings (never mixes the two)."""
        path = self.folder / _CONFIG
        if not path.is_file():
            if self.folder.is_dir() and any(self.folder.iterdir()):
                raise FileExistsError(
                    f"cache_dir {self.folder} is not empty and holds no {_CONFIG}: choose an empty or new cache_dir"
                )
            return
        saved = json.loads(path.read_text())
        different = sorted(k for k in set(saved) | set(self.settings) if saved.get(k) != self.settings.get(k))
        if different:
            details = ", ".join(f"{k}: cache {saved.get(k)!r} vs now {self.settings.get(k)!r}" for k in different[:4])
            raise ValueError(
                f"cache_dir {self.folder} was built with other settings ({details}); use another cache_dir "
                "or delete this one"
            )

    def write_settings(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        _atomic_text(self.folder / _CONFIG, json.dumps(self.settings, indent=2) + "\n")

    def read_index(self) -> dict[str, Any] | None:
        path = self.folder / _INDEX
        return json.loads(path.read_text()) if path.is_file() else None

    def write_index(self, index: dict[str, Any]) -> None:
        _atomic_text(self.folder / _INDEX, json.dumps(index) + "\n")

    # ------------------------------------------------------------------ entries

    def path(self, kind: str, identity: Any) -> Path:
        """Entry file of ``kind`` (``latents`` / ``prompts``) for a JSON-able ``identity``."""
        digest = _digest(identity)
        return self.folder / kind / digest[:2] / f"{digest}.safetensors"

    def has(self, kind: str, identity: Any) -> bool:
        return self.path(kind, identity).is_file()

    def write(self, kind: str, identity: Any, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path(kind, identity)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = _temporary_name(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(temporary))
        os.replace(temporary, path)

    def read(self, kind: str, identity: Any) -> dict[str, torch.Tensor]:
        path = self.path(kind, identity)
        if not path.is_file():
            raise FileNotFoundError(
                f"cache entry {path} is missing: delete {self.folder / _INDEX} to rebuild the cache"
            )
        try:
            return read_checkpoint_file(path)
        except ValueError as error:
            raise ValueError(f"cache entry {error}: delete {self.folder / _INDEX} to rebuild the cache") from None


def fill_entries(
    cache: LatentCache,
    kind: str,
    identities: Sequence[Any],
    encode: Callable[[int], dict[str, torch.Tensor]],
    rank: int = 0,
    world: int = 1,
    description: str = "caching",
    show_progress: bool = True,
) -> list[tuple[int, str]]:
    """Encode this process's share of the missing entries (``encode(i)`` for ``identities[i]``).

    Returns ``(i, error message)`` of the items whose ``encode`` raised a ``MediaError`` (files that
    broke after indexing); the caller gathers them across processes and drops those samples.
    """
    from .media import MediaError

    todo = [i for i in range(rank, len(identities), world) if not cache.has(kind, identities[i])]
    failures = []
    for i in tqdm(todo, desc=f"{description} (process {rank})", disable=not show_progress or not todo):
        try:
            tensors = encode(i)
        except MediaError as err:
            logger.warning("skipping unreadable sample while caching: %s", err)
            failures.append((i, str(err)))
            continue
        cache.write(kind, identities[i], tensors)
    return failures


def _temporary_name(path: Path) -> Path:
    """Where ``path`` is written before its rename: ``.<name>.<pid>.tmp`` beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_leftovers(folder: str | Path) -> list[str]:
    """Delete the temporary files that writers killed before their rename left in a cache ``folder``
    (main process, before a run reads or fills the cache); returns the actions, each logged in one line.

    Nothing reads these files. Only those whose writer (the PID in the name) no longer runs on this host
    are removed, so a live run that shares the cache keeps writing.
    """
    from .checkpointing import _alive

    actions = []
    root = Path(folder)
    if not root.is_dir():
        return actions
    for path in sorted(root.rglob(".*.tmp")):
        pid = path.name[: -len(".tmp")].rsplit(".", 1)[-1]
        if path.is_file() and pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            actions.append(f"removed {path} (a cache entry whose writer was stopped before it completed)")
    for action in actions:
        logger.warning("latent cache: %s", action)
    return actions


def _atomic_text(path: Path, text: str) -> None:
    temporary = _temporary_name(path)
    temporary.write_text(text)
    os.replace(temporary, path)


def run_prepass(
    accelerator,
    cache: LatentCache,
    kind: str,
    identities: Sequence[Any],
    encode: Callable[[int], dict[str, torch.Tensor]],
    description: str,
) -> list[tuple[int, str]]:
    """:func:`fill_entries` on every process, then the failures of all processes (after a barrier)."""
    from accelerate.utils import gather_object

    failures = fill_entries(
        cache,
        kind,
        identities,
        encode,
        accelerator.process_index,
        accelerator.num_processes,
        description,
        show_progress=accelerator.is_local_main_process,
    )
    if accelerator.num_processes > 1:
        failures = gather_object(failures)
    accelerator.wait_for_everyone()
    return sorted(failures)
