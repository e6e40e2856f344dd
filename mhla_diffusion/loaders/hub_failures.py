"""A model id the hub cannot give (unreachable, offline and not cached, no such repo or file, gated), in one line.

:func:`hub_failure` turns the hub client's error into one :class:`ModelUnavailable` naming the id, the component
and what to do; :func:`hub_errors` runs a load so (every entry point that loads runs its loading inside it). Nothing
here imports torch or Diffusers at import time.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Mapping

from ..utils.model_source import source_kind

__all__ = ["ModelUnavailable", "hub_errors", "hub_failure"]


class ModelUnavailable(FileNotFoundError):
    """A model the hub could not give: its one-line message names the id, the component, why and what to do."""


#: ``<endpoint>/<owner>/<name>/resolve/<revision>/<file>`` and ``<endpoint>/api/models/<owner>/<name>`` in the
#: hub client's messages (also a proxy's "Max retries exceeded with url: /<owner>/<name>/resolve/...").
_HUB_FILE_URL = re.compile(r"/([\w.-]+/[\w.-]+)/resolve/[^/\s]+/([^\s'\")]+?)(?:[:'\")\s]|\.?$|\.\s)")
_HUB_API_URL = re.compile(r"/api/models/([\w.-]+/[\w.-]+)")
_MISSING_FILE = re.compile(r"^([\w.-]+/[\w.-]+) does not appear to have a file named ([^\s]+?)\.?(?:\s|$)")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or during."""
    found: list[BaseException] = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_failure(
    error: BaseException, names: Mapping[str, str] | None = None, file: str | None = None
) -> ModelUnavailable | None:
    """The :class:`ModelUnavailable` for ``error`` when it (or what it was raised from) is the hub failing to
    give a model, else ``None``.

    The line names the id and the component (the file the hub was asked for, and the option that named the id
    when ``names`` maps it: ``{"stabilityai/sd-vae-ft-ema": "vae_model"}``), says whether the hub was switched
    off (``HF_HUB_OFFLINE``) without the files in the local cache, unreachable, without that repo or file, or
    gated, and what to do: download it first, pass a local folder, or unset ``HF_HUB_OFFLINE``. ``file`` names
    the component when the caller knows it better than the message.
    """
    from huggingface_hub import errors

    chain = _chain(error)
    text = " ".join(str(e) for e in chain)
    repo = found_file = None
    for pattern in (_HUB_FILE_URL, _MISSING_FILE):  # the URL holds the subfolder (vae/config.json)
        for e in chain:
            if found := pattern.search(str(e)):
                repo, found_file = found.group(1), found.group(2)
                break
        if repo:
            break
    file = file or found_file
    if repo is None and (found := _HUB_API_URL.search(text)):
        repo = found.group(1)
    if repo is None:  # a model the caller named that the message names
        repo = next((model for model in (names or {}) if source_kind(model) == "hub" and model in text), None)
    kinds = {type(e) for e in chain}

    def has(cls: type) -> bool:
        return any(issubclass(k, cls) for k in kinds)

    if has(errors.GatedRepoError) or "gated repo" in text.lower():
        reason = "access to it is gated on the hub"
        fix = (
            f"accept its terms on https://huggingface.co/{repo} and log in (`hf auth login`, or set HF_TOKEN), "
            "or pass a local folder"
        )
    elif has(errors.OfflineModeIsEnabled) or (_hub_offline() and has(errors.LocalEntryNotFoundError)):
        reason = "the hub is switched off (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
        fix = (
            f"download it first (`hf download {repo}` where the hub is reachable), pass a local folder, "
            "or unset HF_HUB_OFFLINE"
        )
    elif has(errors.RepositoryNotFoundError) or has(errors.RevisionNotFoundError):
        reason = "the hub has no such model (or revision), or it is private"
        fix = "check the id (and --revision), log in for a private model (`hf auth login`), or pass a local folder"
    elif has(errors.LocalEntryNotFoundError) or _connection_failed(chain):
        reason = "the hub could not be reached and it is not in the local Hugging Face cache"
        fix = (
            f"download it first (`hf download {repo}` where the hub is reachable) or pass a local folder; "
            "behind a proxy set HTTPS_PROXY"
        )
    elif file is not None or has(errors.EntryNotFoundError):
        reason = "the hub's copy lacks that file"
        fix = "check that the id names the right kind of model (a Diffusers pipeline or model), or pass a local folder"
    else:
        return None
    if repo is None:
        return None
    option = (names or {}).get(repo)
    what = f"{option} {repo}" if option else repo
    part = f" ({file})" if file else ""
    return ModelUnavailable(f"{what}{part} could not be fetched: {reason}; {fix}")


def _connection_failed(chain: list[BaseException]) -> bool:
    """Whether the chain holds a network failure (refused, timed out, no route, DNS) of any HTTP client."""
    return any(
        isinstance(e, (ConnectionError, TimeoutError))
        or type(e).__name__ in ("ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "ProxyError")
        for e in chain
    )


@contextmanager
def hub_errors(names: Mapping[str, str] | None = None) -> Iterator[None]:
    """Run a load: a model the hub cannot give becomes one :class:`ModelUnavailable` line (:func:`hub_failure`;
    ``names``: model id -> the option that named it); any other error passes through."""
    try:
        yield
    except ModelUnavailable as error:
        named = hub_failure(error.__cause__, names) if names and error.__cause__ is not None else None
        if named is None:
            raise
        raise named from None
    except Exception as error:
        failure = hub_failure(error, names)
        if failure is None:
            raise
        raise failure from None
