"""Soak: 2 ranks train for a while, saving every few steps with ``checkpoint.keep_last``; resources
must stay flat.

Every ``--report-s`` seconds a row: elapsed time, steps, saves, each rank's resident memory (RSS)
and open file descriptors, the save directory's size on disk and complete tags, and leftover
temporary files (``*.partial`` staging dirs, ``*.tmp-<pid>`` files, ``*.old`` swap dirs) — the
baseline is the first row after warm-up. At the end: the first, last and largest value of each,
the change per hour of RSS and fds (a least-squares slope over the second half), and whether
``dsplug checkpoint verify --all`` passes and an automatic resume loads the newest tag.

    python benchmarks/soak.py --minutes 10
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------ one rank
def job(save_dir: str, status_dir: str, save_every: int, keep_last: int, minutes: float) -> None:
    sys.path.insert(0, REPO)
    import torch

    torch.set_num_threads(1)
    import dsplug

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())],
                                torch.nn.Linear(256, 8))
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 9, "comm_timeout_s": 300,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
              "checkpoint": {"keep_last": keep_last}}
    engine = dsplug.initialize(model=model, config=config)[0]
    g = torch.Generator().manual_seed(rank)
    end = time.time() + minutes * 60
    saves = 0
    while True:  # every rank leaves after the same step: rank 0's clock decides (broadcast at each save)
        x = torch.randn(8, 256, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if engine.global_steps % save_every == 0:
            engine.save_checkpoint(save_dir, client_state={"saves": saves})
            saves += 1
            if rank == 0:
                with open(os.path.join(status_dir, "progress.tmp"), "w") as f:
                    json.dump({"steps": engine.global_steps, "saves": saves}, f)
                os.replace(os.path.join(status_dir, "progress.tmp"), os.path.join(status_dir, "progress.json"))
        if engine.global_steps % save_every == 0:
            flag = torch.tensor([1.0 if time.time() >= end else 0.0])
            dsplug.comm.broadcast(flag, src=0)
            if flag.item():
                break
    engine.destroy()


# ------------------------------------------------------------------------------ the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _fds(pid: int):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _disk(save_dir: str):
    """(MB on disk, complete tags, leftover temporary entries)."""
    total, tags, leftovers = 0, 0, []
    if not os.path.isdir(save_dir):
        return 0.0, 0, []
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.endswith((".partial", ".old")) or ".tmp-" in name:
            leftovers.append(name)
        elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "manifest.json")):
            tags += 1
        for root, _dirs, files in os.walk(path) if os.path.isdir(path) else [(save_dir, [], [name])]:
            for file_name in files:
                try:
                    total += os.lstat(os.path.join(root, file_name)).st_blocks * 512
                except OSError:
                    pass
                if ".tmp-" in file_name and root != save_dir:
                    leftovers.append(os.path.relpath(os.path.join(root, file_name), save_dir))
    return total / 2 ** 20, tags, leftovers


def _slope_per_hour(times, values):
    half = len(times) // 2
    xs, ys = times[half:], values[half:]
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 3600


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--save-every", type=int, default=5, help="steps between saves")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--report-s", type=float, default=30.0)
    args = parser.parse_args()
    if args.job:
        save_dir, status_dir, save_every, keep_last, minutes = args.job
        job(save_dir, status_dir, int(save_every), int(keep_last), float(minutes))
        return 0
    work = tempfile.mkdtemp(prefix="dsplug-soak-")
    save_dir, status_dir = os.path.join(work, "ckpt"), work
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", save_dir, status_dir,
                               str(args.save_every), str(args.keep_last), str(args.minutes)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=open(os.path.join(work, f"rank{r}.log"), "wb"), stderr=subprocess.STDOUT)
             for r in range(2)]
    print(f"soak: 2 ranks, ZeRO stage 2, save every {args.save_every} steps, keep_last {args.keep_last}, "
          f"{args.minutes:g} min; work dir {work}", flush=True)
    print(f"{'min':>5} {'steps':>7} {'saves':>6} {'RSS0 MB':>8} {'RSS1 MB':>8} {'fds0':>5} {'fds1':>5} {'disk MB':>8} "
          f"{'tags':>4} temporary entries (a save in flight has some)", flush=True)
    start = time.time()
    rows = []
    next_report = start + args.report_s
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            if time.time() < next_report:
                continue
            next_report += args.report_s
            try:
                with open(os.path.join(status_dir, "progress.json")) as f:
                    progress = json.load(f)
            except (OSError, ValueError):
                progress = {"steps": 0, "saves": 0}
            rss = [_rss_mb(p.pid) for p in procs]
            fds = [_fds(p.pid) for p in procs]
            disk, tags, leftovers = _disk(save_dir)
            if None in rss or None in fds:
                break
            minutes = (time.time() - start) / 60
            rows.append((minutes, progress["steps"], progress["saves"], rss, fds, disk, tags, leftovers))
            print(f"{minutes:5.1f} {progress['steps']:7d} {progress['saves']:6d} {rss[0]:8.1f} {rss[1]:8.1f} "
                  f"{fds[0]:5d} {fds[1]:5d} {disk:8.1f} {tags:4d} {len(leftovers)}"
                  f"{' ' + ', '.join(leftovers[:3]) if leftovers else ''}", flush=True)
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        codes = [p.wait() for p in procs]
    disk, tags, leftovers = _disk(save_dir)
    print(f"\nranks exited with {codes}; at the end: {disk:.1f} MB on disk, {tags} complete tags, "
          f"leftover temporary files: {leftovers or 'none'}")
    print("from the first save on:")
    rows = [r for r in rows if r[2] > 0]  # from the first save on (start-up excluded)
    if len(rows) >= 2:
        times = [r[0] * 60 for r in rows]
        for label, values in (("RSS rank 0 (MB)", [r[3][0] for r in rows]), ("RSS rank 1 (MB)", [r[3][1] for r in rows]),
                              ("open fds rank 0", [r[4][0] for r in rows]), ("open fds rank 1", [r[4][1] for r in rows]),
                              ("disk (MB)", [r[5] for r in rows])):
            print(f"{label:16} first {values[0]:8.1f}  last {values[-1]:8.1f}  max {max(values):8.1f}  "
                  f"second-half slope {_slope_per_hour(times, values):+8.1f} per hour")
    verify = subprocess.run([sys.executable, "-m", "dsplug.cli", "checkpoint", "verify", save_dir, "--all"],
                            capture_output=True, text=True, env=env)
    print(f"dsplug checkpoint verify --all: exit {verify.returncode}\n{verify.stdout.strip()}")
    resume = subprocess.run([sys.executable, "-c", (
        "import sys, torch, dsplug, dsplug.checkpoint as c\n"
        f"save_dir = {save_dir!r}\n"
        "model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())], "
        "torch.nn.Linear(256, 8))\n"
        "engine = dsplug.initialize(model=model, config={'train_micro_batch_size_per_gpu': 8, 'optimizer': "
        "{'type': 'AdamW', 'params': {'lr': 1e-3}}, 'zero_optimization': {'stage': 2}})[0]\n"
        "path, client = engine.load_checkpoint(save_dir)\n"
        "print('resumed', path, 'at step', engine.global_steps, 'latest', c.read_latest(save_dir))\n")],
        capture_output=True, text=True, env={k: v for k, v in env.items() if k not in ("WORLD_SIZE",)})
    print((resume.stdout + resume.stderr).strip().splitlines()[-1] if (resume.stdout + resume.stderr).strip() else
          f"resume: exit {resume.returncode}")
    good = not any(codes) and verify.returncode == 0 and resume.returncode == 0 and not leftovers
    if good:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work} for a look")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
