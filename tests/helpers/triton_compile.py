"""Compile a recorded Triton launch ahead of time for an NVIDIA target, without a GPU, exactly as the launch
would specialise it, and read ptxas' own log (registers, spilled bytes).

The launch is bound the way Triton 3.8's ``JITFunction.run`` binds it before compiling
(``create_function_from_signature`` then ``JITFunction._pack_args``): integer widths, divisibility by 16,
strides of 1 as constants and pointer alignment all come from the captured arguments themselves (``meta``
tensors are aligned like fresh CUDA allocations, views at their offsets). These are Triton's launch
internals: :func:`unsupported` says why a Triton cannot be used (tests skip then).
"""

import contextlib
import io
import re
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class CompiledLaunch:
    """One launch compiled for one target.

    ``spec``: parameter name -> Triton's ``(type, specialisation)`` (e.g. ``("i32", "D")`` for a 32-bit
    integer divisible by 16, ``("constexpr", 1)``); ``key``: what identifies the compiled specialisation
    (the same key from another launch is the same binary); ``registers`` per thread and ``spilled`` bytes
    (spill stores + spill loads) from ptxas' log; ``ptx``: the PTX text; ``ttgir``: Triton's GPU IR (loads with
    their register layouts)."""

    spec: dict
    key: tuple
    registers: int
    spilled: int
    ptx: str
    log: str
    ttgir: str = ""


def unsupported(triton) -> str | None:
    """Why launches cannot be bound and compiled here with this ``triton`` module, or ``None`` when they can."""
    if "nvidia" not in triton.backends.backends:
        return "this Triton has no NVIDIA backend to compile with"
    try:
        from triton.runtime.jit import create_function_from_signature  # noqa: F401

        triton.knobs.nvidia.dump_ptxas_log  # noqa: B018
    except (ImportError, AttributeError) as error:
        return f"this Triton binds launch arguments differently ({error}): the binding is written for 3.8"
    return None


def bind_launch(jit, args: tuple, kwargs: dict, arch: int) -> tuple:
    """``(spec, key, source, options)`` of ``jit[grid](*args, **kwargs)`` on ``sm_<arch>``: see
    :class:`CompiledLaunch` for ``spec`` and ``key``; ``source`` and ``options`` are what ``triton.compile``
    takes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    bind = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = bind(*args, **kwargs)
    spec = dict(zip((p.name for p in jit.params), specialization))
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    key = (
        arch,
        jit.fn.__name__,
        repr(signature),
        repr(sorted(constexprs.items(), key=repr)),
        repr(attrs),
        repr(options),
    )
    return spec, key, ASTSource(jit, signature, constexprs, attrs), options


def compile_launch(jit, args: tuple, kwargs: dict, arch: int) -> CompiledLaunch:
    """Compile the launch ``jit[grid](*args, **kwargs)`` for ``sm_<arch>`` (``TRITON_CACHE_DIR`` should point
    at a fresh folder, else a cached binary comes back without a ptxas log) and parse ptxas' log, which
    Triton prints when ``knobs.nvidia.dump_ptxas_log`` is on (with its own ptxas flags)."""
    import triton
    from triton.backends.compiler import GPUTarget

    spec, key, source, options = bind_launch(jit, args, kwargs, arch)
    out = io.StringIO()
    before = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(out):
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
    finally:
        triton.knobs.nvidia.dump_ptxas_log = before
    log = out.getvalue()
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if registers is None or not spills:
        pytest.fail(f"no ptxas log for {jit.fn.__name__} on sm_{arch} (a cached compile?): {log[-2000:]!r}")
    return CompiledLaunch(spec, key, int(registers.group(1)), sum(spills), kernel.asm["ptx"], log, kernel.asm["ttgir"])


_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i64": 8, "i32": 4, "i8": 1}


def tile_load_widths(ttgir: str) -> list[tuple[str, int]]:
    """Every load of a 2-D tile in a kernel's Triton GPU IR (``tt.load`` or an async copy to shared memory), as
    ``(tensor type, bytes a thread moves in one contiguous access)``: the layout's elements per thread along its
    fastest dimension times the element size (the width of the vector loads the tile becomes)."""
    blocked = {
        name: ([int(n) for n in size.split(",")], [int(n) for n in order.split(",")])
        for name, size, order in re.findall(
            r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\][^}]*order = \[([\d, ]+)\]", ttgir, re.M
        )
    }
    widths = []
    for line in ttgir.splitlines():
        if "tt.load " not in line and "async_copy_global_to_local" not in line:
            continue
        match = re.search(r": tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>, (#\w+)>", line)
        if match is None:  # 1-D (indices, the angle plan) or a scalar
            continue
        rows, cols, dtype, layout = match.groups()
        size, order = blocked[layout]
        widths.append((f"{rows}x{cols}x{dtype}", size[order[0]] * _BYTES[dtype]))
    return widths
