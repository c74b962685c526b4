"""Builder of the quantizer op: group-wise fake quantization for the compression library.

``QuantizerBuilder().load()`` returns a :class:`QuantizerOp` whose ``native`` is the extension
module (``quantize(...)`` on raw fp32 buffers), or ``None`` when the pure-torch fallback of
``dsplug.plugins.compression.quantize`` must be used (one warning, as for every op). The
formulas are in ``csrc/quantizer/quantizer.h`` and that module's docstring.

Not DeepSpeed's CUDA ``QuantizerBuilder`` (``dsplug.ops.op_builder.QuantizerBuilder`` keeps that
name for scripts probing DeepSpeed's op, and reports it unavailable).
"""
from __future__ import annotations

from .builder import OpBuilder


class QuantizerOp:
    """The loaded quantizer op: the native extension, or ``None`` for the pure-torch fallback."""

    op_name = "quantizer"

    def __init__(self, native=None):
        self.native = native

    @property
    def is_native(self) -> bool:
        return self.native is not None

    @property
    def isa(self) -> str:
        """SIMD path of the native build ("avx512", "avx2", "scalar") or "torch"."""
        return self.native.simd_isa() if self.native is not None else "torch"

    @property
    def backend(self) -> str:
        return f"native ({self.isa})" if self.native is not None else "torch fallback"

    def __repr__(self) -> str:
        return f"<{self.op_name} op: {self.backend}>"


class QuantizerBuilder(OpBuilder):
    """Fake quantization (symmetric / asymmetric, per group, nearest or stochastic rounding),
    used by ``dsplug.plugins.compression.quantize``."""

    NAME = "quantizer"
    EXT_NAME = "quantizer_op"
    PACKAGE = "dsplug.ops"
    SOURCES = (("quantizer/quantizer.cpp", "-O3"),)
    USES_SIMD = True

    def make_module(self, native):
        return QuantizerOp(native)
