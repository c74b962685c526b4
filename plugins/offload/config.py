"""The ``aio`` section (DeepSpeed's asynchronous I/O settings for NVMe offload) and the ``nvme``
device's config rule. Cheap to import: no torch. (Which ZeRO stage offloads what to which kind
of device is the ZeRO stages' to say: ``plugins/zero/config.py`` checks it from their traits.)"""
from __future__ import annotations

from dsplug.config.schema import field, schema


def _no_gds(value):
    if value:
        return ("GPUDirect Storage (use_gds: true) is not available in dsplug: swap files are read into host "
                "buffers through libaio (or a thread pool); set use_gds to false")
    return None


@schema
class AioConfig:
    """``"aio"``: how swap files are read and written (``offload_*.device: "nvme"``)."""

    block_size: int = field(1048576, ge=1, doc="bytes per I/O request")
    queue_depth: int = field(8, ge=1, doc="requests in flight per handle")
    thread_count: int = field(1, ge=1, aliases=("intra_op_parallelism",),
                              doc="threads splitting each read / write (DeepNVMe's intra_op_parallelism)")
    single_submit: bool = field(False, doc="submit requests one at a time instead of as one batch")
    overlap_events: bool = field(True, doc="submit new requests without waiting for earlier ones to complete")
    use_gds: bool = field(False, check=_no_gds, doc="GPUDirect Storage (not available in dsplug)")


# ------------------------------------------------------------------------------------- rules
def nvme_needs_a_path(config, report) -> None:
    """``device: "nvme"`` needs ``nvme_path``: the directory of its swap files (no guessed default)."""
    zero = config.sections.get("zero_optimization")
    if zero is None:
        return
    for key in ("offload_param", "offload_optimizer"):
        section = getattr(zero, key, None)
        if section is not None and section.device == "nvme" and not section.nvme_path:
            report.error(f"zero_optimization.{key}.nvme_path", "device 'nvme' needs nvme_path: the directory "
                         "for the swap files")


RULES = (nvme_needs_a_path,)
