"""How long a survivor rank takes to exit after a peer dies (SIGKILL) or stops (SIGSTOP) mid-backward.

For every combination asked for (ZeRO stage x offload x fault x world size x launcher) a fresh job
starts: every rank builds an engine (``comm_timeout_s`` = ``--timeout``), trains a few steps, and the
last rank kills or stops itself from a backward hook of its model's middle layer at step 3, writing
the moment it did so. The table gives, in seconds from that moment, when the first survivor raised
its ``CommError`` (from its log) and when the last survivor process was gone, against the bound
``comm_timeout_s + 5``.

Launchers: ``bare`` (one ``python`` process per rank, the environment set by hand), ``torchrun``
(``python -m torch.distributed.run``) and ``dsplug`` (``dsplug launch --num_procs N``). Under the
two launchers the agent may end the survivors itself once it sees a worker die (kill -9); with a
stopped worker it cannot tell, and the survivors' own exit is what counts.

    python benchmarks/exit_after_fault.py                       # the whole table (~30-60 min on 2 cores)
    python benchmarks/exit_after_fault.py --stages 0,3 --worlds 2 --launchers bare
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIE_STEP = 3


# ------------------------------------------------------------------------------ one rank
def job(out_dir: str, stage: int, offload: bool, signame: str, timeout: float) -> None:
    sys.path.insert(0, REPO)
    import torch

    torch.set_num_threads(1)
    import dsplug
    from tests.engine_common import batch, loss_fn, make_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6, "comm_timeout_s": timeout,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    model = make_model()
    engine = dsplug.initialize(model=model, config=config)[0]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid()}, f)
    victim = world - 1
    state = {"step": 0}

    def die(*_):
        if rank == victim and state["step"] == DIE_STEP:
            with open(os.path.join(out_dir, "fault.json"), "w") as f:
                json.dump({"pid": os.getpid(), "time": time.time()}, f)
            os.kill(os.getpid(), getattr(signal, signame))

    engine.module[2].register_full_backward_hook(die)  # mid-backward: the later layers' gradients are out
    try:
        for step in range(10 ** 6):
            state["step"] = step
            x, y = batch(step, 0, rank, 2)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    except dsplug.comm.CommError:
        print(f"dsplug-fault-seen {time.time():.3f}", flush=True)
        raise  # uncaught, as in a user's script


# ------------------------------------------------------------------------------ the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _start(launcher: str, world: int, args: list, out_dir: str) -> list:
    port = _free_port()
    me = os.path.abspath(__file__)
    log = open(os.path.join(out_dir, "launcher.log"), "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if launcher == "bare":
        procs = []
        for rank in range(world):
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            rank_log = open(os.path.join(out_dir, f"rank{rank}.log"), "wb")
            procs.append(subprocess.Popen([sys.executable, me, "--job", *args], env=rank_env, stdout=rank_log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        return procs
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(port), me, "--job", *args]
    else:
        cmd = [sys.executable, "-m", "dsplug.cli", "launch", "--num_procs", str(world), "--master_port", str(port),
               "--no_local_rank", me, "--job", *args]
    return [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]


def _logs(out_dir: str) -> str:
    text = ""
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".log"):
            with open(os.path.join(out_dir, name), errors="replace") as f:
                text += f.read()
    return text


def trial(launcher: str, world: int, stage: int, offload: bool, signame: str, timeout: float,
          startup_s: float = 300.0) -> dict:
    """One job; times from the fault (seconds)."""
    with tempfile.TemporaryDirectory(prefix="dsplug-exit-") as out_dir:
        args = [out_dir, str(stage), "1" if offload else "0", signame, str(timeout)]
        procs = _start(launcher, world, args, out_dir)
        fault_path = os.path.join(out_dir, "fault.json")
        try:
            deadline = time.time() + startup_s
            fault = None
            while fault is None and time.time() < deadline:
                if os.path.exists(fault_path):
                    try:
                        with open(fault_path) as f:
                            fault = json.load(f)
                    except ValueError:
                        pass
                elif all(p.poll() is not None for p in procs):
                    break
                time.sleep(0.02)
            if fault is None:
                return {"error": "the fault was never reached:\n" + _logs(out_dir)[-3000:]}
            pids = {}
            for rank in range(world - 1):
                with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                    pids[rank] = json.load(f)["pid"]
            limit = fault["time"] + timeout + 60
            exited = {}
            while len(exited) < len(pids) and time.time() < limit:
                for p in procs:
                    p.poll()  # reap bare ranks
                for rank, pid in pids.items():
                    if rank not in exited and _gone(pid):
                        exited[rank] = time.time() - fault["time"]
                time.sleep(0.02)
            seen = _comm_error_time(out_dir, fault["time"])
            return {"survivors_exit_s": max(exited.values()) if len(exited) == len(pids) else None,
                    "comm_error_s": seen, "still_running": sorted(set(pids) - set(exited))}
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.wait()
            try:
                with open(fault_path) as f:
                    os.kill(json.load(f)["pid"], signal.SIGKILL)
            except (OSError, ValueError):
                pass


_STAMP = re.compile(r"dsplug-fault-seen (\d+\.\d+)")


def _comm_error_time(out_dir: str, fault_time: float):
    """Seconds from the fault to the first survivor's CommError (dsplug prints it with a stamp)."""
    stamps = [float(m.group(1)) for m in _STAMP.finditer(_logs(out_dir))]
    return min(stamps) - fault_time if stamps else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--offload", default="off,on", help="off, on or off,on (stages 1-3 only)")
    parser.add_argument("--signals", default="SIGKILL,SIGSTOP")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--launchers", default="bare,torchrun,dsplug")
    parser.add_argument("--timeout", type=float, default=10.0, help="comm_timeout_s of the jobs")
    args, _unknown = parser.parse_known_args()
    if args.job:
        out_dir, stage, offload, signame, timeout = args.job
        job(out_dir, int(stage), offload == "1", signame, float(timeout))
        return 0
    bound = args.timeout + 5
    rows = []
    print(f"comm_timeout_s = {args.timeout:g}; bound = comm_timeout_s + 5 = {bound:g} s; seconds from the fault",
          flush=True)
    print(f"{'launcher':9} {'world':>5} {'stage':>5} {'offload':>7} {'fault':8} {'CommError':>9} {'exit':>6}  within",
          flush=True)
    combos = itertools.product(args.launchers.split(","), map(int, args.worlds.split(",")),
                               map(int, args.stages.split(",")), args.offload.split(","), args.signals.split(","))
    for launcher, world, stage, offload, signame in combos:
        if offload == "on" and stage == 0:
            continue
        got = trial(launcher, world, stage, offload == "on", signame, args.timeout)
        if "error" in got:
            print(f"{launcher:9} {world:5} {stage:5} {offload:>7} {signame:8} failed: {got['error']}", flush=True)
            rows.append(False)
            continue
        exit_s, seen = got["survivors_exit_s"], got["comm_error_s"]
        ok = exit_s is not None and exit_s <= bound
        rows.append(ok)
        print(f"{launcher:9} {world:5} {stage:5} {offload:>7} {signame:8} "
              f"{'-' if seen is None else f'{seen:.1f}':>9} {'>60' if exit_s is None else f'{exit_s:.1f}':>6}  "
              f"{'yes' if ok else 'NO'}", flush=True)
    print(f"{sum(rows)} of {len(rows)} within the bound")
    return 0 if all(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
