"""The multi-node launcher's pieces without a cluster: DeepSpeed's runner classes and the commands
they build, the per-node launcher's arguments, rank discovery under mpirun / srun, the CLI's
``--launcher`` choices and errors, the stdout watchdog and stopping the other nodes after a failure."""
from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from dsplug.cli import main as cli_main
from dsplug.plugins.launcher import LaunchRequest, execute, plan_launch
from dsplug.plugins.launcher import launch as node_launch
from dsplug.plugins.launcher import multinode
from dsplug.plugins.launcher import multinode_runner as mr
from dsplug.plugins.launcher.runner import decode_world_info, encode_world_info


def ds_args(**kw):
    """A ``deepspeed`` command line as DeepSpeed's runner hands it to the runner classes."""
    base = dict(user_script="train.py", user_args=["--deepspeed_config", "ds.json"], launcher_args="", ssh_port=None,
                master_addr="10.0.0.1", master_port=29500, no_python=False, module=False, no_local_rank=False,
                save_pid=False, elastic_training=False, include="", exclude="", num_nodes=-1, num_gpus=-1,
                hostfile="/job/hostfile", launcher="pdsh", min_elastic_nodes=-1, max_elastic_nodes=-1)
    base.update(kw)
    return argparse.Namespace(**base)


POOL = {"worker-0": 2, "worker-1": 2}
ACTIVE = {"worker-0": [0, 1], "worker-1": [0, 1]}
WORLD = encode_world_info(ACTIVE)


# ------------------------------------------------------------------------------ runner classes
def test_pdsh_command_is_deepspeeds_with_dsplugs_node_launcher(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    runner = mr.PDSHRunner(ds_args(launcher_args="-R ssh", ssh_port=2222, save_pid=True,
                                   user_args=["--name", "a b", "$HOME"]), WORLD)
    runner.add_export("PYTHONPATH", str(tmp_path))
    runner.add_export("NCCL_DEBUG", "INFO ")
    cmd, kill, env = runner.get_cmd({"PDSH_SSH_ARGS_APPEND": "-F cfg"}, ACTIVE)
    assert env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-F cfg -p 2222"}
    assert cmd == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh",
                   f"export PYTHONPATH={tmp_path}; export NCCL_DEBUG=INFO; ", f"cd {tmp_path};", sys.executable, "-u",
                   "-m", "dsplug.plugins.launcher.launch", f"--world_info={WORLD}", "--node_rank=%n",
                   "--master_addr=10.0.0.1", "--master_port=29500", "--save_pid", str(os.getpid()),
                   "train.py", "--name", "'a b'", "'$HOME'"]  # fmt: skip
    assert kill[:8] == cmd[:8] and kill[8] == "pkill -f"
    # pdsh joins its words with spaces for the remote shell: the script's arguments arrive unchanged
    remote = " ".join(cmd[8:]).replace("%n", "1")
    assert shlex.split(remote.split(";", 3)[-1])[-3:] == ["--name", "a b", "$HOME"]
    assert runner.name == "pdsh"


def test_pdsh_passes_the_launch_modes_and_elastic_flags():
    cmd, _, _ = mr.PDSHRunner(ds_args(no_python=True, module=True, no_local_rank=True, elastic_training=True,
                                      min_elastic_nodes=1, max_elastic_nodes=3), WORLD).get_cmd({}, ACTIVE)
    i = cmd.index("--master_port=29500")
    assert cmd[i + 1:i + 7] == ["--no_python", "--module", "--no_local_rank", "--enable_elastic_training",
                                "--max_elastic_nodes=3", "--min_elastic_nodes=1"]
    assert "--max_restarts=2" not in cmd and not any(w.startswith("--rdzv_conf") for w in cmd)  # DeepSpeed's, as is
    cmd, _, _ = mr.PDSHRunner(ds_args(elastic_training=True, min_elastic_nodes=1, max_elastic_nodes=2, max_restarts=2,
                                      rdzv_conf="last_call_timeout=3"), WORLD).get_cmd({}, ACTIVE)
    i = cmd.index("--min_elastic_nodes=1")
    assert cmd[i + 1:i + 3] == ["--max_restarts=2", "--rdzv_conf=last_call_timeout=3"]  # dsplug's own flags, when given


def test_openmpi_command():
    runner = mr.OpenMPIRunner(ds_args(launcher="openmpi"), WORLD, POOL)
    runner.add_export("PYTHONPATH", "/w")
    assert runner.get_cmd({}, ACTIVE) == [
        "mpirun", "-n", "4", "-hostfile", "/job/hostfile", "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include",
        "eth0", "-x", "UCX_TLS=tcp", "-x", "PYTHONPATH=/w", sys.executable, "-u", "train.py", "--deepspeed_config",
        "ds.json"]  # fmt: skip
    own = mr.OpenMPIRunner(ds_args(launcher_args="--mca btl_tcp_if_include lo --allow-run-as-root", module=True),
                           WORLD, POOL).get_cmd({}, ACTIVE)
    assert own[8:13] == ["--mca", "btl_tcp_if_include", "lo", "--allow-run-as-root", "-x"]  # no eth0 default then
    assert own[own.index(sys.executable):][:3] == [sys.executable, "-u", "-m"]


@pytest.mark.parametrize("cls", [mr.OpenMPIRunner, mr.MVAPICHRunner, mr.MPICHRunner, mr.IMPIRunner])
@pytest.mark.parametrize("kw", [{"include": "worker-0"}, {"exclude": "worker-1:0"}, {"num_nodes": 1}, {"num_gpus": 1}])
def test_mpi_launchers_take_the_whole_hostfile(cls, kw):
    with pytest.raises(ValueError, match="does not support"):
        cls(ds_args(**kw), WORLD, POOL)


def test_hydra_and_mvapich_commands(monkeypatch, tmp_path):
    monkeypatch.setattr(mr, "MVAPICH_TMP_HOSTFILE", str(tmp_path / "mv_hosts"))
    monkeypatch.setattr(mr, "_device_name", lambda: "cpu")
    mv = mr.MVAPICHRunner(ds_args(), WORLD, POOL).get_cmd({}, ACTIVE)
    assert mv[:7] == ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", str(tmp_path / "mv_hosts")]
    assert (tmp_path / "mv_hosts").read_text() == "worker-0\nworker-1\n"
    assert "MV2_SUPPORT_DL=1" in mv and "MV2_USE_CUDA=1" not in mv
    mpich = mr.MPICHRunner(ds_args(), WORLD, POOL).get_cmd({}, ACTIVE)
    assert mpich[:5] == ["mpirun", "-n", "4", "-ppn", "2"]
    assert mpich[mpich.index("-hosts") + 1] == "worker-0,worker-1"
    assert mpich[mpich.index("MASTER_ADDR") + 1] == "10.0.0.1"
    impi = mr.IMPIRunner(ds_args(), WORLD, POOL).get_cmd({}, ACTIVE)
    sections = " ".join(impi).split(" : ")
    assert len(sections) == 4
    for rank, section in enumerate(sections):
        assert f"-n 1 -env RANK {rank} -env LOCAL_RANK {rank % 2} {sys.executable} -u train.py" in section
    with pytest.raises(ValueError, match=r"same number of devices per node \(hostfile slots: a: 2, b: 1\)"):
        mr.IMPIRunner(ds_args(), WORLD, {"a": 2, "b": 1}).get_cmd({}, ACTIVE)


def test_slurm_command(monkeypatch):
    monkeypatch.setattr(mr, "_device_name", lambda: "cuda")
    runner = mr.SlurmRunner(ds_args(include="worker-0@worker-1", num_nodes=2, num_gpus=8, launcher_args="-p debug",
                                    user_args=['{"a": 1,  "b": true}']), WORLD, POOL)
    runner.add_export("MASTER_ADDR", "10.0.0.1")
    assert runner.get_cmd({}, ACTIVE) == [
        "srun", "-n", "4", "-p", "debug", "--nodelist", "worker-0,worker-1", "--nodes", "2", "--gpus", "8",
        "--export=ALL,MASTER_ADDR=10.0.0.1", sys.executable, "-u", "train.py", '{"a":1,"b":true}']  # fmt: skip
    monkeypatch.setattr(mr, "_device_name", lambda: "cpu")  # on CPU a node's "GPUs" are its processes
    cpu = mr.SlurmRunner(ds_args(num_gpus=2), WORLD, POOL).get_cmd({}, ACTIVE)
    assert cpu[3:5] == ["--ntasks-per-node", "2"]
    with pytest.raises(ValueError, match="not plain JSON"):
        mr.SlurmRunner(ds_args(user_args=["{'a': True}"]), WORLD, POOL)
    with pytest.raises(ValueError, match="Slurm allocates whole nodes"):
        mr.SlurmRunner(ds_args(include="worker-0:0@worker-1"), WORLD, POOL).get_cmd({}, ACTIVE)


def test_runner_classes_at_deepspeeds_import_path():
    import dsplug.launcher.multinode_runner as api

    assert api.PDSHRunner is mr.PDSHRunner and api.SlurmRunner is mr.SlurmRunner
    assert issubclass(api.IMPIRunner, api.MultiNodeRunner)
    import dsplug.launcher.launch as launch_api

    assert launch_api.main is node_launch.main


# ------------------------------------------------------------------------------ the per-node launcher
def test_node_launcher_runs_its_nodes_slots():
    world = encode_world_info({"a": [0, 1, 2], "b": [1, 3]})
    assert decode_world_info(world) == {"a": [0, 1, 2], "b": [1, 3]}
    args = node_launch.parse_args([f"--world_info={world}", "--node_rank=1", "--master_addr=a", "--master_port=7",
                                   "train.py", "--x", "1"])
    assert node_launch.torchrun_argv(args, ["a", "b"], [1, 3]) == [
        "--nnodes", "2", "--node_rank", "1", "--master_addr", "a", "--master_port", "7", "--nproc_per_node", "2",
        "-m", "dsplug.plugins.launcher.shim", "train.py", "--x", "1"]  # fmt: skip
    elastic = node_launch.parse_args([f"--world_info={world}", "--node_rank=0", "--master_addr=a", "--master_port=7",
                                      "--enable_elastic_training", "--min_elastic_nodes=1", "--no_local_rank",
                                      "train.py"])
    assert node_launch.torchrun_argv(elastic, ["a", "b"], [0, 1, 2])[:14] == [
        "--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "a:7", "--rdzv_id", "dsplug-elastic",
        "--max_restarts", "100", "--rdzv_conf", "is_host=1", "--nproc_per_node", "3"]  # fmt: skip
    # node 1 does not host the rendezvous store (told so: on one machine it would also see a loopback
    # MASTER_ADDR as its own), and the user's --rdzv_conf reaches it
    second = node_launch.parse_args([f"--world_info={world}", "--node_rank=1", "--master_addr=a", "--master_port=7",
                                     "--enable_elastic_training", "--rdzv_conf=last_call_timeout=3", "train.py"])
    argv = node_launch.torchrun_argv(second, ["a", "b"], [1, 3])
    assert argv[argv.index("--rdzv_conf") + 1] == "last_call_timeout=3,is_host=0"


def test_node_launcher_rejects_a_rank_outside_the_job(capsys):
    world = base64.urlsafe_b64encode(json.dumps({"a": [0]}).encode()).decode()
    assert node_launch.main([f"--world_info={world}", "--node_rank=3", "train.py"]) == 2
    assert "--node_rank 3 is not a node of the job (1 nodes: a)" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the CLI
@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=2\nnode-2 slots=2\n")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("FROM_CWD=x y\n")
    (home / ".deepspeed_env").write_text("FROM_HOME=1\n")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("UNRELATED", "no")
    return hostfile


def test_cli_pdsh_print_only(two_hosts, capsys, monkeypatch):
    monkeypatch.setattr(multinode.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(mr.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cli_main(["launch", "--hostfile", str(two_hosts), "--master_port", "3456", "--print_only", "--ssh_port",
                     "2200", "train.py", "--lr", "0.1"]) == 0  # no --launcher: pdsh, as it is installed
    words = shlex.split(capsys.readouterr().out)
    assert words[:3] == ["env", "PDSH_RCMD_TYPE=ssh", "PDSH_SSH_ARGS_APPEND=-p 2200"]
    assert words[3:9] == ["pdsh", "-S", "-f", "1024", "-w", "node-1,node-2"]
    exports = words[9]
    for expected in ("export NCCL_SOCKET_IFNAME=eth1;", "export FROM_HOME=1;", "export FROM_CWD='x y';",
                     f"export PYTHONPATH={os.getcwd()}"):
        assert expected in exports, exports
    assert "UNRELATED" not in exports
    assert "--node_rank=%n" in words and words[-3:] == ["train.py", "--lr", "0.1"]


def test_cli_without_pdsh_uses_ssh(two_hosts, capsys, monkeypatch):
    monkeypatch.setattr(multinode.shutil, "which", lambda name: None)
    assert cli_main(["launch", "--hostfile", str(two_hosts), "--print_only", "train.py"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [shlex.split(line)[:2] for line in lines] == [["ssh", "node-1"], ["ssh", "node-2"]]
    assert "DSPLUG_LAUNCH_WATCH_STDOUT=1" in lines[1] and "'DSPLUG_LAUNCH_NODE=node 1 (node-2)'" in lines[1]


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "mpi"], "--launcher 'mpi' is not a launcher dsplug knows; choose one of pdsh, ssh, openmpi"),
    (["--launcher", "openmpi", "--include", "node-1@node-2:0"], "--launcher openmpi: openmpi backend does not support worker "
                                                        "include/exclusion"),
    (["--launcher", "slurm", "--elastic_training"], "--elastic_training needs --launcher pdsh or ssh"),
])
def test_cli_launcher_errors(two_hosts, capsys, argv, message):
    assert cli_main(["launch", "--hostfile", str(two_hosts), *argv, "train.py"]) == 2
    assert message in capsys.readouterr().err


def test_cli_launcher_not_installed(two_hosts, capsys, monkeypatch):
    monkeypatch.setattr(mr.shutil, "which", lambda name: None)
    assert cli_main(["launch", "--hostfile", str(two_hosts), "--launcher", "pdsh", "train.py"]) == 2
    assert ("--launcher pdsh: launcher 'pdsh' not installed (pdsh is not on PATH); install it, or use --launcher ssh"
            in capsys.readouterr().err)


def test_cli_openmpi_and_slurm_export_the_master_address(two_hosts, capsys, monkeypatch):
    monkeypatch.setattr(mr.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert cli_main(["launch", "--hostfile", str(two_hosts), "--launcher", "openmpi", "--print_only",
                     "--master_port", "4000", "t.py"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[:5] == ["mpirun", "-n", "4", "-hostfile", str(two_hosts)]
    assert "MASTER_ADDR=node-1" in words and "MASTER_PORT=4000" in words and "FROM_CWD=x y" in words
    assert cli_main(["launch", "--hostfile", str(two_hosts), "--launcher", "slurm", "--print_only", "t.py"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[:5] == ["env", "SLURM_KILL_BAD_EXIT=1", "srun", "-n", "4"]
    assert words[5].startswith("--export=ALL,") and ",MASTER_ADDR=node-1,MASTER_PORT=29500" in words[5]


def test_deepspeed_command_has_the_multinode_flags():
    from dsplug.plugins.deepspeed_alias.launcher import build_parser

    parser, _command = build_parser()
    args = parser.parse_args(["--hostfile", "h", "--launcher", "OpenMPI", "--launcher_args", "-x A", "--no_ssh_check",
                              "--save_pid", "--ssh_port", "22", "--force_multi", "t.py"])
    assert (args.launcher, args.launcher_args, args.no_ssh_check, args.save_pid) == ("openmpi", "-x A", True, True)


# ------------------------------------------------------------------------------ stopping remote work
WATCHED = (
    "import sys, time, signal\n"
    "from dsplug.plugins.launcher.torchrun import watch_stdout\n"
    "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('stopped'), sys.exit(0)))\n"
    "assert watch_stdout(interval_ms=50) is not None\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_node_stops_when_its_connection_closes(tmp_path):
    """sshd gives a remote command a pipe as stdout; when the connection to the launching machine
    closes, its reader is gone and the node's agent is sent SIGTERM (it then stops its workers)."""
    marker = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-c", WATCHED, str(marker)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        proc.stdout.close()  # the ssh connection closes
        assert proc.wait(timeout=30) == 0
        assert marker.read_text() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_after_a_node_fails_the_others_are_stopped(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n0 slots=1\nn1 slots=1\n")
    request = LaunchRequest(script="s.py", hostfile=str(hostfile), cwd=str(tmp_path), env_files=(),
                            default_hostfile=str(tmp_path / "none"))
    plan = plan_launch(request, environ={})
    procs = []

    def fake_ssh(argv, env, cwd):  # n1 fails at once; n0 would run for a minute
        code = "raise SystemExit(5)" if argv[1] == "n1" else "import time; time.sleep(60)"
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
        return procs[-1]

    start = time.monotonic()
    assert execute(plan, environ={}, popen=fake_ssh, poll_interval=0.01, stop_others_after=0.5) == 5
    assert time.monotonic() - start < 20
    assert procs[0].returncode == -signal.SIGTERM
    err = capsys.readouterr().err
    assert "node 1 (n1) exited with status 5" in err
    assert "stopping node 0 (n0): still running 0.5 s after a node failed" in err


# ------------------------------------------------------------------------------ docs/multi-node.md
def test_the_guides_hostfile_and_command_lines_are_valid():
    """Every ``dsplug launch`` line of docs/multi-node.md parses, and its hostfile example reads; the
    runs themselves are the tests of test_multinode_launch.py."""
    import pathlib
    import re

    from dsplug.plugins.launcher import parse_hostfile_text
    from dsplug.plugins.launcher.runner import parse_args

    guide = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "multi-node.md").read_text()
    hostfile = re.findall(r"```text\n(.*?)```", guide, re.DOTALL)[0]  # the first: the hostfile example
    assert parse_hostfile_text(hostfile) == {"worker-1": 4, "worker-2": 4}
    commands = [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", guide, re.DOTALL)]
    assert len(commands) >= 5
    for command in commands:
        words = shlex.split(command)
        while "=" in words[0]:  # VAR=value prefixes
            words.pop(0)
        assert words[:2] == ["dsplug", "launch"], command
        args = parse_args(words[2:])
        assert args.user_script == "train.py"
        if args.launcher is not None:
            assert args.launcher in multinode.LAUNCHERS
