"""``dsplug launch --elastic_training``: the torchrun command it builds, its flag checks, and a real
elastic job on 127.0.0.1 that loses one of its two nodes mid-training and finishes on the other,
resumed from the checkpoint at world size 1 with the elastic batch sizes of one worker."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dsplug.plugins.launcher import LaunchError
from dsplug.plugins.launcher.elastic import elastic_plan
from dsplug.plugins.launcher.plan import LaunchRequest, plan_launch
from dsplug.plugins.launcher.runner import parse_args

from tests.conftest import REPO, Deadline, free_port, scaled


def planned(*argv, environ=None, hostfile=None):
    args = parse_args([*argv, "train.py", "--x", "1"])
    request = LaunchRequest(script=args.user_script, script_args=tuple(args.user_args), hostfile=hostfile,
                            procs_per_node=args.num_procs, master_addr=args.master_addr,
                            master_port=args.master_port or 29500, python="python", cwd="/w",
                            default_hostfile="/nonexistent")
    return elastic_plan(plan_launch(request, environ={}), request, args, environ=environ or {})


def test_elastic_command_line():
    plan = planned("--elastic_training", "--num_procs", "2", "--max_elastic_nodes", "3", "--master_addr", "10.0.0.1",
                   "--master_port", "29611", "--rdzv_conf", "last_call_timeout=5, is_host=1",
                   environ={"ELASTIC_RUN_ID": "job-7"})
    (node,) = plan.nodes
    assert list(node.argv) == [
        "python", "-u", "-m", "dsplug.plugins.launcher.torchrun", "--nnodes", "1:3", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "10.0.0.1:29611", "--rdzv_id", "job-7", "--max_restarts", "100",
        "--rdzv_conf", "last_call_timeout=5,is_host=1", "--nproc_per_node", "2",
        "-m", "dsplug.plugins.launcher.shim", "train.py", "--x", "1"]
    assert "--node_rank" not in node.argv  # the rendezvous assigns ranks
    assert node.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a node joining a running job needs it
    kept = planned("--elastic_training", "--num_procs", "1", environ={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert kept.nodes[0].env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}  # the user's choice stays
    default = planned("--elastic_training", "--num_procs", "1", "--max_restarts", "0").nodes[0].argv
    assert default[4:14] == ("--nnodes", "1:1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29500",
                             "--rdzv_id", "dsplug-elastic", "--max_restarts", "0")
    static = planned("--num_procs", "1").nodes[0].argv  # without the flag nothing changes
    assert "--rdzv_backend" not in static and "--node_rank" in static


def test_elastic_multi_node_plan(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    plan = planned("--elastic_training", "--min_elastic_nodes", "1", "--max_elastic_nodes", "4", hostfile=str(hosts))
    assert [n.host for n in plan.nodes] == ["worker-0", "worker-1"] and all(n.remote for n in plan.nodes)
    for node in plan.nodes:
        assert node.argv[4:10] == ("--nnodes", "1:4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "worker-0:29500")
        assert "'--nnodes' 1:4" in node.display() or "--nnodes 1:4" in node.display()
    # MASTER_ADDR is worker-0 (the first host): its agent hosts the rendezvous store, told so explicitly
    confs = [n.argv[n.argv.index("--rdzv_conf") + 1] for n in plan.nodes]
    assert confs == ["is_host=1", "is_host=0"]
    plan = planned("--elastic_training", "--rdzv_conf", "last_call_timeout=3", "--master_addr", "worker-1",
                   hostfile=str(hosts))
    assert [n.argv[n.argv.index("--rdzv_conf") + 1] for n in plan.nodes] == [
        "last_call_timeout=3,is_host=0", "last_call_timeout=3,is_host=1"]
    plan = planned("--elastic_training", "--rdzv_conf", "is_host=1", hostfile=str(hosts))  # the user's word wins
    assert [n.argv[n.argv.index("--rdzv_conf") + 1] for n in plan.nodes] == ["is_host=1", "is_host=1"]
    plan = planned("--elastic_training", "--master_addr", "10.0.0.9", hostfile=str(hosts))  # not a host: torch decides
    assert all("--rdzv_conf" not in n.argv for n in plan.nodes)
    with pytest.raises(LaunchError, match="--max_elastic_nodes 1 is less than the 2 nodes being launched"):
        planned("--elastic_training", "--max_elastic_nodes", "1", hostfile=str(hosts))


@pytest.mark.parametrize("argv, words", [
    (["--min_elastic_nodes", "2"], "--min_elastic_nodes applies only with --elastic_training"),
    (["--max_restarts", "3", "--rdzv_conf", "is_host=1"], "--max_restarts, --rdzv_conf apply only with"),
    (["--elastic_training", "--min_elastic_nodes", "3", "--max_elastic_nodes", "2"],
     "--min_elastic_nodes 3 is greater than --max_elastic_nodes 2"),
    (["--elastic_training", "--min_elastic_nodes", "0"], "must be positive"),
    (["--elastic_training", "--max_restarts", "-1"], "--max_restarts must be >= 0"),
    (["--elastic_training", "--rdzv_conf", "join_timout=5"], "unknown key 'join_timout'; valid keys: join_timeout"),
    (["--elastic_training", "--rdzv_conf", "join_timeout"], "'join_timeout' is not KEY=VALUE"),
    (["--elastic_training", "--rdzv_conf", "join_timeout=5;rm"], "is not a plain number or word"),
])
def test_elastic_flag_errors(argv, words):
    with pytest.raises(LaunchError) as err:
        planned("--num_procs", "1", *argv)
    assert words in str(err.value)


def test_run_id_is_checked():
    with pytest.raises(LaunchError, match="ELASTIC_RUN_ID='a b'"):
        planned("--elastic_training", "--num_procs", "1", environ={"ELASTIC_RUN_ID": "a b"})


def test_script_options_are_not_torchrun_abbreviations(monkeypatch):
    """``--log`` after the script is the script's (torchrun's parser used to refuse it as an
    ambiguous abbreviation of --log-dir / --logs-specs, failing any launch of such a script)."""
    from torch.distributed import run as torch_run

    from dsplug.plugins.launcher import torchrun

    seen = []
    monkeypatch.setattr(torch_run, "run", seen.append)
    assert torchrun.main(["--nnodes", "1:2", "--rdzv_backend", "c10d", "--nproc_per_node", "1", "-m",
                          "dsplug.plugins.launcher.shim", "train.py", "--log", "x", "--nnodes", "7"]) == 0
    (args,) = seen
    assert args.nnodes == "1:2" and args.training_script == "dsplug.plugins.launcher.shim"
    assert args.training_script_args == ["train.py", "--log", "x", "--nnodes", "7"]


# ------------------------------------------------------------------------ a real elastic job, 2 -> 1 nodes
SCRIPT = textwrap.dedent(
    """
    import argparse, json, os, time
    import torch
    import dsplug

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--config", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--pace", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=args.config)
    path, _ = engine.load_checkpoint(args.ckpt)
    rank, world = dsplug.comm.get_rank(), dsplug.comm.get_world_size()
    tb, mb = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()

    def record(**fields):
        fields.update(rank=rank, world=world, tb=tb, mb=mb, gas=gas,
                      restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        with open(args.record, "a") as f:
            f.write(json.dumps(fields) + "\\n")

    record(event="start", loaded=engine.global_steps if path is not None else None)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    while engine.global_steps < args.steps:
        x = torch.randn(tb, 4, generator=torch.Generator().manual_seed(engine.global_steps))
        y = x @ w
        for micro in range(gas):
            lo = (rank * gas + micro) * mb  # this rank's share of the same global batch at any world size
            engine.backward(torch.nn.functional.mse_loss(engine(x[lo:lo + mb]), y[lo:lo + mb]))
            engine.step()
        engine.save_checkpoint(args.ckpt)
        if rank == 0:
            record(event="step", step=engine.global_steps)
        time.sleep(args.pace)  # time for the test to take a node away
    if rank == 0:
        torch.save([t.detach().clone() for t in engine.module.parameters()], args.record + ".params.pt")
        record(event="done", step=engine.global_steps)
    """
)
ELASTIC = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3], "min_gpus": 1, "max_gpus": 2,
           "version": 0.1}
CONFIG = {"elasticity": ELASTIC, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 2}, "comm_timeout_s": 30, "steps_per_print": 1000,
          "checkpoint": {"keep_last": 2}}
STEPS = 10


def _children():
    """{pid: [child pids]} of every process on this machine (from /proc)."""
    tree = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


def _process_tree(pid):
    """``pid`` and all its descendants (the agent, its torchrun in its own session, the workers)."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def _kill_tree(pid):
    for p in _process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait(what, condition, timeout, procs=()):
    deadline = Deadline(timeout)
    while not deadline.expired():
        if condition():
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"timed out / an agent ended while waiting for {what}")


def check_resumed_at_world_one(record):
    """The records of :data:`SCRIPT` show steps at world size 2, then a restart at world size 1 that
    resumed from a checkpoint written at 2 (elastic batch sizes of one worker) and finished the run
    with the weights plain PyTorch gives for the same batches."""
    from dsplug.elasticity import compute_elastic_config

    records = _records(record)
    two = [r for r in records if r["world"] == 2]
    assert two
    one = records[records.index(two[-1]) + 1:]  # after the node was lost (a slow second agent may also have
    assert one and all(r["world"] == 1 for r in one)  # made the job start at 1 and grow to 2 before that)
    final = compute_elastic_config({"elasticity": ELASTIC}, "0.14.0", world_size=1)
    assert {(r["tb"], r["mb"], r["gas"]) for r in two} == {(12, 3, 2)}  # by hand: 12 / 2 ranks = 6 = 3 × 2
    assert {(r["tb"], r["mb"], r["gas"]) for r in one} == {(12, 3, 4)} == {(final[0], final[2], 12 // final[2])}
    start = next(r for r in one if r["event"] == "start")
    last_saved_at_two = max(r["step"] for r in two if r["event"] == "step")
    assert start["restart"] >= 1 and start["loaded"] is not None and 2 <= start["loaded"] <= last_saved_at_two
    steps = [r["step"] for r in one if r["event"] == "step"]
    assert steps == list(range(start["loaded"] + 1, STEPS + 1))  # resumed, not restarted from 0
    assert one[-1]["event"] == "done" and one[-1]["step"] == STEPS

    # the same run in plain PyTorch: one full batch per step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for step in range(STEPS):
        x = torch.randn(12, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x @ w).backward()
        opt.step()
    for got, want in zip(torch.load(f"{record}.params.pt"), model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_elastic_job_survives_losing_a_node(tmp_path):
    """Two agents (one worker each) rendezvous as nodes of a 1:2 job; the second is killed (agent,
    torchrun and worker, as when a machine is lost). The first restarts its worker at world size 1,
    which resumes from the ZeRO-2 checkpoint written at world size 2 with the elastic batch sizes of
    one worker, and the run ends with the same weights as plain PyTorch on the same batches."""
    script, config = tmp_path / "train.py", tmp_path / "ds.json"
    script.write_text(SCRIPT)
    config.write_text(json.dumps(CONFIG))
    record = tmp_path / "log.jsonl"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)

    def agent(name, host):
        argv = [sys.executable, "-m", "dsplug.cli", "launch", "--elastic_training", "--min_elastic_nodes", "1",
                "--max_elastic_nodes", "2", "--num_procs", "1", "--master_addr", "127.0.0.1",
                "--master_port", str(port),
                "--max_restarts", "2", "--rdzv_conf",
                f"keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=3,is_host={host}",
                str(script), "--config", str(config), "--ckpt", str(tmp_path / "ckpt"), "--record", str(record),
                "--steps", str(STEPS), "--pace", "0.3"]
        out = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)

    survivor = agent("a", 1)  # hosts the rendezvous store: it must be the node that stays
    lost = agent("b", 0)
    try:
        _wait("two world-size-2 steps", lambda: sum(1 for r in _records(record)
                                                     if r["event"] == "step" and r["world"] == 2) >= 2,
              timeout=90, procs=(survivor, lost))
        _kill_tree(lost.pid)
        lost.wait(timeout=scaled(10))
        assert survivor.wait(timeout=scaled(90)) == 0
    except BaseException:
        logs = "\n".join(f"--- {n}\n" + (tmp_path / f"{n}.log").read_text()[-3000:] for n in ("a", "b"))
        raise AssertionError(f"elastic job failed; records: {_records(record)}\n{logs}")
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:  # never signal a pid already reaped (it may be reused)
                _kill_tree(proc.pid)  # nothing of this test outlives it
                proc.wait(timeout=scaled(10))

    check_resumed_at_world_one(record)
