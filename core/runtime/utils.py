"""DeepSpeed's ``deepspeed.runtime.utils`` helpers scripts call."""
from __future__ import annotations

from dsplug.logging import logger

_GB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the accelerator's memory use (allocated, its peak, reserved) and the
    host's, on rank 0. Does nothing unless ``force`` (DeepSpeed's calls sit in hot paths)."""
    if not force:
        return
    from dsplug import comm
    from dsplug.accelerator import get_accelerator

    if comm.is_initialized() and comm.get_rank() != 0:
        return
    acc = get_accelerator()
    parts = [message,
             f"memory allocated {acc.memory_allocated() / _GB:.2f} GB",
             f"max allocated {acc.max_memory_allocated() / _GB:.2f} GB",
             f"reserved {acc.memory_reserved() / _GB:.2f} GB"]
    try:
        import resource

        parts.append(f"host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2:.2f} GB")
    except (ImportError, OSError):
        pass
    logger.info(" | ".join(parts))
    acc.reset_peak_memory_stats()


__all__ = ["see_memory_usage"]
