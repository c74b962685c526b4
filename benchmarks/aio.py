"""aio_handle read / write throughput against `dd` with O_DIRECT, in the same run.

Both sides move the same number of bytes in the same block size, with the page cache bypassed
(dd: iflag=direct / oflag=direct; aio_handle: 4 KiB-aligned locked buffers, so O_DIRECT), no
fsync on either side. The runs are interleaved round by round (alternating which goes first)
because shared virtual disks swing widely from second to second; each ratio is the median of
the per-round ratios, and best / median GB/s are shown.

    python benchmarks/aio.py [--dir DIR] [--size 1G] [--block 1M] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dsplug.op_builder import AsyncIOBuilder
from dsplug.ops.aio.perf import parse_size

DD_TIME = re.compile(r"copied, ([0-9.]+) s")


def dd_seconds(args) -> float:
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    return float(DD_TIME.search(proc.stderr).group(1))


def seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="directory on the storage to measure (default: a temp dir in /tmp)")
    p.add_argument("--size", default="1G")
    p.add_argument("--block", default="1M")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    size, block = parse_size(args.size), parse_size(args.block)
    size = size // block * block
    workdir = tempfile.mkdtemp(prefix="dsplug_aio_bench_", dir=args.dir or "/tmp")
    ops = AsyncIOBuilder().load()
    handles = {
        "aio_handle (defaults: qd 128, 1 thread)": ops.aio_handle(block_size=block),
        "aio_handle (qd 32, 2 threads)": ops.aio_handle(block_size=block, queue_depth=32, intra_op_parallelism=2),
    }
    first = next(iter(handles.values()))
    buf = first.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    buf.zero_()  # dd writes /dev/zero: the same bytes
    dd_file, aio_file = os.path.join(workdir, "dd.bin"), os.path.join(workdir, "aio.bin")
    count = size // block

    def fresh(path):
        if os.path.exists(path):
            os.unlink(path)

    runs = {
        ("dd", "write"): lambda: (fresh(dd_file), dd_seconds(["if=/dev/zero", f"of={dd_file}", f"bs={block}",
                                                              f"count={count}", "oflag=direct"]))[1],
        ("dd", "read"): lambda: dd_seconds([f"if={dd_file}", "of=/dev/null", f"bs={block}", "iflag=direct"]),
    }
    for name, h in handles.items():
        runs[(name, "write")] = lambda h=h: (fresh(aio_file), seconds(lambda: h.sync_pwrite(buf, aio_file)))[1]
        runs[(name, "read")] = lambda h=h: seconds(lambda: h.sync_pread(buf, aio_file))
    times = {key: [] for key in runs}
    order = list(runs)
    for r in range(args.rounds):
        for key in (order if r % 2 == 0 else order[::-1][1::2] + order[::-1][0::2]):  # writes before reads
            times[key].append(runs[key]())
    fresh(dd_file), fresh(aio_file)
    os.rmdir(workdir)

    print(f"aio benchmark: {size / 2**20:.0f} MiB in {block / 2**10:.0f} KiB blocks, {args.rounds} interleaved "
          f"rounds, engine {first.backend}, directory {args.dir or '/tmp'}")
    print(f"{'':42} {'write GB/s best/median':>23} {'vs dd':>6} {'read GB/s best/median':>22} {'vs dd':>6}")
    for name in ["dd"] + list(handles):
        cells = []
        for op in ("write", "read"):
            t = times[(name, op)]
            ratio = statistics.median(d / a for d, a in zip(times[("dd", op)], t))
            cells.append(f"{size / min(t) / 1e9:11.2f} / {size / statistics.median(t) / 1e9:5.2f} {ratio:5.2f}x")
        label = "dd oflag=direct / iflag=direct (baseline)" if name == "dd" else name
        print(f"{label:42} {cells[0]:>30} {cells[1]:>29}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
