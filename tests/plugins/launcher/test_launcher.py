"""`dsplug launch`: hostfiles, include/exclude, command construction and quoting, real launches."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsplug.cli import main as cli_main
from dsplug.plugins.launcher import (
    HostfileError,
    execute,
    LaunchError,
    LaunchRequest,
    limit_resources,
    parse_hostfile_text,
    parse_resource_spec,
    plan_launch,
    read_hostfile,
    select_resources,
)
from dsplug.plugins.launcher import shim
from dsplug.plugins.launcher.envfile import parse_env_text
from dsplug.plugins.launcher.plan import exit_status
from tests.conftest import free_port
from tests.conftest import scaled

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


# ----------------------------------------------------------------------------- hostfiles


def test_hostfile_comments_blank_lines_and_order(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(
        "# cluster A\n\nworker-1 slots=8   # the big one\n\t node.example.com\tslots=2\n"
        "10.0.0.7 slots=1\n   \n# trailing comment\n"
    )
    pool = read_hostfile(str(path))
    assert pool == {"worker-1": 8, "node.example.com": 2, "10.0.0.7": 1}
    assert list(pool) == ["worker-1", "node.example.com", "10.0.0.7"]


@pytest.mark.parametrize(
    "text, lineno, fragments",
    [
        ("a slots=1\nworker-0 slots=0\n", 2, ["slots='0'", "'worker-0'", "not a positive integer"]),
        ("worker-0 slots=four\n", 1, ["slots='four'", "not a positive integer"]),
        ("worker-0 slots=-2\n", 1, ["slots='-2'"]),
        ("# hosts\nworker-0\n", 2, ["'worker-0'", "expected '<hostname> slots=<N>'"]),
        ("worker-0 slots=2 max_slots=4\n", 1, ["'worker-0 slots=2 max_slots=4'"]),
        ("worker-0 gpus=2\n", 1, ["'worker-0 gpus=2'"]),
        ("x slots=1\n\nevil;rm slots=1\n", 3, ["invalid host name 'evil;rm'"]),
        ("$(reboot) slots=1\n", 1, ["invalid host name '$(reboot)'"]),
        ("-oProxyCommand=sh slots=1\n", 1, ["invalid host name '-oProxyCommand=sh'"]),
        ("worker-0 slots=2\nworker-1 slots=2\nworker-0 slots=4\n", 3, ["'worker-0' is listed again (first on line 1)"]),
        # absurd values: a clear error with the value and the bound, never an OverflowError
        ("a slots=1\nworker-0 slots=%d\n" % 10**30, 2, ["slots='1000000000000000000000000000000'", "'worker-0'",
                                                        "at most 4096"]),
        ("worker-0 slots=4097\n", 1, ["slots='4097'", "at most 4096"]),
        ("worker-0 slots=" + "9" * 5000 + "\n", 1, ["(5000 characters)", "at most 4096"]),
        ("worker-0 slots=\n", 1, ["slots=''", "not a positive integer"]),
        ("worker-0 slots=١٢\n", 1, ["slots='١٢'", "not a positive integer"]),  # non-ASCII digits
        ("h" * 254 + " slots=1\n", 1, ["(254 characters) is longer than 253 characters"]),
    ],
)
def test_bad_hostfile_names_file_line_and_text(tmp_path, text, lineno, fragments):
    path = tmp_path / "my_hosts"
    path.write_text(text)
    with pytest.raises(HostfileError) as info:
        read_hostfile(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:{lineno}:"), message
    for fragment in fragments:
        assert fragment in message, message


def test_largest_slot_count_is_accepted_and_absurd_ones_never_reach_a_range(tmp_path):
    from dsplug.plugins.launcher.hostfile import MAX_SLOTS

    assert parse_hostfile_text(f"w slots={MAX_SLOTS}\nv slots=0007\n") == {"w": MAX_SLOTS, "v": 7}
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"w slots={10**30}\n")
    with pytest.raises(LaunchError, match=rf"^{hostfile}:1: slots='1{'0' * 30}' for host 'w' is more than"):
        plan_launch(_request(tmp_path, script="s.py", hostfile=str(hostfile)))
    for procs in (MAX_SLOTS + 1, 10**30):
        with pytest.raises(LaunchError, match=rf"--num_gpus/--num_procs .* is more processes than a node can run "
                                              rf"\(at most {MAX_SLOTS}\)"):
            plan_launch(_request(tmp_path, script="s.py", procs_per_node=procs))
    with pytest.raises(LaunchError, match=rf"slot 99999999...99999999 \(30 digits\) of host 'w' is out of range "
                                          rf"\(slots are numbered 0..{MAX_SLOTS - 1} at most\)"):
        parse_resource_spec("w:1,0@w:" + "9" * 30)


def test_cli_reports_an_absurd_hostfile_value_without_a_traceback(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# big\nworker-0 slots=%d\n" % 10**30)
    assert cli_main(["launch", "--hostfile", str(hostfile), "--print_only", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"{hostfile}:2: slots='{10**30}' for host 'worker-0'" in err and "Traceback" not in err
    assert cli_main(["launch", "--num_procs", str(10**30), "--print_only", "train.py"]) == 2
    assert "is more processes than a node can run" in capsys.readouterr().err


def test_empty_or_missing_hostfile(tmp_path):
    path = tmp_path / "empty"
    path.write_text("# nothing here\n\n")
    with pytest.raises(HostfileError, match=rf"^{path}: lists no hosts"):
        read_hostfile(str(path))
    with pytest.raises(HostfileError, match=r"does not exist") as info:
        read_hostfile(str(tmp_path / "absent"))
    assert str(tmp_path / "absent") in str(info.value)


HOSTNAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,15}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(
    pool=st.dictionaries(HOSTNAMES, st.integers(1, 64), min_size=1, max_size=6),
    comments=st.lists(st.sampled_from(["", "# note", "   ", "#slots=3"]), max_size=4),
)
def test_hostfile_round_trip(pool, comments):
    lines = list(comments) + [f"{host} slots={n}" for host, n in pool.items()]
    parsed = parse_hostfile_text("\n".join(lines), "gen")
    assert parsed == pool and list(parsed) == list(pool)


# ----------------------------------------------------------------------------- include / exclude


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        ("worker-2@worker-0:3", "", {"worker-0": [3], "worker-2": [0, 1]}),  # hostfile order kept
        ("worker-1:2@worker-1:0,2", "", {"worker-1": [0, 2]}),  # repeated host: merged
        ("", "worker-1:0", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3], "worker-2": [0, 1]}),
        ("", "worker-0@worker-2:1", {"worker-1": [0, 1, 2, 3], "worker-2": [0]}),
        ("", "worker-2:0,1", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),  # emptied host dropped
    ],
)
def test_include_exclude(include, exclude, expected):
    result = select_resources(POOL, include, exclude, "hostfile 'hosts'")
    assert result == expected and list(result) == list(expected)


def _model(pool, include, exclude):
    """Independent reference: resources as a set of (host, slot) pairs."""
    every = {(h, s) for h, n in pool.items() for s in range(n)}
    spec = include or exclude
    named = set()
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        named |= {(host, int(s)) for s in slots.split(",")} if slots else {(host, s) for s in range(pool[host])}
    kept = named if include else every - named
    return {h: sorted(s for hh, s in kept if hh == h) for h in pool if any(hh == h for hh, _ in kept)}


@st.composite
def _filters(draw):
    items = []
    for _ in range(draw(st.integers(1, 4))):
        host = draw(st.sampled_from(list(POOL)))
        if draw(st.booleans()):
            items.append(host)
        else:
            slots = draw(st.lists(st.integers(0, POOL[host] - 1), min_size=1, max_size=4))
            items.append(f"{host}:{','.join(map(str, slots))}")
    return "@".join(items), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(_filters())
def test_filter_matches_set_model(spec_and_kind):
    spec, is_include = spec_and_kind
    include, exclude = (spec, "") if is_include else ("", spec)
    expected = _model(POOL, include, exclude)
    if not expected:
        with pytest.raises(LaunchError, match="leaves no slots"):
            select_resources(POOL, include, exclude)
    else:
        assert select_resources(POOL, include, exclude) == expected


@pytest.mark.parametrize("flag", ["include", "exclude"])
def test_unknown_host_or_slot(flag):
    with pytest.raises(LaunchError) as info:
        select_resources(POOL, **{flag: "worker-0@worker-7:1"}, source="hostfile 'hosts'")
    message = str(info.value)
    assert f"--{flag} 'worker-0@worker-7:1' names host 'worker-7'" in message
    assert "hostfile 'hosts' does not list (hosts: worker-0, worker-1, worker-2)" in message

    with pytest.raises(LaunchError) as info:
        select_resources(POOL, **{flag: "worker-2:0,2"}, source="hostfile 'hosts'")
    message = str(info.value)
    assert "names slot 2 of host 'worker-2', which has slots 0..1 (slots=2 in hostfile 'hosts')" in message


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("worker-0:", "slot '' of host 'worker-0'"),
        ("worker-0:1,x", "slot 'x' of host 'worker-0'"),
        ("worker-0:1:2", "slot '1:2'"),
        ("worker-0:-1", "slot '-1'"),
        ("@worker-0", "names no host"),
        ("worker 0", "invalid host name 'worker 0'"),
        ("", "--include is empty"),
    ],
)
def test_filter_syntax_errors(spec, fragment):
    with pytest.raises(LaunchError) as info:
        parse_resource_spec(spec, "--include")
    assert fragment in str(info.value)
    assert "e.g. 'worker-0@worker-1:0,2'" in str(info.value) or "invalid host name" in str(info.value)


def test_include_and_exclude_together_is_an_error():
    with pytest.raises(LaunchError, match="mutually exclusive"):
        select_resources(POOL, include="worker-0", exclude="worker-1")


def test_num_nodes_and_procs_per_node():
    full = select_resources(POOL)
    assert limit_resources(full, num_nodes=2) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert limit_resources(full, procs_per_node=3) == {h: [0, 1, 2] for h in POOL}
    assert limit_resources(full, 1, 2) == {"worker-0": [0, 1]}
    with pytest.raises(LaunchError, match=r"--num_nodes 4 asks for more nodes than hosts provides \(3: worker-0"):
        limit_resources(full, num_nodes=4, source="hosts")


# ----------------------------------------------------------------------------- planning


def _request(tmp_path, **kw):
    kw.setdefault("default_hostfile", str(tmp_path / "no-such-hostfile"))
    kw.setdefault("env_files", ())
    kw.setdefault("python", "/opt/py/bin/python")
    kw.setdefault("cwd", "/work dir")
    return LaunchRequest(**kw)


def test_single_node_plan_is_local_torchrun(tmp_path):
    plan = plan_launch(_request(tmp_path, script="train.py", script_args=("--lr", "0.1"), procs_per_node=2,
                                master_port=1234), environ={})
    assert not plan.multi_node and plan.resources == {"localhost": [0, 1]}
    (node,) = plan.nodes
    assert node.process_argv() == [
        "/opt/py/bin/python", "-u", "-m", "dsplug.plugins.launcher.torchrun",
        "--nnodes", "1", "--nproc_per_node", "2", "--node_rank", "0",
        "--master_addr", "127.0.0.1", "--master_port", "1234",
        "-m", "dsplug.plugins.launcher.shim", "train.py", "--lr", "0.1",
    ]  # fmt: skip
    assert node.env == {}


@pytest.mark.parametrize(
    "flags, tail",
    [
        ({"local_rank_arg": False}, ["s.py", "a"]),
        ({"local_rank_arg": False, "module": True}, ["-m", "s.py", "a"]),
        ({"local_rank_arg": False, "no_python": True}, ["--no-python", "s.py", "a"]),
        ({"module": True}, ["-m", "dsplug.plugins.launcher.shim", "--module", "s.py", "a"]),
        ({"no_python": True}, ["-m", "dsplug.plugins.launcher.shim", "--no_python", "s.py", "a"]),
    ],
)
def test_worker_target_modes(tmp_path, flags, tail):
    (node,) = plan_launch(_request(tmp_path, script="s.py", script_args=("a",), **flags), environ={}).nodes
    assert list(node.argv[node.argv.index("29500") + 1 :]) == tail


def test_local_slot_subset_sets_visible_devices(tmp_path):
    plan = plan_launch(_request(tmp_path, script="s.py", include="localhost:1,3", local_devices=4), environ={})
    (node,) = plan.nodes
    assert node.env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert node.argv[node.argv.index("--nproc_per_node") + 1] == "2"
    assert node.display().startswith("env CUDA_VISIBLE_DEVICES=1,3 /opt/py/bin/python")
    with pytest.raises(LaunchError, match=r"names slot 1 of host 'localhost'.*this machine"):
        plan_launch(_request(tmp_path, script="s.py", include="localhost:1", local_devices=1), environ={})


def test_device_probes_are_asked_only_when_needed(tmp_path):
    def must_not_run():
        raise AssertionError("probed although --num_procs was given")

    plan = plan_launch(_request(tmp_path, script="s.py", procs_per_node=3, local_devices=must_not_run,
                                visible_devices_env=must_not_run), environ={})  # fmt: skip
    assert plan.resources == {"localhost": [0, 1, 2]}
    plan = plan_launch(_request(tmp_path, script="s.py", include="localhost:2", local_devices=lambda: 4,
                                visible_devices_env=lambda: "XPU_VISIBLE"), environ={})  # fmt: skip
    assert plan.nodes[0].env == {"XPU_VISIBLE": "2"}


def test_option_conflicts_and_missing_hostfile(tmp_path):
    with pytest.raises(LaunchError, match="cannot be combined with --include/--exclude"):
        plan_launch(_request(tmp_path, script="s.py", include="localhost", procs_per_node=2), environ={})
    with pytest.raises(LaunchError, match=r"--num_nodes 2 needs a hostfile"):
        plan_launch(_request(tmp_path, script="s.py", num_nodes=2), environ={})
    with pytest.raises(HostfileError, match="does not exist"):
        plan_launch(_request(tmp_path, script="s.py", hostfile=str(tmp_path / "nope")), environ={})
    with pytest.raises(LaunchError, match="--master_addr 'a b'"):
        plan_launch(_request(tmp_path, script="s.py", master_addr="a b"), environ={})


def test_default_hostfile_is_used_when_present(tmp_path):
    default = tmp_path / "job_hostfile"
    default.write_text("node-a slots=2\nnode-b slots=3\n")
    plan = plan_launch(_request(tmp_path, script="s.py", default_hostfile=str(default)), environ={})
    assert plan.multi_node and plan.master_addr == "node-a"
    assert [(n.host, n.node_rank, n.slots, n.remote) for n in plan.nodes] == [
        ("node-a", 0, (0, 1), True),
        ("node-b", 1, (0, 1, 2), True),
    ]
    # nodes of different sizes: each node runs its own slot count
    assert [n.argv[n.argv.index("--nproc_per_node") + 1] for n in plan.nodes] == ["2", "3"]


def test_single_host_hostfile_runs_locally_unless_forced(tmp_path):
    hostfile = tmp_path / "h"
    hostfile.write_text("gpu-box slots=2\n")
    (node,) = plan_launch(_request(tmp_path, script="s.py", hostfile=str(hostfile)), environ={}).nodes
    assert not node.remote and node.process_argv()[0] == "/opt/py/bin/python"
    (node,) = plan_launch(
        _request(tmp_path, script="s.py", hostfile=str(hostfile), force_multi=True, ssh_port=2222), environ={}
    ).nodes
    assert node.process_argv()[:4] == ["ssh", "-p", "2222", "gpu-box"]


HOSTILE_ARGS = ("--name", "x'; touch PWNED_ARG; echo '", "$(touch PWNED_SUB)", "`touch PWNED_BT`", "a b", "")


def test_multi_node_commands_quote_everything(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=4\nnode-2 slots=4\n")
    envfile = tmp_path / ".deepspeed_env"
    envfile.write_text("# exported to every node\nFOO=bar; touch PWNED_ENVFILE\n")
    cwd = "/data/it's $(here)"
    environ = {"NCCL_DEBUG": "INFO && touch PWNED_NCCL", "HOME": "/root", "PYTHONPATH": "/extra"}
    plan = plan_launch(
        _request(tmp_path, script="my script.py", script_args=HOSTILE_ARGS, hostfile=str(hostfile),
                 include="node-1:1,2@node-2", master_port=2900, cwd=cwd, env_files=(str(envfile),)),
        environ=environ,
    )  # fmt: skip
    assert plan.master_addr == "node-1"
    for node, slots in zip(plan.nodes, [(1, 2), (0, 1, 2, 3)]):
        assert node.slots == slots
        line = node.display()
        ssh_argv = shlex.split(line)
        assert ssh_argv == ["ssh", node.host, node.remote_shell_command()]
        expected_env = ["NCCL_DEBUG=INFO && touch PWNED_NCCL", f"PYTHONPATH={cwd}:/extra", "FOO=bar; touch PWNED_ENVFILE"]
        if slots == (1, 2):
            expected_env.append("CUDA_VISIBLE_DEVICES=1,2")
        assert shlex.split(ssh_argv[-1]) == [
            "cd", cwd, "&&", "env", *expected_env,
            "/opt/py/bin/python", "-u", "-m", "dsplug.plugins.launcher.torchrun",
            "--nnodes", "2", "--nproc_per_node", str(len(slots)), "--node_rank", str(node.node_rank),
            "--master_addr", "node-1", "--master_port", "2900",
            "-m", "dsplug.plugins.launcher.shim", "my script.py", *HOSTILE_ARGS,
        ]  # fmt: skip


def test_remote_command_survives_a_real_shell(tmp_path):
    """Run the remote command string through /bin/sh with a stand-in 'python' that records what it got."""
    record = tmp_path / "record.json"
    fake_python = tmp_path / "fake python"
    fake_python.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    fake_python.chmod(0o755)
    workdir = tmp_path / "it's a $(dir)"
    workdir.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=1\nnode-2 slots=1\n")
    plan = plan_launch(
        _request(tmp_path, script="run.py", script_args=HOSTILE_ARGS, hostfile=str(hostfile), python=str(fake_python),
                 cwd=str(workdir)),
        environ={"NCCL_SOCKET_IFNAME": "eth0; touch PWNED_NCCL"},
    )  # fmt: skip
    node = plan.nodes[1]
    subprocess.run(["sh", "-c", node.remote_shell_command()], check=True, cwd=tmp_path, timeout=scaled(30))
    got = json.loads(record.read_text())
    assert got["argv"] == list(node.argv[1:])
    assert got["argv"][-len(HOSTILE_ARGS) :] == list(HOSTILE_ARGS)
    assert got["cwd"] == str(workdir)
    assert got["env"]["NCCL_SOCKET_IFNAME"] == "eth0; touch PWNED_NCCL"
    assert not list(tmp_path.rglob("PWNED*")) and not list(workdir.rglob("PWNED*"))


def test_env_file_parsing():
    assert parse_env_text("# c\n\nA=1\nB = x=y \n", "f") == {"A": "1", "B": "x=y"}
    with pytest.raises(LaunchError, match=r"^f:2: cannot read 'JUSTTEXT'; expected KEY=VALUE"):
        parse_env_text("A=1\nJUSTTEXT\n", "f")
    with pytest.raises(LaunchError, match=r"^f:1: 'A B' is not a valid environment variable name"):
        parse_env_text("A B=1\n", "f")


# ----------------------------------------------------------------------------- the CLI


def test_cli_print_only_multi_node(tmp_path, monkeypatch, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=2\nnode-2 slots=2\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\n")
    workdir = tmp_path / "job dir"
    workdir.mkdir()
    (workdir / ".deepspeed_env").write_text("FROM_CWD=it's\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(workdir)
    code = cli_main(["launch", "--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "1", "--print_only",
                     "--launcher", "ssh", "--master_port", "3456", "train.py", "--deepspeed_config", "a b.json"])  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        ssh, host, remote = shlex.split(line)
        assert (ssh, host) == ("ssh", f"node-{rank + 1}")
        words = shlex.split(remote)
        assert words[:3] == ["cd", str(workdir), "&&"]
        assert "FROM_HOME=1" in words and "FROM_CWD=it's" in words
        assert words[words.index("--node_rank") + 1] == str(rank)
        assert words[-3:] == ["train.py", "--deepspeed_config", "a b.json"]


def test_cli_no_hostfile_plans_this_machine_even_with_a_default_hostfile(tmp_path, monkeypatch, capsys):
    import dsplug.plugins.launcher as launcher

    default = tmp_path / "job_hostfile"
    default.write_text("node-a slots=2\nnode-b slots=3\n")
    requests = []

    def planned(request, **kw):  # the CLI's request, planned as if /job/hostfile were `default`
        requests.append(request)
        moved = LaunchRequest(**{**request.__dict__, "default_hostfile": request.default_hostfile and str(default)})
        return plan_launch(moved, **kw)

    monkeypatch.setattr(launcher, "plan_launch", planned)
    assert cli_main(["launch", "--num_procs", "2", "--no_hostfile", "--print_only", "t.py"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    words = shlex.split(line)
    assert words[0] != "ssh" and words[words.index("--nproc_per_node") + 1] == "2"
    assert words[words.index("--master_addr") + 1] == "127.0.0.1"
    assert requests[-1].default_hostfile == ""
    assert cli_main(["launch", "--num_procs", "2", "--print_only", "--launcher", "ssh", "t.py"]) == 0  # the hostfile's
    assert [shlex.split(l)[:2] for l in capsys.readouterr().out.strip().splitlines()] == [["ssh", "node-a"],
                                                                                         ["ssh", "node-b"]]
    with pytest.raises(SystemExit):  # one or the other
        cli_main(["launch", "--no_hostfile", "--hostfile", str(default), "t.py"])


def test_cli_rejects_bad_hostfile_before_starting(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=2\nnode;2 slots=2\n")
    code = cli_main(["launch", "--hostfile", str(hostfile), "train.py"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{hostfile}:2: invalid host name 'node;2'" in err
    code = cli_main(["launch", "--hostfile", str(hostfile).replace("hosts", "h2"), "--include", "x", "train.py"])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_cli_unknown_include_host(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=2\n")
    assert cli_main(["launch", "-H", str(hostfile), "-i", "node-9:0", "--print_only", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "--include 'node-9:0' names host 'node-9'" in err and str(hostfile) in err


# ----------------------------------------------------------------------------- shim and exit codes


def test_shim_inserts_local_rank_before_script_args(tmp_path, monkeypatch):
    out = tmp_path / "argv.json"
    script = tmp_path / "s.py"
    script.write_text(f"import json, sys\njson.dump([__name__, sys.argv, sys.path[0]], open({str(out)!r}, 'w'))\n")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert shim.main([str(script), "--x", "1"]) == 0
    assert json.loads(out.read_text()) == ["__main__", [str(script), "--local_rank=3", "--x", "1"], str(tmp_path)]

    (tmp_path / "mod_target.py").write_text(script.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    assert shim.main(["--module", "mod_target", "y"]) == 0
    name, argv, _ = json.loads(out.read_text())
    assert name == "__main__" and argv[1:] == ["--local_rank=3", "y"]
    sys.modules.pop("mod_target", None)

    monkeypatch.delenv("LOCAL_RANK")
    assert shim.main([str(script)]) == 2


def test_exit_status_mapping():
    assert [exit_status(c) for c in (0, 3, -9, -15, 300)] == [0, 3, 137, 143, 1]


def test_execute_waits_for_all_nodes_and_reports_the_failure(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n0 slots=1\nn1 slots=1\nn2 slots=1\n")
    plan = plan_launch(_request(tmp_path, script="s.py", hostfile=str(hostfile), cwd=str(tmp_path)), environ={})
    codes = {"n0": 0, "n1": 3, "n2": 0}
    started = []

    def fake_ssh(argv, env, cwd):  # stands in for ssh: a real process exiting with the node's code
        started.append(argv[1])
        marker = tmp_path / f"done-{argv[1]}"
        return subprocess.Popen([sys.executable, "-c", f"open({str(marker)!r}, 'w'); raise SystemExit({codes[argv[1]]})"])

    assert execute(plan, environ={}, popen=fake_ssh, poll_interval=0.01) == 3
    assert started == ["n0", "n1", "n2"]
    assert all((tmp_path / f"done-{h}").exists() for h in codes)  # every node was waited for
    assert "node 1 (n1) exited with status 3" in capsys.readouterr().err


def _launch(args, cwd, timeout=120):
    """Run ``dsplug launch ARGS`` as a user would (a fresh interpreter); returns CompletedProcess."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "dsplug.cli", "launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=scaled(timeout))  # fmt: skip


@pytest.fixture
def dsplug_launch(tmp_path):
    """``dsplug_launch(script_path, *script_args, procs=2)`` runs a real local launch on a free port."""

    def launch(script, *script_args, procs=2, extra=()):
        args = ["--num_procs", str(procs), "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra]
        return _launch([*args, str(script), *map(str, script_args)], cwd=tmp_path)

    return launch


WORKER = textwrap.dedent(
    """
    import argparse, json, os, sys
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", required=True)
    args = parser.parse_args()
    assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    record = {"rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank_arg": args.local_rank,
              "sum": value.item(), "tag": args.tag, "env": env}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_two_process_launch(tmp_path, dsplug_launch):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    result = dsplug_launch(script, "--out", out, "--tag", "it's a $(tag)", procs=2)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    port = records[0]["env"]["MASTER_PORT"]
    for rank, rec in enumerate(records):
        assert rec["rank"] == rank and rec["world"] == 2
        assert rec["sum"] == sum(range(2))
        assert rec["local_rank_arg"] == rank
        assert rec["tag"] == "it's a $(tag)"
        assert rec["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip


@pytest.mark.multiprocess
def test_child_exit_code_propagates_and_no_local_rank(tmp_path, dsplug_launch):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['--x'], sys.argv\nsys.exit(7)\n")
    result = dsplug_launch(script, "--x", procs=1, extra=["--no_local_rank"])
    assert result.returncode == 7, result.stdout + result.stderr
    assert "exited with status 7" in result.stderr


@pytest.mark.multiprocess
def test_a_config_error_is_one_line_per_rank_and_exit_1(tmp_path, dsplug_launch):
    script = tmp_path / "bad_config.py"
    script.write_text("import sys, torch, dsplug\nmodel = torch.nn.Linear(2, 2)\n"
                      "dsplug.initialize(model=model, model_parameters=model.parameters(), config=sys.argv[-1])\n")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 2, "fp16": {"enabld": True}, "zero_optimization": {"stage": 9}}))
    result = dsplug_launch(script, config, procs=2)
    assert result.returncode == 1, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    expected = (f"invalid dsplug config ({config}): 2 errors: fp16.enabld: unknown key; did you mean 'fp16.enabled'?; "
                "zero_optimization.stage: zero_stage '9': no zero_stage plugin named '9' is installed. "
                "Installed zero_stage plugins: 0, 1, 2, 3.")
    lines = sorted(line for line in output.splitlines() if line.startswith("dsplug launch: rank"))
    # a rank killed by torchrun after the other failed may not get to print its line
    assert lines in ([f"dsplug launch: rank 0: {expected}", f"dsplug launch: rank 1: {expected}"],
                     [f"dsplug launch: rank 0: {expected}"], [f"dsplug launch: rank 1: {expected}"]), output


def test_shim_reports_a_config_error_in_one_line(tmp_path, monkeypatch, capsys):
    script = tmp_path / "bad.py"
    script.write_text("import dsplug\ndsplug.DsplugConfig({'train_batch_size': 2, 'fp16': {'enabled': 'yes'}})\n")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert shim.main([str(script)]) == 1
    assert capsys.readouterr().err == ("dsplug launch: rank 3: invalid dsplug config (dict): fp16.enabled: 'yes' is "
                                       "not valid: expected a boolean\n")
    script.write_text("raise ValueError('not a config error')\n")
    with pytest.raises(ValueError, match="not a config error"):
        shim.main([str(script)])


SIGINT_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    out = sys.argv[-1]
    got = []
    signal.signal(signal.SIGINT, lambda *_: got.append(time.time()))
    open(os.path.join(out, "ready-" + os.environ["RANK"]), "w").close()
    deadline = time.time() + float(sys.argv[-2])
    while not got and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # "saving": any further SIGINT arrives meanwhile
    with open(os.path.join(out, "got-" + os.environ["RANK"]), "w") as f:
        f.write(str(len(got)))
    sys.exit(130 if got else 3)
    """
)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_reaches_every_worker_exactly_once_and_they_may_finish(tmp_path):
    import signal
    import time

    script = tmp_path / "worker.py"
    script.write_text(SIGINT_WORKER)
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.Popen([sys.executable, "-m", "dsplug.cli", "launch", "--num_procs", "2", "--master_port",
                             str(free_port()), "--no_local_rank", str(script), str(scaled(60)), str(tmp_path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + scaled(90)
        while not all((tmp_path / f"ready-{r}").exists() for r in range(2)):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=scaled(90))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out + err
    assert [(tmp_path / f"got-{r}").read_text() for r in range(2)] == ["1", "1"]  # each worker: once, and it finished
    assert "got SIGINT: passed it on to the workers" in err and "exited with status" not in err
