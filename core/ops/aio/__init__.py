"""``deepspeed.ops.aio``: ``AsyncIOBuilder`` and, for convenience, ``aio_handle(...)``.

    from dsplug.ops.aio import AsyncIOBuilder
    h = AsyncIOBuilder().load().aio_handle()
"""
from __future__ import annotations

from dsplug.op_builder import AsyncIOBuilder


def aio_handle(block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
               overlap_events: bool = False, intra_op_parallelism: int = 1, *, backend=None):
    """A new handle of the async_io op (built on first use, or the pure-Python fallback)."""
    return AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit, overlap_events,
                                              intra_op_parallelism, backend=backend)


__all__ = ["AsyncIOBuilder", "aio_handle"]
