"""The text of a flops profile: summary, aggregated profile per depth, detailed module tree.

The layout follows DeepSpeed's flops profiler output so that people (and scripts) used to it
find the same lines: ``Profile Summary at step N``, ``fwd MACs per GPU``, ``Aggregated Profile
per GPU`` with ``depth d:`` blocks, and the module tree with ``params, % Params, MACs, % MACs,
latency, % latency, FLOPS`` after each module's name.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import attrs

from .formatting import (duration_to_string, flops_to_string, macs_to_string, number_to_string,
                         params_to_string, percent)
from .profiler import get_module_duration, get_module_flops, get_module_macs, get_module_params

RULE = "-" * 26
LABEL_WIDTH = 60


@attrs.frozen
class StepLatency:
    """Seconds spent in one training step, as the engine observer measured them.

    fwd:  the profiled forward pass (one micro-batch);
    bwd:  one micro-batch's backward pass, when known (the engine's wall-clock breakdown);
    step: the optimizer step, when known;
    iter: the whole step, first forward to optimizer step end, covering ``micro_steps``
          forward/backward passes (gradient accumulation).
    """

    fwd: float
    bwd: Optional[float] = None
    step: Optional[float] = None
    iter: Optional[float] = None
    micro_steps: int = 1


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_print_options(module_depth, top_modules) -> None:
    """Raise a ValueError naming the option when ``module_depth`` / ``top_modules`` are invalid."""
    _check_int("module_depth", module_depth, -1)
    _check_int("top_modules", top_modules, 1)


def render_profile(profiler, *, profile_step=1, module_depth=-1, top_modules=1, detailed=True,
                   step_latency: Optional[StepLatency] = None) -> str:
    check_print_options(module_depth, top_modules)
    lines: List[str] = []
    lines += _summary(profiler, profile_step, step_latency)
    lines += _aggregated(profiler.model, module_depth, top_modules)
    if detailed:
        lines += _detailed(profiler.model)
    lines.append("-" * 78)
    return "\n".join(lines) + "\n"


def write_text(text: str, output_file: Optional[str]) -> None:
    """Print ``text``, or write it to ``output_file`` (its folder is created if missing)."""
    if output_file is None:
        print(text, end="", flush=True)
        return
    path = os.fspath(output_file)
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise OSError(f"flops profiler could not write its profile to output_file={path!r}: {exc}") from exc


# ------------------------------------------------------------------------------------- summary
def _row(label: str, value) -> str:
    head = label + ":"
    return f"{head:<{max(LABEL_WIDTH, len(head) + 2)}}{str(value).rstrip()}"


def _summary(profiler, profile_step, latency: Optional[StepLatency]) -> List[str]:
    topo = profiler.topology()
    mp = topo["mp_size"]
    params = get_module_params(profiler.model)
    flops = get_module_flops(profiler.model)
    macs = get_module_macs(profiler.model)
    fwd = latency.fwd if latency is not None else get_module_duration(profiler.model)
    rff = profiler.recompute_fwd_factor
    lines = [
        f"{RULE} DeepSpeed Flops Profiler {RULE}",
        f"Profile Summary at step {profile_step}:",
        "Notations:",
        "data parallel size (dp_size), model parallel size(mp_size),",
        "number of parameters (params), number of multiply-accumulate operations(MACs),",
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
        "",
    ]
    if topo["world_size"] is not None:
        lines.append(_row("world size", topo["world_size"]))
        lines.append(_row("data parallel size", topo["dp_size"]))
        lines.append(_row("model parallel size", mp))
    if topo["batch_size"] is not None:
        lines.append(_row("batch size per GPU", topo["batch_size"]))
    lines += [
        _row("params per GPU", params_to_string(params)),
        _row("params of model = params per GPU * mp_size", params_to_string(params * mp)),
        _row("fwd MACs per GPU", macs_to_string(macs)),
        _row("fwd flops per GPU", number_to_string(flops)),
        _row("fwd flops of model = fwd flops per GPU * mp_size", number_to_string(flops * mp)),
        _row("fwd latency", duration_to_string(fwd)),
        _row("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", flops_to_string(_rate(flops, fwd))),
    ]
    uncounted = _uncounted_kinds(profiler.model)
    if uncounted:
        lines.append(f"not counted (fused kernels, reported as 0 MACs): {', '.join(uncounted)}")
    if latency is None:
        return lines + [""]
    bwd_factor = 2.0 + rff
    factor_text = "2" if rff == 0 else f"(2 + {rff:g})"
    all_factor_text = "3" if rff == 0 else f"(3 + {rff:g})"
    if latency.bwd is not None:
        lines += [
            _row("bwd latency", duration_to_string(latency.bwd)),
            _row(f"bwd FLOPS per GPU = {factor_text} * fwd flops per GPU / bwd latency",
                 flops_to_string(_rate(bwd_factor * flops, latency.bwd))),
            _row(f"fwd+bwd FLOPS per GPU = {all_factor_text} * fwd flops per GPU / (fwd+bwd latency)",
                 flops_to_string(_rate((1 + bwd_factor) * flops, latency.fwd + latency.bwd))),
        ]
    if latency.step is not None:
        lines.append(_row("step latency", duration_to_string(latency.step)))
    if latency.iter is not None:
        k = latency.micro_steps
        if k > 1:
            lines.append(_row("micro-steps (forward+backward passes) in the step", k))
        per_iter = f"{all_factor_text} * fwd flops per GPU" + (f" * {k}" if k > 1 else "")
        lines += [
            _row("iter latency", duration_to_string(latency.iter)),
            _row(f"FLOPS per GPU = {per_iter} / iter latency",
                 flops_to_string(_rate((1 + bwd_factor) * flops * k, latency.iter))),
        ]
        if topo["batch_size"] is not None:
            samples = topo["batch_size"] * k * (topo["dp_size"] or 1)
            lines.append(_row("samples/second", f"{_rate(samples, latency.iter):.2f}"))
    return lines + [""]


def _uncounted_kinds(model) -> List[str]:
    """Class names of modules whose arithmetic the profiler cannot see (recurrent layers)."""
    import torch.nn as nn

    return sorted({type(m).__name__ for m in model.modules() if isinstance(m, (nn.RNNBase, nn.RNNCellBase))})


def _rate(amount, seconds) -> float:
    return amount / seconds if seconds else 0.0


# ------------------------------------------------------------------------------------- aggregated
def _aggregated(model, module_depth: int, top_modules: int) -> List[str]:
    per_depth: Dict[int, Dict[str, List[float]]] = {}

    def walk(module, depth):
        name = type(module).__name__
        totals = per_depth.setdefault(depth, {}).setdefault(name, [0, 0, 0.0])
        totals[0] += get_module_params(module)
        totals[1] += get_module_macs(module)
        totals[2] += get_module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    deepest = max(per_depth)
    last = deepest if module_depth == -1 else min(module_depth, deepest)
    lines = [f"{RULE} Aggregated Profile per GPU {RULE}",
             f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        items = per_depth[depth]

        def top(index, fmt):
            ranked = sorted(items.items(), key=lambda kv: kv[1][index], reverse=True)[:top_modules]
            return {name: fmt(values[index]) for name, values in ranked}

        lines += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines + [""]


# ------------------------------------------------------------------------------------- detailed
NOTES = [
    "Note: 1. A module can compute part of its output with torch.nn.functional calls or tensor methods",
    "(e.g. a loss) instead of submodules. Those are counted in the module itself, so a parent's MACs",
    "(or latency) can exceed the sum of its submodules'.",
    "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using that",
    "could be larger than the maximum system throughput.",
    "3. The fwd latency listed in the top module's profile is captured at the module's forward call;",
    "the fwd latency in the summary may be measured around it (by the engine) and be larger.",
]


def _detailed(model) -> List[str]:
    totals = (get_module_params(model), get_module_macs(model), get_module_duration(model))
    lines = [f"{RULE} Detailed Profile per GPU {RULE}",
             "Each module profile is listed after its name in the following order:",
             "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
             "percentage of total fwd latency, fwd FLOPS",
             ""] + NOTES + [""]
    return lines + _module_tree(model, totals).split("\n")


def _module_stats(module, totals) -> str:
    params = get_module_params(module)
    macs = get_module_macs(module)
    flops = get_module_flops(module)
    duration = get_module_duration(module)
    return ", ".join([
        params_to_string(params), f"{percent(params, totals[0])} Params",
        macs_to_string(macs), f"{percent(macs, totals[1])} MACs",
        duration_to_string(duration), f"{percent(duration, totals[2])} latency",
        flops_to_string(round(_rate(flops, duration), 2)),
    ])


def _indent(text: str, spaces: int) -> str:
    first, *rest = text.split("\n")
    return "\n".join([first] + [" " * spaces + line for line in rest])


def _module_tree(module, totals) -> str:
    """Like ``repr(module)``, with the module's measurements ahead of its own extra_repr."""
    own = _module_stats(module, totals)
    extra = module.extra_repr()
    if extra:
        own += ", " + extra
    children = [f"({name}): " + _module_tree(child, totals) for name, child in module.named_children()]
    name = type(module).__name__
    if not children and "\n" not in own:
        return f"{name}({own})"
    body = own.split("\n") + children
    return name + "(\n  " + "\n  ".join(_indent(part, 2) for part in body) + "\n)"
