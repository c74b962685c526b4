"""Run a function in N real processes that talk over gloo on 127.0.0.1.

``run_distributed(fn, world_size, *args)`` returns the list of ``fn(*args)`` results by rank
(results must be picklable by torch.save). ``fn`` must be importable (module level). Each
process gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT like torch's launcher
sets them; a failure in any rank raises with that rank's traceback.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

from dsplug.testing.ranks import rank_main, rank_process_context

from .conftest import REPO, TIMEOUT_SCALE_ENV, Deadline, free_port, timeout_factor


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0):
    """``timeout``: seconds of a quiet machine for all ranks to finish; it stretches with the
    machine's speed and load (:class:`tests.conftest.Deadline`)."""
    ctx = rank_process_context()
    # children unpickle ``fn`` from the ``tests`` package: make sure its root is on the path they copy
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        environment = dict(os.environ)
        procs = [ctx.Process(target=rank_main, args=(fn, r, world_size, port, paths[r], args, environment))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = Deadline(timeout)
        while any(p.is_alive() for p in procs) and not deadline.expired():
            time.sleep(deadline.slice(0.2))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            failed = [r for r, path in enumerate(paths) if os.path.exists(path)
                      and not torch.load(path, weights_only=False)["ok"]]
            if failed:  # the others were waiting for it
                out = torch.load(paths[failed[0]], weights_only=False)
                raise RuntimeError(f"rank {failed[0]} of {fn.__name__} failed (ranks {hung} were still running and "
                                   f"were killed):\n{out['error']}")
            raise TimeoutError(f"ranks {hung} of {fn.__name__} did not finish within {timeout:g} s of a quiet machine "
                               f"({deadline.used:.0f} s counted; load factor now {timeout_factor():.1f}, "
                               f"{TIMEOUT_SCALE_ENV}={os.environ.get(TIMEOUT_SCALE_ENV)})")
        results = []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} of {fn.__name__} died without a result (exit code {procs[r].exitcode})")
            out = torch.load(path, weights_only=False)
            if not out["ok"]:
                raise RuntimeError(f"rank {r} of {fn.__name__} failed:\n{out['error']}")
            results.append(out["result"])
        return results


# ------------------------------------------------------------------------------ separate rank processes
_LAUNCH = ("import importlib, json, sys; sys.path.insert(0, sys.argv[1]); import torch; torch.set_num_threads(1); "
           "module, function = sys.argv[2].split(':'); "
           "getattr(importlib.import_module(module), function)(*json.loads(sys.argv[3]))")


def launch_ranks(target: str, world_size: int, *args, out_dir, env=None):
    """Start ``target`` (``"module:function"``, called with the JSON-able ``args``) in
    ``world_size`` separate processes with the environment ``run_distributed`` gives, and return
    their ``subprocess.Popen`` objects at once, so that a test can signal, time and reap each rank
    itself. Rank r's stdout and stderr go to ``out_dir/rank<r>.log``."""
    import json
    import subprocess

    port = free_port()
    procs = []
    for rank in range(world_size):
        child_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                     "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "PYTHONUNBUFFERED": "1"}
        with open(os.path.join(out_dir, f"rank{rank}.log"), "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", _LAUNCH, str(REPO), target, json.dumps(list(args))],
                                          env=child_env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def rank_log(out_dir, rank: int) -> str:
    with open(os.path.join(out_dir, f"rank{rank}.log"), encoding="utf-8", errors="replace") as f:
        return f.read()
