"""Multi-node launches for real: two hosts (127.0.0.1 and 127.0.0.2) reached through an sshd the test
starts, pdsh, plain ssh, OpenMPI's mpirun and Slurm's srun (daemons the tests start), each running
2 hosts x 2 processes of ZeRO-2 and ZeRO-3 training that must equal a 4-process single-host run
step for step; and the failure cases (unreachable host, ssh refusing, a rank dying on the remote
host): a clear error naming the host within a bounded time, exit status non-zero, no process left.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, scaled
from tests.plugins.launcher.cluster import (DENIED_HOST, HOSTS, REFUSED_HOST, SILENT_HOST, SlurmCluster, SshCluster,
                                            need, wait_no_processes)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

TRAIN = textwrap.dedent(
    """
    import argparse, json, os
    import torch
    import dsplug as deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--die_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    losses = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
                  "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": stage}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as a sampler gives
        losses[stage] = []
        for step in range(args.steps):
            if rank == args.die_rank and step == 1:
                print(f"rank {rank} dies now", flush=True)
                os._exit(13)
            x, y = torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[stage].append(loss.item())
        losses[stage].append([p.detach().sum().item() for p in engine.module.parameters()] if stage == 2 else None)
    ssh = (os.environ.get("SSH_CONNECTION") or "").split()
    record = {"rank": rank, "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
              "host": os.environ.get("SLURMD_NODENAME") or (ssh[2] if len(ssh) > 2 else "local"),
              "losses": losses}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    """
)


def launch(args, cwd: Path, env=None, timeout: float = 240):
    """``dsplug launch ARGS`` in a fresh interpreter; (CompletedProcess, seconds)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsplug.cli", "launch", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=scaled(timeout))
    return done, time.monotonic() - start


def read_ranks(out: Path, world: int = 4):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ssh_cluster(tmp_path_factory):
    cluster = SshCluster(tmp_path_factory.mktemp("sshd"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    job = tmp_path_factory.mktemp("job")
    (job / "train.py").write_text(TRAIN)
    return job


@pytest.fixture(scope="module")
def single_host(job_dir):
    """The reference: 4 processes on this host (``dsplug launch --num_procs 4``)."""
    out = job_dir / "single"
    out.mkdir()
    done, _ = launch(["--num_procs", 4, "--master_port", free_port(), "train.py", "--out", out], job_dir)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return read_ranks(out)


def check_equal_to_single_host(out: Path, single_host, host_of_rank):
    ranks = read_ranks(out)
    for rank, (got, want) in enumerate(zip(ranks, single_host)):
        assert got["world"] == 4 and got["local_rank"] == rank % 2
        assert got["host"] == host_of_rank[rank], (rank, got["host"])
        for stage in ("2", "3"):
            assert got["losses"][stage] == want["losses"][stage], (rank, stage)  # step for step, bit for bit
    assert all(len(r["losses"]["2"]) == 4 for r in ranks)  # 3 steps + the final parameters


def _fresh_out(job_dir: Path, name: str) -> Path:
    out = job_dir / name
    out.mkdir()
    return out


def test_pdsh_two_hosts_train_like_one_host(ssh_cluster, job_dir, single_host):
    need("pdsh", package="pdsh")
    out = _fresh_out(job_dir, "pdsh")
    hostfile = ssh_cluster.hostfile(job_dir / "hostfile")
    done, took = launch(["--hostfile", hostfile, "--launcher", "pdsh", "--master_port", free_port(), "train.py",
                         "--out", out], job_dir, env=ssh_cluster.env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    check_equal_to_single_host(out, single_host, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"])
    print(f"pdsh 2x2: {took:.1f} s")


def test_ssh_two_hosts_train_like_one_host(ssh_cluster, job_dir, single_host):
    out = _fresh_out(job_dir, "ssh")
    hostfile = ssh_cluster.hostfile(job_dir / "hostfile")
    done, took = launch(["--hostfile", hostfile, "--launcher", "ssh", f"--launcher_args=-F {ssh_cluster.config}",
                         "--master_port", free_port(), "train.py", "--out", out], job_dir)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    check_equal_to_single_host(out, single_host, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"])
    print(f"ssh 2x2: {took:.1f} s")


def test_openmpi_two_hosts_train_like_one_host(ssh_cluster, job_dir, single_host):
    need("mpirun", "ompi_info", package="openmpi-bin")
    out = _fresh_out(job_dir, "openmpi")
    hostfile = ssh_cluster.hostfile(job_dir / "hostfile")
    launcher_args = (f"--allow-run-as-root --mca plm_rsh_args '-F {ssh_cluster.config}' "
                     "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo")
    done, took = launch(["--hostfile", hostfile, "--launcher", "openmpi", f"--launcher_args={launcher_args}",
                         "--master_port", free_port(), "train.py", "--out", out], job_dir)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    # mpirun starts the ranks on this host itself and on 127.0.0.2 through ssh
    check_equal_to_single_host(out, single_host, ["local", "local", "127.0.0.2", "127.0.0.2"])
    print(f"openmpi 2x2: {took:.1f} s")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def test_slurm_two_nodes_train_like_one_host(slurm_cluster, job_dir, single_host):
    out = _fresh_out(job_dir, "slurm")
    hostfile = slurm_cluster.hostfile(job_dir / "slurm_hosts")
    done, took = launch(["--hostfile", hostfile, "--launcher", "slurm", "--master_addr", "127.0.0.1",
                         "--master_port", free_port(), "train.py", "--out", out], job_dir, env=slurm_cluster.env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    check_equal_to_single_host(out, single_host, ["n1", "n1", "n2", "n2"])
    print(f"slurm 2x2: {took:.1f} s")


# ------------------------------------------------------------------------------ failures
CHECK_BOUND_S = 30  # the ssh check answers within SSH_CHECK_TIMEOUT_S (15 s) + the launcher's start


@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
@pytest.mark.parametrize("bad_host, said", [(REFUSED_HOST, "Connection refused"),
                                            (DENIED_HOST, "Permission denied"),
                                            (SILENT_HOST, "")])
def test_a_host_that_cannot_be_reached_is_named_and_nothing_starts(ssh_cluster, tmp_path, launcher, bad_host, said):
    if launcher == "pdsh":
        need("pdsh", package="pdsh")
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    hostfile = ssh_cluster.hostfile(tmp_path / "hostfile", hosts=(HOSTS[0], bad_host), slots=1)
    args = ["--hostfile", hostfile, "--launcher", launcher, "--master_port", free_port()]
    if launcher == "ssh":
        args.append(f"--launcher_args=-F {ssh_cluster.config}")
    done, took = launch([*args, "train.py"], tmp_path, env=ssh_cluster.env(), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot run commands over {launcher} on host {bad_host}; nothing was started" in done.stderr, done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "started").exists()
    assert took < scaled(CHECK_BOUND_S), took
    assert wait_no_processes(str(tmp_path), 5) == []
    print(f"{launcher} {bad_host}: error after {took:.1f} s")


@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
def test_a_rank_dying_on_the_remote_host_stops_every_host(ssh_cluster, tmp_path, launcher):
    if launcher == "pdsh":
        need("pdsh", package="pdsh")
    (tmp_path / "train.py").write_text(TRAIN)
    out = _fresh_out(tmp_path, "out")
    hostfile = ssh_cluster.hostfile(tmp_path / "hostfile")
    args = ["--hostfile", hostfile, "--launcher", launcher, "--master_port", free_port()]
    if launcher == "ssh":
        args.append(f"--launcher_args=-F {ssh_cluster.config}")
    done, took = launch([*args, "train.py", "--out", out, "--die_rank", 3], tmp_path, env=ssh_cluster.env())
    # 13 (rank 3's status) when its node is the first to end, else the status of node 0's ranks that
    # lost their peer; either way the error names rank 3 on 127.0.0.2
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "node 1 (127.0.0.2): rank 3 (local rank 1) exited with status 13" in done.stderr, done.stderr[-5000:]
    assert "node 1 (127.0.0.2) exited with status 13" in done.stderr
    print(done.stderr[-3000:])
    assert list(out.iterdir()) == []  # nobody finished
    left = wait_no_processes(str(tmp_path), scaled(10))
    assert left == [], left
    print(f"{launcher}: rank 3 on 127.0.0.2 died; launcher exited 13 after {took:.1f} s (incl. start-up)")


HANG = "import os, sys, time\nopen(os.path.join(sys.argv[-1], 'ready-' + os.environ['RANK']), 'w').close()\ntime.sleep(600)\n"


@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
def test_stopping_the_launcher_stops_every_host(ssh_cluster, tmp_path, launcher):
    """Workers that would run for 10 minutes: SIGTERM to `dsplug launch` leaves no process on any host
    (each remote agent sees its ssh connection close and stops its workers)."""
    import signal

    if launcher == "pdsh":
        need("pdsh", package="pdsh")
    (tmp_path / "hang.py").write_text(HANG)
    hostfile = ssh_cluster.hostfile(tmp_path / "hostfile")
    args = ["--hostfile", hostfile, "--launcher", launcher, "--master_port", free_port(), "--no_local_rank"]
    if launcher == "ssh":
        args.append(f"--launcher_args=-F {ssh_cluster.config}")
    env = {**os.environ, **ssh_cluster.env()}
    proc = subprocess.Popen([sys.executable, "-m", "dsplug.cli", "launch", *map(str, args), "hang.py", str(tmp_path)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled(120)
        while not all((tmp_path / f"ready-{r}").exists() for r in range(4)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=scaled(60))
        left = wait_no_processes(str(tmp_path), scaled(20))
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err
    assert left == [], left
    print(f"{launcher}: SIGTERM to the launcher; every process on both hosts gone after {took:.1f} s")


def _processes_of_host(address: str, marker: str):
    """pids of the processes that sshd started for ``address`` (SSH_CONNECTION names it as the server
    address) and whose command line mentions ``marker``: that "host"'s agent, torchrun and workers."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        conn = next((e.decode().split("=", 1)[1].split() for e in environ if e.startswith(b"SSH_CONNECTION=")), [])
        if len(conn) > 2 and conn[2] == address and marker in cmdline:
            pids.append(int(pid))
    return pids


def test_elastic_job_across_hosts_survives_losing_a_host(ssh_cluster, tmp_path):
    """``--elastic_training`` over pdsh: one elastic agent per host (1 worker each); every process of
    host 127.0.0.2 is killed mid-run (as when the machine is lost). The agent on 127.0.0.1, which hosts
    the rendezvous store, restarts its worker at world size 1; it resumes from the checkpoint written at
    world size 2 and ends with plain PyTorch's weights; the launcher reports the lost host and exits 0."""
    import signal

    from tests.plugins.elasticity.test_elasticity_launch import CONFIG, SCRIPT, STEPS, _records, \
        check_resumed_at_world_one

    need("pdsh", package="pdsh")
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    record = tmp_path / "log.jsonl"
    hostfile = ssh_cluster.hostfile(tmp_path / "hostfile", slots=1)
    args = ["--hostfile", hostfile, "--launcher", "pdsh", "--elastic_training", "--min_elastic_nodes", "1",
            "--max_elastic_nodes", "2", "--max_restarts", "2",
            "--rdzv_conf", "keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=3",
            "--master_port", free_port(), "train.py", "--config", "ds.json", "--ckpt", tmp_path / "ckpt",
            "--record", record, "--steps", STEPS, "--pace", "0.3"]
    env = {**os.environ, **ssh_cluster.env()}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen([sys.executable, "-m", "dsplug.cli", "launch", *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled(150)
        while sum(1 for r in _records(record) if r["event"] == "step" and r["world"] == 2) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        lost = _processes_of_host("127.0.0.2", "dsplug")
        assert lost
        for pid in lost:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _out, err = proc.communicate(timeout=scaled(150))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-5000:]
    assert "node 1 (127.0.0.2) exited with status" in err, err[-5000:]
    check_resumed_at_world_one(record)
    assert wait_no_processes(str(tmp_path), scaled(10)) == []
    print(err[-1500:])
