"""Transcript of one 2-host run per launcher, next to the single-host run (docs/multi-node.md).

    python benchmarks/multinode_transcript.py [--steps 3] [--only pdsh,ssh,openmpi,slurm]

Starts the same two-"host" cluster the tests use (tests/plugins/launcher/cluster.py: an sshd on
127.0.0.1 / 127.0.0.2, munged + slurmctld + two slurmd), runs the training script of
tests/plugins/launcher/test_multinode_launch.py with each launcher (2 hosts x 2 processes) and with
4 processes on one host, and prints each command, its wall time and the per-rank ZeRO-2 / ZeRO-3
losses. Also times the failure cases. Needs root and the Debian packages .ci/run installs.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import free_port  # noqa: E402
from tests.plugins.launcher.cluster import (DENIED_HOST, REFUSED_HOST, SILENT_HOST, SlurmCluster,  # noqa: E402
                                            SshCluster, wait_no_processes)
from tests.plugins.launcher.test_multinode_launch import TRAIN  # noqa: E402


def run(title, args, cwd, env=None):
    import subprocess

    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    print(f"\n### {title}\n$ {shown + ' ' if shown else ''}dsplug launch {shlex.join(map(str, args))}", flush=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsplug.cli", "launch", *map(str, args)], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True)
    took = time.monotonic() - start
    print(f"exit status {done.returncode} after {took:.1f} s")
    return done, took


def losses(out: Path):
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {r["rank"]: (r["host"], r["losses"]["2"][:-1], r["losses"]["3"][:-1]) for r in ranks}


def table(results):
    names = list(results)
    print("\n| rank | " + " | ".join(f"{n}: host" for n in names) + " | ZeRO-2 losses (all runs) | ZeRO-3 losses (all runs) | equal |")
    print("|---" * (len(names) + 4) + "|")
    for rank in range(4):
        rows = [results[n][rank] for n in names]
        z2 = {tuple(r[1]) for r in rows}
        z3 = {tuple(r[2]) for r in rows}
        fmt = lambda xs: ", ".join(f"{x:.6f}" for x in next(iter(xs)))  # noqa: E731
        print(f"| {rank} | " + " | ".join(r[0] for r in rows) + f" | {fmt(z2)} | {fmt(z3)} | "
              f"{'yes' if len(z2) == len(z3) == 1 else 'NO'} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", default="pdsh,ssh,openmpi,slurm")
    p.add_argument("--failures", action="store_true", help="also time the failure cases")
    opts = p.parse_args()
    wanted = opts.only.split(",")
    root = Path(tempfile.mkdtemp(prefix="dsplug-multinode-"))
    job = root / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN)
    ssh = SshCluster(root / "sshd")
    slurm = SlurmCluster(root / "slurm") if "slurm" in wanted else None
    results = {}
    try:
        hostfile = ssh.hostfile(job / "hostfile")
        steps = ["--steps", opts.steps]
        out = job / "single"
        out.mkdir()
        run("one host, 4 processes", ["--num_procs", 4, "--master_port", free_port(), "train.py", "--out", out, *steps],
            job)
        results["single host"] = losses(out)
        cases = {
            "pdsh": (["--hostfile", hostfile, "--launcher", "pdsh"], ssh.env()),
            "ssh": (["--hostfile", hostfile, "--launcher", "ssh", f"--launcher_args=-F {ssh.config}"], None),
            "openmpi": (["--hostfile", hostfile, "--launcher", "openmpi",
                         f"--launcher_args=--allow-run-as-root --mca plm_rsh_args '-F {ssh.config}' "
                         "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"], None),
        }
        if slurm is not None:
            cases["slurm"] = (["--hostfile", slurm.hostfile(job / "slurm_hosts"), "--launcher", "slurm",
                               "--master_addr", "127.0.0.1"], slurm.env())
        for name, (args, env) in cases.items():
            if name not in wanted:
                continue
            out = job / name
            out.mkdir()
            done, _ = run(f"2 hosts x 2 processes, --launcher {name}",
                          [*args, "--master_port", free_port(), "train.py", "--out", out, *steps], job, env)
            if done.returncode != 0:
                print(done.stderr[-3000:])
                continue
            results[name] = losses(out)
        table(results)
        if opts.failures:
            for launcher in ("pdsh", "ssh"):
                extra = [] if launcher == "pdsh" else [f"--launcher_args=-F {ssh.config}"]
                for bad in (REFUSED_HOST, DENIED_HOST, SILENT_HOST):
                    hf = ssh.hostfile(job / "bad_hosts", hosts=("127.0.0.1", bad), slots=1)
                    done, _ = run(f"{launcher}: host {bad}", ["--hostfile", hf, "--launcher", launcher, *extra,
                                                               "train.py", "--out", job], job, ssh.env())
                    print(done.stderr.strip())
                out = job / f"die-{launcher}"
                out.mkdir()
                done, _ = run(f"{launcher}: rank 3 (on 127.0.0.2) dies at step 2",
                              ["--hostfile", hostfile, "--launcher", launcher, *extra, "--master_port", free_port(),
                               "train.py", "--out", out, "--die_rank", 3], job, ssh.env())
                print("\n".join(l for l in done.stderr.splitlines() if "dsplug launch" in l or "dies now" in l))
                start = time.monotonic()
                left = wait_no_processes(str(job), 30)
                print(f"processes of the job left afterwards: {len(left)} (waited {time.monotonic() - start:.1f} s)")
    finally:
        ssh.stop()
        if slurm is not None:
            slurm.stop()


if __name__ == "__main__":
    main()
