"""``dsplug list``: every discovered plugin with its distribution, the module that implements
it (so a config key leads to its file in one hop) and native-op status."""
from __future__ import annotations

import json


def add_parser(subparsers):
    p = subparsers.add_parser("list", help="list discovered plugins")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--category", help="only this category")
    p.set_defaults(func=run)


def op_states(names):
    """name -> status dict for native ops, without compiling anything."""
    if not names:
        return {}
    try:
        from dsplug.op_builder import op_status
    except ImportError:  # op builder not installed in this build
        return {n: {"built": False, "compatible": False, "detail": "op builder unavailable"} for n in names}
    out = {}
    for name in names:
        try:
            st = op_status(name)
            out[name] = {"built": bool(st.built), "compatible": bool(st.compatible), "detail": st.detail}
        except KeyError:
            out[name] = {"built": False, "compatible": False, "detail": "unknown op"}
    return out


def plugin_module(provided) -> str:
    """The dotted module implementing ``provided`` (see :attr:`dsplug.descriptors.Provided.module`)."""
    return provided.module


def rows(registry, category=None):
    entries = []
    for p in sorted(registry.all(), key=lambda p: (p.category, p.name.lower())):
        if category and p.category != category:
            continue
        entries.append(
            {
                "category": p.category,
                "name": p.name,
                "aliases": list(p.spec.aliases),
                "section": p.spec.section,
                "distribution": p.distribution,
                "version": p.version,
                "entry_point": p.entry_point,
                "module": plugin_module(p),
                "ops": list(p.spec.ops),
                "summary": p.spec.summary,
            }
        )
    states = op_states(sorted({op for e in entries for op in e["ops"]}))
    for e in entries:
        e["ops"] = [{"name": op, **states[op]} for op in e["ops"]]
    return entries


def _op_text(ops):
    if not ops:
        return "-"
    return ", ".join(f"{o['name']}({'built' if o['built'] else ('not built' if o['compatible'] else 'unavailable')})" for o in ops)


def run(args) -> int:
    from dsplug.registry import get_registry

    registry = get_registry()
    entries = rows(registry, args.category)
    if args.json:
        print(json.dumps({"plugins": entries, "broken": [dict(zip(("entry_point", "distribution", "error"), b)) for b in registry.broken],
                          "blocked": [w for w, _ in registry.skipped]}, indent=2))
        return 0
    headers = ("CATEGORY", "NAME", "DISTRIBUTION", "VERSION", "MODULE", "NATIVE OPS", "SUMMARY")
    table = [(e["category"], e["name"] + (f" ({', '.join(e['aliases'])})" if e["aliases"] else ""), e["distribution"],
              e["version"], e["module"], _op_text(e["ops"]), e["summary"]) for e in entries]
    widths = [max(len(str(r[i])) for r in [headers] + table) for i in range(len(headers) - 1)]
    for r in [headers] + table:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    for ep, dist, err in registry.broken:
        print(f"BROKEN   entry point {ep!r} from {dist}: {err}")
    for what, why in registry.skipped:
        print(f"BLOCKED  {what} by {why}")
    return 0
