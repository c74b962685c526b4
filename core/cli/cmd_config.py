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
    """JSON path -> 'category:name (distribution version) module' of who handles it; the module
    implementing the plugin leads from a config key to its file in one hop."""
    from dsplug.cli.cmd_list import plugin_module

    def who(p):
        return f"{p.category}:{p.name} ({p.distribution} {p.version}) {plugin_module(p)}"

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
    for provided, _ in getattr(config, "compression", ()):  # each compression_training key selects a plugin
        out[f"compression_training.{provided.name}"] = who(provided)
    # section fields that select a plugin of another category (a section spec's ``selects``)
    from dsplug.registry import PluginNotFoundError

    for owner in config.registry.sections().values():
        if not owner.spec.selects:
            continue
        category, field_name = owner.spec.selects
        path = f"{owner.spec.section}.{field_name}"
        try:
            provided, _ = config.selection(category)
            out[path] = who(provided)
        except PluginNotFoundError:
            value = getattr(config.section(owner.spec.section), field_name, "?")
            out[path] = f"{category} {value} (no plugin installed)"
    return out


def memory_report(config, num_params: float):
    """The per-rank model-state estimate of the plugin that owns it (``dsplug_estimate_model_state_bytes``)."""
    estimate = config.registry.pm.hook.dsplug_estimate_model_state_bytes(
        num_params=int(num_params), world_size=config.world_size or 1, config=config)
    if estimate is None:
        raise SystemExit("config explain --params: no installed plugin estimates model-state memory (the plugin "
                         "owning the ZeRO stages implements dsplug_estimate_model_state_bytes); `dsplug list` "
                         "shows what is installed")
    return estimate


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
        estimate = memory_report(config, args.params)
        result["memory_per_rank"] = {k: v for k, v in estimate.items() if k not in ("assumptions", "summary")}
        result["memory_assumptions"] = {**estimate.get("assumptions", {}), "params": int(args.params),
                                        "world_size": args.world_size}
        summary = estimate.get("summary")
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
        print(f"\n# model states per rank: {a['params']:,} parameters, "
              + (f"{summary}, " if summary else "") + f"{a['world_size']} ranks")
        sides = [(k, v) for k, v in result["memory_per_rank"].items() if isinstance(v, dict)]
        if not sides:  # a plugin's estimate without a breakdown by where the bytes live
            sides = [("total", result["memory_per_rank"])]
        for side, m in sides:
            if m.get("total", 0) == 0 and side == "host":
                continue
            parts = [f"{k.replace('_', ' ')} {format_bytes(m[k]):>12}"
                     for k in ("parameters", "gradients", "optimizer_states") if k in m]
            print(f"  {side:<7} " + "  ".join(parts + [f"total {format_bytes(m.get('total', 0)):>12}"]))
    return 0
