"""The ranked results table: what ``dsplug launch --autotuning`` prints and writes to ``summary.txt``.

One row per measured experiment, best first (ties keep the order they ran in), numbers to 6
significant digits; then every experiment that was not measured with its status and reason, why
the tuning stopped, and the best::

    dsplug autotuning results: ranked by throughput (samples/s, higher is better)
    rank  experiment     stage  micro_batch  grad_acc  train_batch  latency_ms  throughput  flops
    1     z0_mbs16_gas1  0      16           1         32           6.78479     4716.43     2.37255e+08
"""
from __future__ import annotations

from typing import List, Sequence

from .runner import Experiment
from .tuner import HIGHER_IS_BETTER, score

UNITS = {"latency": "ms per step", "throughput": "samples/s", "flops": "FLOPS per GPU"}
COLUMNS = ("rank", "experiment", "stage", "micro_batch", "grad_acc", "train_batch", "latency_ms", "throughput",
           "flops")


def number(value) -> str:
    return "-" if value is None else f"{float(value):.6g}"


def rank(experiments: Sequence[Experiment], metric: str) -> List[Experiment]:
    """The measured experiments, best first."""
    done = [e for e in experiments if e.value(metric) is not None]
    order = {id(e): i for i, e in enumerate(done)}
    return sorted(done, key=lambda e: (-score(metric, e.value(metric)), order[id(e)]))


def format_table(experiments: Sequence[Experiment], metric: str, stop_reason: str) -> str:
    better = "higher" if HIGHER_IS_BETTER[metric] else "lower"
    lines = [f"dsplug autotuning results: ranked by {metric} ({UNITS[metric]}, {better} is better)"]
    ranked = rank(experiments, metric)
    rows = [COLUMNS]
    for i, e in enumerate(ranked, 1):
        c, m = e.candidate, e.metrics
        rows.append((str(i), e.name, str(c.stage), str(c.micro_batch), str(c.gas), str(c.train_batch),
                     number(m.get("latency")), number(m.get("throughput")), number(m.get("flops"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    others = [e for e in experiments if e.value(metric) is None]
    if others:
        lines.append("not measured:")
        lines += [f"  {e.name}  {e.status}: {e.reason}" for e in others]
    lines.append(f"stopped: {stop_reason}")
    if ranked:
        lines.append(f"best: {ranked[0].name} ({metric} {number(ranked[0].value(metric))} {UNITS[metric]})")
    else:
        lines.append("best: none (no experiment completed)")
    return "\n".join(lines)
