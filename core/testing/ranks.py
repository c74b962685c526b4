"""Run a function on N real ranks that talk over gloo on 127.0.0.1, and collect what each returns.

For authors of plugins whose behaviour is multi-process (a ZeRO stage, a comm-heavy optimizer)::

    from dsplug.testing import run_ranks

    def train_two_ranks(steps):                      # module level: the ranks import it by name
        engine = dsplug.testing.tiny_engine({"zero_optimization": {"stage": "fsdp2"}})
        return dsplug.testing.train_steps(engine, steps)

    losses = run_ranks(train_two_ranks, 2, 3)          # [rank 0's losses, rank 1's losses]

Each rank is a fresh process, forked from a ``multiprocessing`` forkserver that has imported torch
once (a rank starts in milliseconds instead of importing torch again; spawned where there is no
forkserver); it imports ``fn``'s module, so ``fn`` must be a module-level function and its
arguments picklable. A rank gets the caller's current environment plus what torch's launcher
sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``; ``dsplug.initialize`` (or ``dsplug.comm.init_distributed``) inside ``fn`` joins
the group with gloo on CPU. The results come back through ``torch.save`` (tensors, dicts, lists,
numbers), in rank order. A rank that raises fails the call with that rank's traceback; ranks
still running after ``timeout`` seconds are killed and named (``timeout`` is multiplied by
``DSPLUG_TEST_TIMEOUT_SCALE`` when that is set, for slow or loaded machines).
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List

#: a number >= 1 that stretches every timeout of this harness (dsplug's own test suite sets it)
TIMEOUT_SCALE_ENV = "DSPLUG_TEST_TIMEOUT_SCALE"


class RankFailed(RuntimeError):
    """A rank of :func:`run_ranks` raised, died or did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_process_context() -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context rank processes start from: a forkserver that imports torch
    once, so that a rank does not pay torch's import (seconds on a small machine) again -- nor
    ``torch._dynamo``'s, which torch's optimizers import when the first one is built. The
    forkserver's environment is the one it started with: a rank sets the caller's
    (:func:`enter_rank_environment`). Where there is no forkserver (Windows), ranks are spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo"])
    return context


def enter_rank_environment(environment: dict, rank: int, world_size: int, port: int) -> None:
    """In a rank process: the caller's environment, then the variables torch's launcher sets."""
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def rank_main(fn, rank: int, world_size: int, port: int, out_path: str, args, environment) -> None:
    """A rank process's body: enter the environment, run ``fn(*args)``, save ``{"ok", "result"}``
    or ``{"ok": False, "error": traceback}`` to ``out_path``, leave the process group."""
    import torch

    enter_rank_environment(environment, rank, world_size, port)
    torch.set_num_threads(1)
    try:
        torch.save({"ok": True, "result": fn(*args)}, out_path)
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        torch.save({"ok": False, "error": traceback.format_exc()}, out_path)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _scale() -> float:
    try:
        return max(1.0, float(os.environ.get(TIMEOUT_SCALE_ENV) or 1.0))
    except ValueError:
        return 1.0


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 300.0) -> List[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``, each rank in its own process."""
    import torch

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size!r}; give a positive number of ranks")
    if getattr(fn, "__qualname__", "").count("<locals>") or getattr(fn, "__name__", "") == "<lambda>":
        raise ValueError(f"run_ranks: {fn!r} is not a module-level function; the ranks import it by name")
    context = rank_process_context()
    module = sys.modules.get(getattr(fn, "__module__", ""))
    folder = os.path.dirname(os.path.abspath(getattr(module, "__file__", "") or ""))
    added = bool(folder) and folder not in sys.path  # (a rank gets sys.path: it finds fn's module)
    if added:
        sys.path.append(folder)
    port = free_port()
    try:
        with tempfile.TemporaryDirectory(prefix="dsplug-ranks-") as tmp:
            paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
            environment = dict(os.environ)
            procs = [context.Process(target=rank_main, args=(fn, r, world_size, port, paths[r], args, environment))
                     for r in range(world_size)]
            for p in procs:
                p.start()
            limit = timeout * _scale()
            deadline = time.monotonic() + limit
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            outcomes = [torch.load(path, weights_only=False) if os.path.exists(path) else None for path in paths]
    finally:
        if added:
            sys.path.remove(folder)
    name = getattr(fn, "__name__", repr(fn))
    for r, out in enumerate(outcomes):
        if out is not None and not out["ok"]:
            waiting = f" (ranks {hung} were still running and were killed)" if hung else ""
            raise RankFailed(f"rank {r} of {world_size} failed in {name}{waiting}:\n{out['error']}")
    if hung:
        raise RankFailed(f"ranks {hung} of {world_size} did not finish {name} within {limit:g} s "
                         f"({TIMEOUT_SCALE_ENV} stretches it)")
    for r, out in enumerate(outcomes):
        if out is None:
            raise RankFailed(f"rank {r} of {world_size} died in {name} without a result "
                             f"(exit code {procs[r].exitcode})")
    return [out["result"] for out in outcomes]
