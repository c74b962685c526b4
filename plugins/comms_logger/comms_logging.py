"""DeepSpeed's ``deepspeed.utils.comms_logging.CommsLogger``: the recorder API over this plugin.

DeepSpeed code keeps a ``CommsLogger`` and reads its records as ``comms_dict``::

    comms_dict[record_name][msg_size] = [count, [latency_ms, ...], [algbw_gbps, ...], [busbw_gbps, ...]]

with the i-th entry of each list describing the i-th recorded op. This class keeps that layout and
DeepSpeed's methods (``append``, ``get_raw_data``, ``get_operation_summary``, ``start_profiling_comms``
…); its bandwidths are this plugin's (:func:`.logger.bandwidths`: nccl-tests definitions, the message
size being the whole buffer). It also has the plugin logger's ``record`` signature, so
:func:`.logger.comm_hooks` registers it on ``dsplug.comm.events`` and it records what dsplug's comm
layer issues (gated, as in DeepSpeed, by ``enabled`` and ``prof_all`` / ``prof_ops``).

Summaries never reorder the stored lists (the averages are trimmed means of sorted copies).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional

from dsplug.logging import logger
from dsplug.utils.timer import trim_mean

from .logger import bandwidths, format_size

#: share of the lowest and of the highest values left out of the averages (as in DeepSpeed)
TRIM = 0.1


def _world_size() -> int:
    from dsplug import comm

    return comm.get_world_size() if comm.is_initialized() else 1


class CommsLogger:
    """DeepSpeed's comms recorder. Defaults are the ``comms_logger`` section's: disabled, not
    verbose, no debug labels, ``prof_all`` true, ``prof_ops`` empty."""

    def __init__(self):
        self.comms_dict: Dict[str, Dict[int, list]] = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: List[str] = []

    # ------------------------------------------------------------------ configuration
    def configure(self, comms_config) -> None:
        """Take the settings of a ``comms_logger`` section: a dict, the plugin's parsed
        :class:`~.config.CommsLoggerConfig`, or DeepSpeed's comms config object (with
        ``comms_logger_enabled`` and ``comms_logger``)."""
        if hasattr(comms_config, "comms_logger_enabled"):
            enabled, section = comms_config.comms_logger_enabled, comms_config.comms_logger
        else:
            if isinstance(comms_config, dict):
                from dsplug.config.schema import parse

                from .config import CommsLoggerConfig

                comms_config = parse(CommsLoggerConfig, comms_config, "comms_logger")
            enabled, section = comms_config.enabled, comms_config
        self.enabled = bool(enabled)
        if self.enabled:
            self.verbose = bool(section.verbose)
            self.debug = bool(section.debug)
            self.prof_all = bool(section.prof_all)
            self.prof_ops = list(section.prof_ops)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        drop = set(op_name_list)
        self.prof_ops = [op for op in self.prof_ops if op not in drop]

    def profiles(self, op: str) -> bool:
        """Whether an op of this name is recorded now."""
        return self.enabled and (self.prof_all or op in self.prof_ops)

    # ------------------------------------------------------------------ recording
    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int,
               world_size: Optional[int] = None) -> None:
        """Record one op: ``raw_name`` picks the bandwidth formula, ``record_name`` is the key
        (the op, with its caller under ``debug``), ``latency`` in milliseconds, ``msg_size`` in
        bytes; ``world_size`` defaults to the initialized comm's (1 without one)."""
        world = _world_size() if world_size is None else world_size
        algbw, busbw = bandwidths(raw_name, msg_size, latency / 1e3, world)
        entry = self.comms_dict.setdefault(record_name, {}).get(msg_size)
        if entry is None:
            self.comms_dict[record_name][msg_size] = [1, [latency], [algbw], [busbw]]
        else:
            entry[0] += 1
            entry[1].append(latency)
            entry[2].append(algbw)
            entry[3].append(busbw)
        if self.verbose:
            logger.info(f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {format_size(msg_size)} "
                        f"| algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}")

    def record(self, op: str, nbytes: int, latency_s: float, world: int, async_op: bool = False,
               caller: Optional[str] = None) -> None:
        """The comm hook's entry (same signature as the plugin logger's ``record``)."""
        if not self.profiles(op):
            return
        name = op if caller is None or not self.debug else f"{op} | [Caller Func: {caller}]"
        self.append(op, name, latency_s * 1e3, nbytes, world_size=world)

    # ------------------------------------------------------------------ reading
    def get_raw_data(self) -> Dict[str, Dict[int, list]]:
        """A copy of ``comms_dict`` (its top level)."""
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> List[str]:
        return list(self.comms_dict)

    def get_total_count(self) -> int:
        return sum(v[0] for sizes in self.comms_dict.values() for v in sizes.values())

    def get_total_latency(self) -> float:
        """Sum of every recorded latency, in milliseconds."""
        return math.fsum(lat for sizes in self.comms_dict.values() for v in sizes.values() for lat in v[1])

    def get_total_msg_size(self) -> int:
        """Bytes moved: message size times count, over every record."""
        return sum(size * v[0] for sizes in self.comms_dict.values() for size, v in sizes.items())

    def get_operation_summary(self, operation_name: str) -> Optional[Dict[int, dict]]:
        """Per message size of one record name: count, total and trimmed-mean latency (ms), trimmed-mean
        algorithmic and bus bandwidth (Gbps), the size in bytes and as text; None for an unknown name."""
        sizes = self.comms_dict.get(operation_name)
        if sizes is None:
            return None
        return {size: {"count": v[0], "total_latency_ms": math.fsum(v[1]),
                       "avg_latency_ms": trim_mean(v[1], TRIM), "tput_avg_gbps": trim_mean(v[2], TRIM),
                       "busbw_avg_gbps": trim_mean(v[3], TRIM), "msg_size_bytes": size,
                       "msg_size_str": format_size(size)}
                for size, v in sizes.items()}

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False):
        """Print the summary table (with ``print_log``); with ``return_dict`` return
        ``{record_name: get_operation_summary(record_name)}``."""
        if show_straggler:
            raise NotImplementedError("deepspeed.utils.comms_logging.CommsLogger.log_all(show_straggler=True) is "
                                      "not built in dsplug; use dsplug.comm.log_summary(show_straggler=True)")
        summaries = {name: self.get_operation_summary(name) for name in sorted(self.comms_dict)}
        if print_log:
            header = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                      "tput_avg (Gbps)", "busbw_avg (Gbps)"]
            lines = ["".join(f"{h:<20}" for h in header)]
            for name, sizes in summaries.items():
                lines.append(name)
                for size in sorted(sizes):
                    s = sizes[size]
                    cells = ["", s["msg_size_str"], str(s["count"]), f"{s['total_latency_ms']:.2f}",
                             f"{s['avg_latency_ms']:.2f}", f"{s['tput_avg_gbps']:.2f}", f"{s['busbw_avg_gbps']:.2f}"]
                    lines.append("".join(f"{c:<20}" for c in cells))
            print("\n".join(lines), flush=True)
        return summaries if return_dict else None


__all__ = ["CommsLogger"]
