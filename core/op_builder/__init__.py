"""Native ops: build with ninja against pybind11 (no libtorch), cache, load, or fall back.

    from dsplug.op_builder import CPUAdamBuilder, AsyncIOBuilder, op_status
    adam = CPUAdamBuilder().load()              # native op, or pure-torch fallback + one warning
    h = AsyncIOBuilder().load().aio_handle()    # DeepNVMe's handle API
    op_status("cpu_adam")                       # compatible / built / detail, compiles nothing

Environment:
    DSPLUG_OPS_CACHE           build cache (default ~/.cache/dsplug/ops)
    DSPLUG_DISABLE_NATIVE_OPS  =1 forces the pure-torch fallbacks
    DSPLUG_OPS_ISA             native (default) | avx512 | avx2 | scalar: SIMD path to compile
    DSPLUG_AIO_BACKEND         auto (default) | libaio | threads: aio engine of new handles
    CXX                        C++ compiler (default c++, g++ or clang++ on PATH)

``pip install .`` builds every op into the package (setup.py; ``DSPLUG_BUILD_OPS=0`` skips that);
an op not built there builds at first use, or ahead of time with ``dsplug build-ops``. Importing
this package is cheap (no torch), and it imports nothing outside it but the standard library, so
setup.py runs it at install time.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Dict, List, Type

from .async_io import AsyncIOBuilder
from .builder import (
    CACHE_ENV,
    DISABLE_ENV,
    LazyNativeOp,
    NativeOpsFallbackWarning,
    OpBuilder,
    OpBuildError,
    OpUnavailableError,
    cache_root,
    native_disabled,
)
from .cpu_optimizers import CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder
from .quantizer import QuantizerBuilder
from .sparse_attn import SparseAttnBuilder

ALL_OPS: Dict[str, Type[OpBuilder]] = {
    CPUAdamBuilder.NAME: CPUAdamBuilder,
    CPUAdagradBuilder.NAME: CPUAdagradBuilder,
    CPULionBuilder.NAME: CPULionBuilder,
    AsyncIOBuilder.NAME: AsyncIOBuilder,
    QuantizerBuilder.NAME: QuantizerBuilder,
    SparseAttnBuilder.NAME: SparseAttnBuilder,
}


@dataclass(frozen=True)
class OpStatus:
    name: str
    compatible: bool  # it can be built (and run) on this machine
    built: bool  # a build for the current sources, flags and CPU is in the cache
    detail: str  # ISA / backend when compatible, else why not


def get_builder(name: str) -> OpBuilder:
    """The builder of op ``name``; KeyError with the valid names otherwise."""
    try:
        return ALL_OPS[name]()
    except KeyError:
        close = difflib.get_close_matches(name, ALL_OPS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown native op {name!r} (known: {', '.join(sorted(ALL_OPS))}){hint}") from None


def op_status(name: str) -> OpStatus:
    """Status of one op without compiling anything."""
    builder = get_builder(name)
    why = builder.incompatibility()
    if why:
        return OpStatus(name, False, False, f"{why}; the pure-torch fallback is used")
    built = builder.is_built()
    detail = builder.backend_detail()
    if native_disabled():
        detail += f"; disabled by {DISABLE_ENV}=1, the pure-torch fallback is used"
    elif built:
        info = builder.build_info() or {}
        secs = info.get("build_seconds")
        where = "built at install in" if builder.is_prebuilt() else "cached in"
        detail += f"; {where} {builder.build_dir()}" + (f" (built in {secs:.1f} s)" if secs is not None else "")
        shared = sorted(n for n, cls in ALL_OPS.items() if n != name and cls().build_name() == builder.build_name())
        if shared:
            detail += f", shared with {', '.join(shared)}"
    else:
        detail += "; not built yet: builds on first use or with `dsplug build-ops`"
    return OpStatus(name, True, built, detail)


def all_op_status() -> List[OpStatus]:
    return [op_status(name) for name in sorted(ALL_OPS)]


__all__ = [
    "LazyNativeOp",
    "ALL_OPS", "OpStatus", "op_status", "all_op_status", "get_builder", "OpBuilder", "OpBuildError",
    "OpUnavailableError", "NativeOpsFallbackWarning", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder",
    "AsyncIOBuilder", "QuantizerBuilder", "SparseAttnBuilder", "cache_root", "native_disabled", "CACHE_ENV", "DISABLE_ENV",
]
