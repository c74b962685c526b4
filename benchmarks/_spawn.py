"""Run a benchmark function on N local processes over gloo (127.0.0.1) and collect rank 0's result."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world, port, out, args, threads):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    result = fn(*args)
    if rank == 0:
        torch.save(result, out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run(fn, world: int, *args, threads: int = 1):
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        procs = [ctx.Process(target=_child, args=(fn, r, world, port, out, args, threads)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"benchmark {fn.__name__} failed: exit codes {[p.exitcode for p in procs]}")
        return torch.load(out, weights_only=False)
