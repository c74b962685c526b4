"""``dsplug build-ops``: compile the native ops now instead of at first use."""
from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def add_parser(subparsers):
    p = subparsers.add_parser("build-ops", help="compile the native ops (C++/pybind11) into the build cache",
                              description="Compile native ops into the cache ($DSPLUG_OPS_CACHE, default "
                                          "~/.cache/dsplug/ops). Ops already built for the current sources, flags "
                                          "and CPU are reused unless --force.")
    p.add_argument("ops", nargs="*", metavar="OP", help="ops to build (default: all)")
    p.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    p.add_argument("--clean", action="store_true", help="delete the whole build cache first (a cold build)")
    p.add_argument("--jobs", type=int, default=0, help="ops built at once (default: all)")
    p.add_argument("--verbose", action="store_true", help="print the compiler commands")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.set_defaults(func=run)


def _build_one(name, force, verbose):
    from dsplug.op_builder import OpBuildError, OpUnavailableError, get_builder

    builder = get_builder(name)
    was_built = builder.is_built()
    started = time.perf_counter()
    try:
        path = builder.build(force=force, verbose=verbose)
        builder.load_extension()  # proves the library imports
    except (OpBuildError, OpUnavailableError, ImportError, OSError) as err:
        return {"op": name, "ok": False, "error": str(err).strip()}
    seconds = time.perf_counter() - started
    return {"op": name, "ok": True, "compiled": force or not was_built, "seconds": round(seconds, 2),
            "detail": builder.backend_detail(), "path": str(path)}


def run(args) -> int:
    from dsplug.op_builder import ALL_OPS, cache_root

    names = args.ops or sorted(ALL_OPS)
    unknown = [n for n in names if n not in ALL_OPS]
    if unknown:
        print(f"dsplug build-ops: unknown op(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(ALL_OPS))}",
              file=sys.stderr)
        return 2
    if args.jobs < 0:
        print(f"dsplug build-ops: --jobs must be >= 0, got {args.jobs}", file=sys.stderr)
        return 2
    root = cache_root()
    if args.clean and root.exists():
        shutil.rmtree(root)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs or len(names)) as pool:  # ninja runs the compilers
        results = list(pool.map(lambda n: _build_one(n, args.force, args.verbose), names))
    total = time.perf_counter() - started
    failed = [r for r in results if not r["ok"]]
    if args.json:
        print(json.dumps({"cache": str(root), "seconds": round(total, 2), "ops": results}, indent=2))
        return 1 if failed else 0
    width = max(len(n) for n in names)
    for r in results:
        if r["ok"]:
            how = f"built in {r['seconds']:.1f} s" if r["compiled"] else "cached"
            print(f"{r['op']:<{width}}  ok      {how:<16} {r['detail']}")
        else:
            print(f"{r['op']:<{width}}  FAILED  {r['error']}")
    compiled = sum(1 for r in results if r["ok"] and r["compiled"])
    print(f"{len(results) - len(failed)}/{len(results)} op(s) ready in {total:.1f} s ({compiled} compiled) in {root}")
    if failed:
        print("ops that failed use their pure-torch fallback at run time (slower, same results)", file=sys.stderr)
    return 1 if failed else 0
