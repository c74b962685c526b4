"""``dsplug config check FILE`` and ``dsplug config explain FILE``."""
from __future__ import annotations

import json
import sys


def add_parser(subparsers):
    p = subparsers.add_parser("config", help="validate or explain a DeepSpeed-format config")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION")
    sub.required = True
    check = sub.add_parser("check", help="exit 0 if valid; else list every error and exit 1")
    check.add_argument("file")
    check.add_argument("--world-size", type=int, default=None, help="data-parallel size to check batch sizes against")
    check.set_defaults(func=run_check)
    explain = sub.add_parser("explain", help="resolved config, serving plugins, per-rank memory of model states")
    explain.add_argument("file")
    explain.add_argument("--world-size", type=int, default=1)
    explain.add_argument("--params", type=float, default=None, help="number of model parameters (e.g. 1.3e9)")
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(func=run_explain)


def _load(args):
    import warnings

    from dsplug.config import ConfigError, DsplugConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = DsplugConfig(args.file, world_size=args.world_size)
        except ConfigError as exc:
            return None, exc, caught
        except (OSError, TypeError) as exc:
            return None, exc, caught
    return config, None, caught


def run_check(args) -> int:
    config, error, caught = _load(args)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if error is not None:
        issues = getattr(error, "issues", None)
        if issues is None:
            print(f"{args.file}: {error}", file=sys.stderr)
        else:
            print(f"{args.file}: {len(issues)} error{'s' if len(issues) != 1 else ''}", file=sys.stderr)
            for issue in issues:
                print(f"  - {issue}", file=sys.stderr)
        return 1
    print(f"{args.file}: valid" + (f" for world size {args.world_size}" if args.world_size else ""))
    return 0


def serving_plugins(config):
    """JSON path -> 'category:name (distribution version)' of who handles it."""
    def who(p):
        return f"{p.category}:{p.name} ({p.distribution} {p.version})"

    out = {}
    for key in config.raw:
        if key in ("optimizer", "scheduler"):
            selected = getattr(config, key)
            if selected is not None:
                out[key] = who(selected.provided)
        elif key in config.sections:
            out[key] = who(config.registry.sections()[key])
        else:
            out[key] = "kernel"
    zero = config.sections.get("zero_optimization")
    stage = zero.stage if zero is not None else 0
    stage_plugin = config.registry.find("zero_stage", str(stage))
    out["zero_optimization.stage"] = who(stage_plugin) if stage_plugin else f"zero stage {stage} (no plugin installed)"
    return out


def memory_report(config, num_params: float):
    """Ask the plugin owning ``zero_optimization`` for its per-rank memory estimate."""
    owner = config.registry.sections().get("zero_optimization")
    model_state_bytes = owner.spec.extra.get("memory_estimator") if owner is not None else None
    if model_state_bytes is None:
        raise SystemExit("config explain --params: no installed plugin estimates model-state memory "
                         "(the zero_optimization section's owner provides it)")
    zero = config.section("zero_optimization")
    stage = zero.stage if zero is not None else 0
    half = any(getattr(config.sections.get(s), "enabled", False) is True for s in ("fp16", "bf16"))
    states = 2
    if config.optimizer is not None:
        states = int(config.optimizer.spec.extra.get("states_per_param", 2))
    return model_state_bytes(
        int(num_params), config.world_size or 1, stage, half_precision=half, optimizer_states=states,
        offload_optimizer=zero is not None and zero.offload_optimizer.device != "none",
        offload_param=zero is not None and zero.offload_param.device != "none",
    ), stage, half, states


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n} B"


def run_explain(args) -> int:
    config, error, caught = _load(args)
    if error is not None:
        return run_check(args)
    result = {"config": config.to_dict(), "served_by": serving_plugins(config)}
    if args.params:
        mem, stage, half, states = memory_report(config, args.params)
        result["memory_per_rank"] = mem
        result["memory_assumptions"] = {"stage": stage, "mixed_precision": half, "optimizer_states_per_param": states,
                                        "params": int(args.params), "world_size": args.world_size}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"# resolved config ({config.source}, world size {args.world_size})")
    print(json.dumps(result["config"], indent=2))
    print("\n# served by")
    for key, who in result["served_by"].items():
        print(f"  {key:<28} {who}")
    if args.params:
        a = result["memory_assumptions"]
        print(f"\n# model states per rank: {a['params']:,} parameters, ZeRO stage {a['stage']}, "
              f"{'16-bit mixed precision' if a['mixed_precision'] else 'fp32'}, "
              f"{a['optimizer_states_per_param']} optimizer states per parameter, {a['world_size']} ranks")
        for side in ("device", "host"):
            m = result["memory_per_rank"][side]
            if m["total"] == 0 and side == "host":
                continue
            print(f"  {side:<7} parameters {format_bytes(m['parameters']):>12}  gradients {format_bytes(m['gradients']):>12}"
                  f"  optimizer states {format_bytes(m['optimizer_states']):>12}  total {format_bytes(m['total']):>12}")
    return 0
