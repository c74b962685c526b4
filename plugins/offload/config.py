"""The ``aio`` section (DeepSpeed's asynchronous I/O settings for NVMe offload) and the config
rules of the offload plugins. Cheap to import: no torch."""
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
def _zero(config):
    return config.sections.get("zero_optimization")


def optimizer_offload_stages(config, report) -> None:
    """As in DeepSpeed: optimizer offload to ``cpu`` at stages 1-3; ``nvme`` and ``ratio`` < 1 at stage 3."""
    zero = _zero(config)
    if zero is None:
        return
    section = zero.offload_optimizer
    if section.device not in ("cpu", "nvme"):
        return
    if zero.stage == 0:
        report.error("zero_optimization.offload_optimizer.device",
                     f"{section.device!r} needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0: there is no "
                     "partitioned optimizer state to offload)")
    elif zero.stage in (1, 2) and section.device == "nvme":
        report.error("zero_optimization.offload_optimizer.device",
                     f"'nvme' needs ZeRO stage 3 (zero_optimization.stage is {zero.stage}); stages 1 and 2 offload "
                     "the optimizer to 'cpu'")
    elif zero.stage in (1, 2) and section.ratio < 1.0:
        report.error("zero_optimization.offload_optimizer.ratio",
                     f"{section.ratio}: a partial offload needs ZeRO stage 3 (zero_optimization.stage is "
                     f"{zero.stage}); leave ratio at 1")


RULES = (optimizer_offload_stages,)
