"""Class names and ids of class-conditional models (``id2label`` tables), without torch.

Shared by the pipeline, the CLI and the web app's input checks, which run before any model loads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["flat_class_labels", "label_index", "resolve_class_ids"]


def label_index(id2label: dict[int | str, str] | None) -> dict[str, int]:
    """Name -> id map of an ``id2label`` table whose values list synonyms split by "," (as DiTPipeline does)."""
    labels: dict[str, int] = {}
    for key, value in (id2label or {}).items():
        for name in value.split(","):
            labels[name.strip()] = int(key)
    return labels


def flat_class_labels(classes: Any) -> list[Any]:
    """The class labels of every form Diffusers' ``DiTPipeline`` takes, as one flat list: an id or a name, a list of
    them, nested lists (``[[1], [2]]``, as Diffusers' batch tests build), or a tensor / array of ids (read with its
    ``tolist``; a one-element one is a scalar)."""
    if hasattr(classes, "tolist") and not isinstance(classes, (int, str)):
        classes = classes.tolist()
    if isinstance(classes, (int, str)):
        return [classes]
    return [label for item in classes for label in flat_class_labels(item)]


def resolve_class_ids(classes: Any, labels: dict[str, int], num_classes: int) -> list[int]:
    """Class ids for ids and/or label names in any form :func:`flat_class_labels` reads; unknown names or
    out-of-range ids are a ``ValueError``."""
    try:
        items = flat_class_labels(classes)
    except TypeError:
        raise ValueError(
            f"class labels must be ids or names (a list of them, nested or not), got {classes!r}"
        ) from None
    if not items:
        raise ValueError("no classes given: pass at least one class id or name")
    ids, unknown = [], []
    for item in items:
        if isinstance(item, str) and not item.strip().isdigit():
            if item.strip() in labels:
                ids.append(labels[item.strip()])
            else:
                unknown.append(item)
        else:
            ids.append(int(item))
    if unknown:
        known = ", ".join(list(labels)[:8]) or "none: the model has no id2label table, use class ids"
        raise ValueError(f"unknown class names {unknown}; known names include {known}")
    bad = [i for i in ids if not 0 <= i < num_classes]
    if bad:
        raise ValueError(f"class ids {bad} out of range: the model has classes 0..{num_classes - 1}")
    return ids
