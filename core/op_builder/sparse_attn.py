"""Builder of the ``sparse_attn`` op: block-sparse attention kernels (SDDMM, row softmax, SpMM and
their backward passes) on fp32 CPU tensors, used by ``dsplug.ops.sparse_attention``.

``SparseAttnBuilder().load()`` returns a :class:`SparseAttnOp` whose ``native`` is the extension
module, or ``None`` when the pure-torch fallback of
``dsplug.plugins.sparse_attention.fallback`` must be used (one warning, as for every op). The
contract is in ``csrc/sparse_attention/sparse_attention.h``.

Unlike the optimizer ops (explicit intrinsics, built without auto-vectorization), these kernels
are plain loops over compile-time block sizes that the compiler vectorizes: the build turns
tree vectorization back on and lets it contract multiply-adds into FMAs. DeepSpeed's op of the
same name (Triton, GPU only) has this name too, so ``deepspeed.ops.op_builder.SparseAttnBuilder``
is this builder.
"""
from __future__ import annotations

from ..ops.native.handle import NativeOpHandle
from .builder import OpBuilder


class SparseAttnOp(NativeOpHandle):
    """The loaded sparse attention op: the native extension, or ``None`` for the pure-torch fallback."""

    op_name = "sparse_attn"


class SparseAttnBuilder(OpBuilder):
    """Block-sparse attention on CPU (``dsplug.ops.sparse_attention``)."""

    NAME = "sparse_attn"
    EXT_NAME = "sparse_attn_op"
    PACKAGE = "dsplug.ops"
    SOURCES = (("sparse_attention/sparse_attention.cpp", "-O3"),
               ("sparse_attention/sparse_attention_bindings.cpp", "-O1"))
    USES_SIMD = True
    BUILD_SECONDS = 17  # measured: 16 s kernels + 8 s bindings (-O1) of CPU, in parallel on 2 cores

    def extra_cxx_flags(self):
        # after the base flags, so these win over -fno-tree-vectorize / -ffp-contract=off
        return ["-ftree-vectorize", "-ffp-contract=fast"]

    def make_module(self, native):
        return SparseAttnOp(native)
