"""``dsplug nvme-tune``: find the fastest aio_handle settings for a directory (like ds_nvme_tune).

Sweeps block size, queue depth, intra-op parallelism, single_submit and overlap_events, times
O_DIRECT writes and reads of ``--io_size`` bytes for each combination, and prints the best
``"aio": {...}`` block for a DeepSpeed config. The default sweep is small (about 24 combinations,
well under a minute); ``--full`` or the per-parameter flags widen it.

Contributed to the ``dsplug`` command by the offload plugin (:func:`.plugin.dsplug_cli_commands`).
"""
from __future__ import annotations

import json
import os
import sys
import time

from dsplug.descriptors import CliCommand

DEFAULT_SPACE = {"block_size": ["256K", "1M"], "queue_depth": [8, 32, 128], "intra_op_parallelism": [1, 2],
                 "single_submit": [False], "overlap_events": [False, True]}
FULL_SPACE = {"block_size": ["128K", "256K", "512K", "1M", "2M", "4M", "8M"], "queue_depth": [4, 8, 16, 32, 64, 128],
              "intra_op_parallelism": [1, 2, 4, 8], "single_submit": [False, True], "overlap_events": [False, True]}
SWEEP_KEYS = {"block_size": "block_size", "queue_depth": "queue_depth", "intra_op_parallelism": "intra_op_parallelism",
              "io_parallel": "intra_op_parallelism", "thread_count": "intra_op_parallelism",
              "single_submit": "single_submit", "overlap_events": "overlap_events"}


def _csv(text):
    return [t for t in text.split(",") if t.strip()]


def add_arguments(p) -> None:
    p.add_argument("--nvme_dir", nargs="+", required=True, help="writable directories on the storage to tune")
    p.add_argument("--io_size", default="64M", help="bytes written and read per measurement (default 64M)")
    p.add_argument("--loops", type=int, default=1, help="repetitions per configuration; the best counts (default 1)")
    p.add_argument("--no_read", action="store_true", help="do not measure reads")
    p.add_argument("--no_write", action="store_true", help="do not measure writes")
    p.add_argument("--full", action="store_true", help="sweep the wide space (hundreds of combinations)")
    p.add_argument("--sweep_config", help="JSON file: lists per key (block_size, queue_depth, "
                                          "intra_op_parallelism or io_parallel, single_submit, overlap_events)")
    p.add_argument("--block_size", type=_csv, help="comma-separated block sizes, e.g. 128K,1M,4M")
    p.add_argument("--queue_depth", type=_csv, help="comma-separated queue depths, e.g. 4,32,128")
    p.add_argument("--intra_op_parallelism", type=_csv, help="comma-separated thread counts, e.g. 1,2,4")
    p.add_argument("--single_submit", type=_csv, help="comma-separated booleans, e.g. false,true")
    p.add_argument("--overlap_events", type=_csv, help="comma-separated booleans, e.g. false,true")
    p.add_argument("--gpu", action="store_true", help="not supported (host tensors only)")
    p.add_argument("--gds", action="store_true", help="not supported (no GPUDirect Storage op)")
    p.add_argument("--verbose", action="store_true", help="print every configuration's result")


def _space(args):
    space = dict(FULL_SPACE if args.full else DEFAULT_SPACE)
    if args.sweep_config:
        with open(args.sweep_config) as f:
            loaded = json.load(f)
        for key, values in loaded.items():
            if key not in SWEEP_KEYS:
                raise ValueError(f"{args.sweep_config}: unknown sweep key {key!r} (valid: {', '.join(SWEEP_KEYS)})")
            space[SWEEP_KEYS[key]] = values if isinstance(values, list) else [values]
    for key in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"):
        if getattr(args, key):
            space[key] = getattr(args, key)
    from dsplug.ops.aio.perf import parse_bool, parse_size

    def positive(name, value):
        number = parse_size(value) if name == "block_size" else int(value)
        if number <= 0:
            raise ValueError(f"{name} values must be positive, got {value!r}")
        return number

    for key in ("block_size", "queue_depth", "intra_op_parallelism"):
        space[key] = [positive(key, v) for v in space[key]]
    for key in ("single_submit", "overlap_events"):
        space[key] = [parse_bool(v) for v in space[key]]
    return space


def run(args) -> int:
    if args.gpu or args.gds:
        print("dsplug nvme-tune: --gpu/--gds are not supported: dsplug's aio moves host (CPU) tensors only",
              file=sys.stderr)
        return 2
    if args.no_read and args.no_write:
        print("dsplug nvme-tune: --no_read and --no_write leave nothing to measure", file=sys.stderr)
        return 2
    for d in args.nvme_dir:
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            print(f"dsplug nvme-tune: --nvme_dir {d!r} is not a writable directory", file=sys.stderr)
            return 2
    try:
        from dsplug.ops.aio.perf import parse_size, run_sweep, sweep

        space = _space(args)
        io_size = parse_size(args.io_size)
    except (ValueError, OSError) as err:
        print(f"dsplug nvme-tune: {err}", file=sys.stderr)
        return 2
    from dsplug.op_builder import AsyncIOBuilder

    ops = AsyncIOBuilder().load()
    configs = sweep(space)
    dirs = [os.path.abspath(d) for d in args.nvme_dir]
    print(f"Running dsplug NVMe performance tuning on {dirs}: {len(configs)} configurations, "
          f"io_size {io_size} bytes, loops {args.loops}, engine {ops.aio_handle().backend}")

    def report(m):
        if args.verbose:
            r = f"{m.read_gbs:.2f}" if m.read_gbs is not None else "-"
            w = f"{m.write_gbs:.2f}" if m.write_gbs is not None else "-"
            print(f"  read {r:>6} GB/s  write {w:>6} GB/s  {json.dumps(m.config.as_json_block())}")

    started = time.perf_counter()
    try:
        results = run_sweep(ops, configs, dirs, io_size, args.loops, not args.no_read, not args.no_write, report)
    except (OSError, EOFError, ValueError) as err:
        print(f"dsplug nvme-tune: {err}", file=sys.stderr)
        return 1
    best = max(results, key=lambda m: m.score())
    parts = []
    if best.read_gbs is not None:
        parts.append(f"read = {best.read_gbs:.2f}")
    if best.write_gbs is not None:
        parts.append(f"write = {best.write_gbs:.2f}")
    print(f"Best performance (GB/sec): {', '.join(parts)}  (sweep took {time.perf_counter() - started:.1f} s)")
    print(json.dumps({"aio": best.config.as_json_block()}, indent=2))
    return 0


NVME_TUNE = CliCommand(
    name="nvme-tune",
    help="sweep aio_handle settings on a directory and print the best config",
    add_arguments=add_arguments,
    run=run,
    description=__doc__.split("\n\n")[1],
)
