"""Builder of the quantizer op: group-wise (fake) quantization, the kernel's quantizer service.

``QuantizerBuilder().load()`` returns a :class:`QuantizerOp` whose ``native`` is the extension
module (``quantize(...)`` on raw fp32 buffers), or ``None`` when the pure-torch fallback of
``dsplug.ops.quantize`` must be used (one warning, as for every op). The
formulas are in ``csrc/quantizer/quantizer.h`` and that module's docstring.

Not DeepSpeed's CUDA ``QuantizerBuilder`` (``dsplug.ops.op_builder.QuantizerBuilder`` keeps that
name for scripts probing DeepSpeed's op, and reports it unavailable).
"""
from __future__ import annotations

from ..ops.native.handle import NativeOpHandle
from .builder import OpBuilder


class QuantizerOp(NativeOpHandle):
    """The loaded quantizer op: the native extension, or ``None`` for the pure-torch fallback."""

    op_name = "quantizer"


class QuantizerBuilder(OpBuilder):
    """Fake quantization (symmetric / asymmetric, per group, nearest or stochastic rounding),
    used by ``dsplug.ops.quantize``."""

    NAME = "quantizer"
    EXT_NAME = "quantizer_op"
    PACKAGE = "dsplug.ops"
    SOURCES = (("quantizer/quantizer.cpp", "-O3"),)
    USES_SIMD = True
    BUILD_SECONDS = 10  # measured: 9.4 s of CPU

    def make_module(self, native):
        return QuantizerOp(native)
