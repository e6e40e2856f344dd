"""The private PyTorch and Triton names an outside review listed (issue 61) appear only in their fences: a feature
check with a public fallback, in one place each."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: name -> the only files (relative to the repository) where it may appear, each behind its check
FENCED = {
    "InterpretedFunction": (),
    "._base": (),
    "._version": ("mhla_diffusion/utils/tensor_versions.py",),
    "_dispatch_tls_local_exclude_set": ("mhla_diffusion/ops/fused_op.py",),
    "_ForceDispatchKeyGuard": ("mhla_diffusion/ops/fused_op.py",),
}


def _sources() -> list[Path]:
    return sorted([*ROOT.joinpath("mhla_diffusion").rglob("*.py"), *ROOT.joinpath("benchmarks").rglob("*.py")])


def test_private_names_stay_in_their_fences():
    found = {
        (name, str(path.relative_to(ROOT)))
        for path in _sources()
        for name in FENCED
        if re.search(re.escape(name) + r"\b", path.read_text())
    }
    outside = sorted((name, path) for name, path in found if path not in FENCED[name])
    assert not outside, outside


def test_each_fence_checks_before_it_uses_the_name():
    fused = ROOT.joinpath("mhla_diffusion/ops/fused_op.py").read_text()
    assert "_FORCED_KEYS = all(" in fused and "if _FORCED_KEYS:" in fused and "torch.func.vjp" in fused
    versions = ROOT.joinpath("mhla_diffusion/utils/tensor_versions.py").read_text()
    assert 'getattr(tensor, "_version", None)' in versions
