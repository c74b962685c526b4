"""Timing of aio_handle reads and writes (shared by ``dsplug nvme-tune`` and benchmarks/aio.py)."""
from __future__ import annotations

import itertools
import os
import re
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text) -> int:
    """'64M' -> 67108864; plain integers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)i?b?\s*", str(text).lower())
    if not match:
        raise ValueError(f"invalid size {text!r} (examples: 4096, 256K, 1M, 1G)")
    return int(match.group(1)) * SIZE_UNITS[match.group(2)]


def parse_bool(text) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"invalid boolean {text!r} (use true or false)")


@dataclass(frozen=True)
class AioSetting:
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool

    def as_json_block(self) -> dict:
        """The ``"aio"`` section of a DeepSpeed config for this configuration."""
        return {"single_submit": self.single_submit, "overlap_events": self.overlap_events,
                "intra_op_parallelism": self.intra_op_parallelism, "queue_depth": self.queue_depth,
                "block_size": self.block_size}


def sweep(space: Dict[str, Sequence]) -> List[AioSetting]:
    keys = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")
    return [AioSetting(*values) for values in itertools.product(*(space[k] for k in keys))]


@dataclass
class Measurement:
    config: AioSetting
    read_gbs: Optional[float] = None
    write_gbs: Optional[float] = None

    def score(self) -> float:
        """Harmonic mean of the measured directions (a config must be good at both)."""
        rates = [r for r in (self.read_gbs, self.write_gbs) if r is not None]
        return len(rates) / sum(1.0 / r for r in rates) if rates and all(rates) else 0.0


def measure(ops, config: AioSetting, dirs: Sequence[str], io_size: int, loops: int = 1, read: bool = True,
            write: bool = True, buffer=None) -> Measurement:
    """Best-of-``loops`` GB/s of writing then reading ``io_size`` bytes split evenly over ``dirs``
    (one file per directory, all requests in flight together) with 4 KiB-aligned buffers."""
    import torch

    handle = ops.aio_handle(config.block_size, config.queue_depth, config.single_submit, config.overlap_events,
                            config.intra_op_parallelism)
    per_dir = io_size // len(dirs) // 4096 * 4096
    if per_dir <= 0:
        raise ValueError(f"io_size {io_size} is too small for {len(dirs)} directories (need >= 4 KiB each)")
    if buffer is None:
        buffer = handle.new_cpu_locked_tensor(per_dir * len(dirs), torch.empty(0, dtype=torch.uint8))
        buffer.random_(0, 256)
    parts = [buffer[i * per_dir:(i + 1) * per_dir] for i in range(len(dirs))]
    files = [os.path.join(d, f"_dsplug_aio_tune_{os.getpid()}.bin") for d in dirs]
    total = per_dir * len(dirs)
    result = Measurement(config)
    try:
        for _ in range(max(1, loops)):
            if write or read:  # reads need the files; time the write only when asked
                started = time.perf_counter()
                for part, path in zip(parts, files):
                    handle.async_pwrite(part, path)
                handle.wait()
                rate = total / (time.perf_counter() - started) / 1e9
                if write:
                    result.write_gbs = max(result.write_gbs or 0.0, rate)
            if read:
                started = time.perf_counter()
                for part, path in zip(parts, files):
                    handle.async_pread(part, path)
                handle.wait()
                rate = total / (time.perf_counter() - started) / 1e9
                result.read_gbs = max(result.read_gbs or 0.0, rate)
    finally:
        for path in files:
            try:
                os.unlink(path)
            except OSError:
                pass
    return result


def run_sweep(ops, configs: Iterable[AioSetting], dirs, io_size, loops=1, read=True, write=True, on_result=None):
    import torch

    probe = ops.aio_handle()
    per_dir = io_size // len(dirs) // 4096 * 4096
    buffer = probe.new_cpu_locked_tensor(per_dir * len(dirs), torch.empty(0, dtype=torch.uint8))
    buffer.random_(0, 256)
    results = []
    for config in configs:
        m = measure(ops, config, dirs, io_size, loops, read, write, buffer=buffer)
        results.append(m)
        if on_result:
            on_result(m)
    probe.free_cpu_locked_tensor(buffer)
    return results
