"""The ``comms_logger`` config section: DeepSpeed's keys and defaults, and the op names."""
from __future__ import annotations

from typing import List, Optional

from dsplug.config.schema import field, schema
from dsplug.registry import suggest

#: the op names dsplug's comm layer issues (what ``record`` receives)
DSPLUG_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "barrier")

#: DeepSpeed op names a ``prof_ops`` list may hold -> the dsplug op they select (None: an op
#: DeepSpeed has but dsplug's comm layer never issues, so nothing is ever logged for it)
DEEPSPEED_OPS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "inference_all_reduce": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "barrier": "barrier", "monitored_barrier": "barrier",
    "all_to_all_single": "all_to_all_single", "all_to_all": "all_to_all", "send": "send", "recv": "recv",
    "isend": "send", "irecv": "recv",
    "gather": None, "scatter": None,
}


def _known_ops(names) -> Optional[str]:
    bad = [n for n in names if n not in DEEPSPEED_OPS]
    if not bad:
        return None
    hints = []
    for name in bad:
        guess = suggest(name, list(DEEPSPEED_OPS))
        hints.append(f"{name!r}" + (f" (did you mean {guess!r}?)" if guess else ""))
    return (f"unknown communication op {', '.join(hints)}; valid names: "
            f"{', '.join(sorted(DEEPSPEED_OPS))}")


@schema
class CommsLoggerConfig:
    enabled: bool = field(False, doc="log every collective issued through dsplug.comm")
    verbose: bool = field(False, doc="print each logged op as it completes (rank, op, size, latency, bandwidth)")
    prof_all: bool = field(True, doc="log every op; false logs only the ops named in prof_ops")
    debug: bool = field(False, doc="add the function that issued each op to its log name")
    prof_ops: List[str] = field([], check=_known_ops,
                                doc="ops to log when prof_all is false (DeepSpeed names, e.g. all_reduce)")


def selected_ops(config: CommsLoggerConfig) -> Optional[frozenset]:
    """The dsplug op names to record, or None for all of them."""
    if config.prof_all:
        return None
    return frozenset(DEEPSPEED_OPS[n] for n in config.prof_ops if DEEPSPEED_OPS[n] is not None)
