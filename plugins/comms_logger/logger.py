"""The recorder of collectives and its DeepSpeed-style summaries.

A :class:`CommsRecorder` keeps the records; :func:`comm_hooks` makes the object registered on
:data:`dsplug.comm.events`, whose ``dsplug_comm_op`` implementation calls
:meth:`CommsRecorder.record` after each collective and whose ``dsplug_comm_summary`` prints the
table. Records are grouped by op (plus the issuing function with ``debug``) and message size.

Bandwidth follows the nccl-tests definitions: the algorithmic bandwidth is the message size over
the latency; the bus bandwidth scales it by what each rank must move on the wire,

=======================  ===============
all_reduce               2 (n - 1) / n
all_gather, reduce_scatter  (n - 1) / n
all_to_all(_single)      (n - 1) / n
broadcast, reduce, other 1
=======================  ===============

with n the group size. The message size is the whole buffer: the output of an all-gather, the
input of a reduce-scatter or an all-to-all. Figures are in Gbps (10^9 bits per second), as DeepSpeed
prints them.
"""
from __future__ import annotations

from array import array
from typing import Dict, Iterable, List, Optional, Tuple

from dsplug.hookspecs import hookimpl
from dsplug.logging import logger

#: key of a group of records: (op, caller or None)
Label = Tuple[str, Optional[str]]

COLUMN = 20


def bus_factor(op: str, world: int) -> float:
    """How many times the message each rank moves over the bus, relative to the message size."""
    n = max(1, world)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all_single", "all_to_all"):
        return (n - 1) / n
    return 1.0


def bandwidths(op: str, nbytes: int, latency_s: float, world: int) -> Tuple[float, float]:
    """(algorithmic, bus) bandwidth in Gbps of one op; 0 when the latency is not positive."""
    if latency_s <= 0:
        return 0.0, 0.0
    algbw = nbytes * 8 / latency_s / 1e9
    return algbw, algbw * bus_factor(op, world)


def format_size(nbytes: int) -> str:
    """Bytes in binary units: ``4 B``, ``3.86 KB``, ``8.00 MB``."""
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_gbps(value: float) -> str:
    return f"{value:.2f}" if value >= 1 or value == 0 else f"{value:.3g}"


def label_text(label: Label) -> str:
    op, caller = label
    return op if caller is None else f"{op} | [Caller Func: {caller}]"


class OpStats:
    """Every occurrence of one op label with one message size."""

    __slots__ = ("count", "latencies", "algbw_sum", "busbw_sum", "async_count")

    def __init__(self):
        self.count = 0
        self.latencies = array("d")  # seconds, in order (for the straggler analysis)
        self.algbw_sum = 0.0
        self.busbw_sum = 0.0
        self.async_count = 0

    def add(self, latency_s: float, algbw: float, busbw: float, async_op: bool) -> None:
        self.count += 1
        self.latencies.append(latency_s)
        self.algbw_sum += algbw
        self.busbw_sum += busbw
        self.async_count += int(async_op)

    @property
    def total_latency_s(self) -> float:
        return sum(self.latencies)


class CommsRecorder:
    """Records collectives reported by :mod:`dsplug.comm` (through :func:`comm_hooks`).

    ops:     the op names to record, or None for every op (``prof_all``)
    verbose: log one line per op as it completes (on every rank, prefixed with the rank)
    debug:   record the issuing function of each op as part of its label
    comm:    the comm layer, for the straggler analysis (``all_gather_object``)
    """

    def __init__(self, rank: int = 0, verbose: bool = False, debug: bool = False,
                 ops: Optional[Iterable[str]] = None, comm=None):
        self.rank = rank
        self.verbose = verbose
        self.debug = debug
        self.ops = frozenset(ops) if ops is not None else None
        self.comm = comm
        self.records: Dict[Label, Dict[int, OpStats]] = {}

    # ------------------------------------------------------------------ recording
    def record(self, op: str, nbytes: int, latency_s: float, world: int, async_op: bool = False,
               caller: Optional[str] = None) -> None:
        if self.ops is not None and op not in self.ops:
            return
        label = (op, caller if self.debug else None)
        algbw, busbw = bandwidths(op, nbytes, latency_s, world)
        stats = self.records.setdefault(label, {}).get(nbytes)
        if stats is None:
            stats = self.records[label][nbytes] = OpStats()
        stats.add(latency_s, algbw, busbw, async_op)
        if self.verbose:
            logger.info(f"[rank {self.rank}] comm op: {label_text(label)}{' (async)' if async_op else ''} | "
                        f"time (ms): {latency_s * 1e3:.3f} | msg size: {format_size(nbytes)} | "
                        f"algbw (Gbps): {format_gbps(algbw)} | busbw (Gbps): {format_gbps(busbw)}")

    def reset(self) -> None:
        self.records = {}

    def rows(self) -> List[dict]:
        """One dict per (label, message size), sorted by op name then size."""
        out = []
        for label in sorted(self.records, key=lambda l: (l[0], l[1] or "")):
            for nbytes, s in sorted(self.records[label].items()):
                total = s.total_latency_s
                out.append({
                    "op": label[0], "caller": label[1], "label": label_text(label), "nbytes": nbytes,
                    "count": s.count, "async_count": s.async_count,
                    "total_latency_ms": total * 1e3, "avg_latency_ms": total / s.count * 1e3,
                    "algbw_gbps": s.algbw_sum / s.count, "busbw_gbps": s.busbw_sum / s.count,
                })
        return out

    # ------------------------------------------------------------------ summary
    def log_summary(self, show_straggler: bool = False, print_log: Optional[bool] = None) -> str:
        """Print (on rank 0 unless ``print_log`` says otherwise) and return the summary table.

        ``show_straggler`` gathers every rank's latencies, so every rank must call it; then per
        op the latency is the fastest rank's and the straggler time is this rank's excess.
        """
        text = self.straggler_text() if show_straggler else self.summary_text()
        if print_log if print_log is not None else self.rank == 0:
            print(text, flush=True)
        return text

    def summary_text(self) -> str:
        header = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                  "tput_avg (Gbps)", "busbw_avg (Gbps)"]
        lines = [f"dsplug comms logger summary (rank {self.rank})", _row(header)]
        previous = None
        for r in self.rows():
            if r["label"] != previous:
                lines.append(r["label"])
                previous = r["label"]
            lines.append(_row(["", format_size(r["nbytes"]), str(r["count"]), f"{r['total_latency_ms']:.3f}",
                               f"{r['avg_latency_ms']:.3f}", format_gbps(r["algbw_gbps"]),
                               format_gbps(r["busbw_gbps"])]))
        return "\n".join(lines + self._notes())

    def straggler_text(self) -> str:
        if self.comm is None:
            raise RuntimeError("comms logger: the straggler analysis needs the comm layer (pass comm=)")
        mine = {(label, nbytes): list(s.latencies) for label, sizes in self.records.items()
                for nbytes, s in sizes.items()}
        everyone = self.comm.all_gather_object(mine)
        header = ["Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                  "Avg comm lat(ms)", "Avg straggler(ms)"]
        lines = [f"dsplug comms logger straggler summary (rank {self.rank}, {len(everyone)} ranks)", _row(header)]
        previous = None
        for (label, nbytes), own in sorted(mine.items(), key=lambda kv: (kv[0][0][0], kv[0][0][1] or "", kv[0][1])):
            text = label_text(label)
            if text != previous:
                lines.append(text)
                previous = text
            others = [rank_records.get((label, nbytes)) for rank_records in everyone]
            if any(o is None or len(o) != len(own) for o in others):
                lines.append(_row(["", format_size(nbytes), str(len(own)), "n/a (ranks logged different counts)"]))
                continue
            fastest = [min(values) for values in zip(*others)]
            comm_ms = sum(fastest) * 1e3
            straggler_ms = sum(o - f for o, f in zip(own, fastest)) * 1e3
            n = len(own)
            lines.append(_row(["", format_size(nbytes), str(n), f"{comm_ms:.3f}", f"{straggler_ms:.3f}",
                               f"{comm_ms / n:.3f}", f"{straggler_ms / n:.3f}"]))
        return "\n".join(lines + self._notes())

    def _notes(self) -> List[str]:
        if not self.records:
            return ["(no communication ops were logged)"]
        async_ops = sorted({label_text(label) for label, sizes in self.records.items()
                            if any(s.async_count for s in sizes.values())})
        if not async_ops:
            return []
        return [f"note: {', '.join(async_ops)} ran asynchronously (some or all calls); their latency is "
                "measured from launch to wait(), so it includes work overlapped with them"]


def _row(cells: List[str]) -> str:
    return "".join(f"{c:<{COLUMN}}" for c in cells[:-1]) + cells[-1]


# ---------------------------------------------------------------------- the comm hooks
class CommHooks:
    """The comm-hook implementations of one :class:`CommsRecorder` (what goes on
    ``dsplug.comm.events``). Without ``debug`` the op hook does not take ``caller``, so the comm
    layer does not look the issuing function up."""

    def __init__(self, log: CommsRecorder):
        self.log = log

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, latency_s, world_size, async_op):
        self.log.record(op, nbytes, latency_s, world_size, async_op=async_op)

    @hookimpl
    def dsplug_comm_summary(self, show_straggler):
        return self.log.log_summary(show_straggler=show_straggler)


class CallerCommHooks(CommHooks):
    """:class:`CommHooks` of a ``debug`` logger: records the issuing function too."""

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, latency_s, world_size, async_op, caller):
        self.log.record(op, nbytes, latency_s, world_size, async_op=async_op, caller=caller)


def comm_hooks(log: CommsRecorder) -> CommHooks:
    """The object to register on ``dsplug.comm.events`` for ``log``."""
    return (CallerCommHooks if log.debug else CommHooks)(log)
