"""Running a multi-node launch through the cluster's own launcher (``--launcher``).

``ssh``    (dsplug) one ``ssh HOST 'cd CWD && env ... torchrun ...'`` per node, from this process;
``pdsh``   (DeepSpeed's default) one pdsh command; each host runs :mod:`.launch` (``--node_rank=%n``);
``openmpi`` / ``mvapich`` / ``mpich`` / ``impi``  ``mpirun`` starts every rank of the script;
``slurm``  ``srun`` starts every rank of the script in the Slurm allocation.

Without ``--launcher``, pdsh is used when it is installed, else ssh. The commands come from the
runner classes of :mod:`.multinode_runner`. Before pdsh / ssh launches, every host is checked over
the same transport (``--no_ssh_check`` skips it), so an unreachable host or one whose ssh refuses
is reported by name within :data:`SSH_CHECK_TIMEOUT_S` seconds and nothing is started. When one
node fails, the others get :data:`STOP_GRACE_S` seconds to end, then their connections are closed
and each node stops its workers (no process is left on any host). MPI and Slurm end the job
themselves when a rank fails (``mpirun``; ``srun`` with ``SLURM_KILL_BAD_EXIT=1``, set here unless
the environment sets it).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Dict, List, Mapping, Optional, Tuple

from . import multinode_runner as runners
from .envfile import default_env_files, remote_exports
from .errors import LaunchError
from .runner import encode_world_info
from .torchrun import NODE_ENV, WATCH_ENV

SSH = "ssh"
PDSH = "pdsh"
MPI_LAUNCHERS = ("openmpi", "mvapich", "mpich", "impi")
SLURM = "slurm"
LAUNCHERS = (PDSH, SSH, *MPI_LAUNCHERS, SLURM)
RUNNER_CLASSES = {PDSH: runners.PDSHRunner, "openmpi": runners.OpenMPIRunner, "mvapich": runners.MVAPICHRunner,
                  "mpich": runners.MPICHRunner, "impi": runners.IMPIRunner, SLURM: runners.SlurmRunner}
#: what each launcher needs on PATH, for the "not installed" message
PROGRAMS = {PDSH: "pdsh", SSH: "ssh", "openmpi": "ompi_info (package openmpi-bin)",
            "mvapich": "mpiname (MVAPICH2-GDR)", "mpich": "mpirun", "impi": "mpirun", SLURM: "sinfo (package slurm-client)"}
#: seconds a host may take to answer the ssh check (connect + run ``true``)
SSH_CHECK_TIMEOUT_S = 15
#: seconds the other nodes get to end on their own after one failed, before they are stopped
STOP_GRACE_S = 5.0
#: pdsh's line for a host whose remote command (or ssh itself) failed
_PDSH_EXIT = re.compile(r"^pdsh@[^:]*: (\S+): ssh exited with exit code (\d+)")
#: DeepSpeed leaves these out of the exports when the job runs on AISC (it sets its own)
EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}


def choose_launcher(name: Optional[str]) -> str:
    """The launcher to use: ``name``, or pdsh when installed, else ssh."""
    if name is None:
        return PDSH if shutil.which("pdsh") else SSH
    name = name.lower()
    if name not in LAUNCHERS:
        raise LaunchError(f"--launcher {name!r} is not a launcher dsplug knows; choose one of {', '.join(LAUNCHERS)}")
    return name


def deepspeed_args(args: argparse.Namespace, plan, hostfile: Optional[str]) -> argparse.Namespace:
    """``args`` with DeepSpeed's names and "not given" values, as the runner classes read them."""
    ns = argparse.Namespace(**vars(args))
    ns.master_addr, ns.master_port = plan.master_addr, plan.master_port
    ns.hostfile = hostfile
    ns.num_nodes = -1 if args.num_nodes is None else args.num_nodes
    procs = args.num_gpus if args.num_gpus is not None else getattr(args, "num_procs", None)
    ns.num_gpus = -1 if procs is None else procs
    ns.launcher_args = getattr(args, "launcher_args", "") or ""
    return ns


def job_exports(environ: Mapping[str, str], cwd: str, env_files=None) -> Dict[str, str]:
    """The variables every rank gets: DeepSpeed's prefixes from this environment, ``PYTHONPATH``
    with the working directory first, then ``~/.deepspeed_env`` and ``./.deepspeed_env``."""
    files = env_files if env_files is not None else default_env_files(environ, cwd)
    exports = remote_exports(environ, cwd, files)
    for marker, names in EXCLUDE_ENVS.items():
        if marker in environ:
            for key in names:
                if environ.get(key) == exports.get(key):
                    exports.pop(key, None)
    return exports


def build_command(launcher: str, args, plan, hostfile: Optional[str], environ: Mapping[str, str],
                  env_files=None) -> Tuple[List[str], Dict[str, str]]:
    """``(argv, environment)`` of the pdsh / mpirun / srun process that starts the whole job."""
    ds_args = deepspeed_args(args, plan, hostfile)
    world_info = encode_world_info({host: list(slots) for host, slots in plan.resources.items()})
    cls = RUNNER_CLASSES[launcher]
    pool = {host: len(slots) for host, slots in plan.resources.items()}
    try:
        runner = cls(ds_args, world_info) if launcher == PDSH else cls(ds_args, world_info, pool)
    except ValueError as exc:
        raise LaunchError(f"--launcher {launcher}: {exc}") from None
    if not runner.backend_exists():
        raise LaunchError(f"--launcher {launcher}: launcher '{launcher}' not installed ({PROGRAMS[launcher]} is not "
                          f"on PATH); install it, or use --launcher ssh")
    env = dict(environ)
    for key, value in job_exports(environ, plan.nodes[0].cwd, env_files).items():
        runner.add_export(key, value)
    if launcher in ("openmpi", "mvapich", SLURM):  # the ranks learn rank 0's address from these (dsplug.comm.discovery)
        runner.add_export("MASTER_ADDR", plan.master_addr)
        runner.add_export("MASTER_PORT", str(plan.master_port))
    if launcher == SLURM:
        env.setdefault("SLURM_KILL_BAD_EXIT", "1")  # a failed rank ends the job step
    try:
        if launcher == PDSH:
            cmd, _kill, env = runner.get_cmd(env, plan.resources)
        else:
            cmd = runner.get_cmd(env, plan.resources)
    except ValueError as exc:
        raise LaunchError(f"--launcher {launcher}: {exc}") from None
    return list(cmd), dict(env)


# ------------------------------------------------------------------------------ ssh check
def ssh_check_argv(host: str, ssh_port: Optional[int], ssh_args: Tuple[str, ...]) -> List[str]:
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_TIMEOUT_S - 5}", *port, *ssh_args, host,
            "true"]


def check_ssh_hosts(hosts: List[str], ssh_port: Optional[int], ssh_args: Tuple[str, ...],
                    environ: Mapping[str, str]) -> None:
    """Run ``true`` on every host over ssh, all at once; a LaunchError names each host that failed
    and what ssh said."""

    def check(host: str) -> Optional[str]:
        try:
            done = subprocess.run(ssh_check_argv(host, ssh_port, ssh_args), env=dict(environ), stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=SSH_CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"no answer within {SSH_CHECK_TIMEOUT_S} s"
        if done.returncode == 0:
            return None
        said = " ".join(done.stderr.split()) or f"ssh exited with status {done.returncode}"
        return said

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(check, hosts))
    _raise_unreachable({h: r for h, r in zip(hosts, results) if r is not None}, "ssh")


def check_pdsh_hosts(hosts: List[str], launcher_args: str, environ: Mapping[str, str]) -> None:
    """Run ``true`` on every host through pdsh (same ssh settings as the launch)."""
    argv = ["pdsh", "-S", "-t", str(SSH_CHECK_TIMEOUT_S - 5), "-u", str(SSH_CHECK_TIMEOUT_S), "-w", ",".join(hosts),
            *shlex.split(launcher_args), "true"]
    try:
        done = subprocess.run(argv, env=dict(environ), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=SSH_CHECK_TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        _raise_unreachable({h: f"no answer within {SSH_CHECK_TIMEOUT_S} s" for h in hosts}, "pdsh")
    if done.returncode == 0:
        return
    said: Dict[str, List[str]] = {}
    for line in (done.stdout + done.stderr).splitlines():
        exited = _PDSH_EXIT.match(line)
        if exited:
            said.setdefault(exited.group(1), [])
            continue
        prefix, sep, rest = line.partition(": ")
        if sep and prefix in hosts:
            said.setdefault(prefix, []).append(rest.strip())
        elif line.startswith("pdsh@"):
            for host in hosts:
                if f" {host}: " in line:
                    said.setdefault(host, []).append(line.split(f" {host}: ", 1)[1].strip())
    failed = {h: "; ".join(m) or "pdsh reported a failure" for h, m in said.items()}
    if not failed:
        failed = {",".join(hosts): " ".join((done.stdout + done.stderr).split()) or f"pdsh exited with {done.returncode}"}
    _raise_unreachable(failed, "pdsh")


def _raise_unreachable(failed: Dict[str, str], how: str) -> None:
    if not failed:
        return
    lines = "\n".join(f"  {host}: {why}" for host, why in failed.items())
    names = ", ".join(failed)
    raise LaunchError(f"cannot run commands over {how} on host{'s' if len(failed) > 1 else ''} {names}; "
                      f"nothing was started:\n{lines}\n(every host must accept ssh without a password prompt; "
                      "--ssh_port / --launcher_args pass ssh settings; --no_ssh_check skips this check)")


# ------------------------------------------------------------------------------ running a launcher command
def run_launcher(cmd: List[str], env: Mapping[str, str], launcher: str, nodes: List[str], elastic: bool = False,
                 name: str = "dsplug launch", poll_interval: float = 0.1) -> int:
    """Run pdsh / mpirun / srun in its own session and wait for it; the exit status of the job.

    pdsh's stderr is read line by line: when a host's command fails (``ssh exited with exit code
    N``) the other hosts get :data:`STOP_GRACE_S` seconds, then pdsh and its ssh connections are
    stopped (each node then stops its workers). A signal (Ctrl-C, SIGTERM) stops the launcher's
    whole process group with SIGTERM; a second one kills it. ``elastic`` (each node an elastic
    agent): failed hosts are reported and the others go on; the job succeeded (0) when a host that
    did not fail finished it.
    """
    watch = launcher == PDSH
    proc = subprocess.Popen(cmd, env=dict(env), start_new_session=True, stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE if watch else None, text=watch, bufsize=1 if watch else -1)
    failures: List[Tuple[str, int]] = []
    reader = None
    if watch:
        def read():
            for line in proc.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                match = _PDSH_EXIT.match(line)
                if match:
                    failures.append((match.group(1), int(match.group(2))))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    received: List[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) != signal.SIG_IGN:
                previous[sig] = signal.signal(sig, lambda signum, _f: received.append(signum))
    def report(done: int) -> int:
        for host, code in failures[done:]:
            rank = nodes.index(host) if host in nodes else "?"
            print(f"{name}: node {rank} ({host}) exited with status {code}", file=sys.stderr, flush=True)
        return len(failures)

    failed_at = None
    reported = handled = 0
    stopped_for_failure = False
    try:
        while proc.poll() is None:
            if len(received) > handled:
                if handled == 0:
                    print(f"{name}: got {signal.Signals(received[0]).name}: stopping the job on every node "
                          f"({', '.join(nodes)}); again to kill it at once", file=sys.stderr, flush=True)
                _signal_group(proc, signal.SIGTERM if handled == 0 else signal.SIGKILL)
                handled = len(received)
            if len(failures) > reported:
                reported = report(reported)
                if failed_at is None and not elastic:
                    failed_at = time.monotonic()
            if failed_at is not None and not stopped_for_failure and time.monotonic() - failed_at >= STOP_GRACE_S:
                print(f"{name}: stopping the other nodes: still running {STOP_GRACE_S:g} s after a node failed",
                      file=sys.stderr, flush=True)
                _stop_group(proc)
                stopped_for_failure = True
            time.sleep(poll_interval)
        if reader is not None:
            reader.join(timeout=5)
        report(reported)  # the nodes whose end pdsh printed as it exited
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = proc.returncode
    if elastic and failures and not received and code is not None and code >= 0 \
            and set(nodes) - {host for host, _code in failures}:
        return 0  # lost nodes; a remaining one finished the job
    if failures:
        return _status(failures[0][1])
    if received:
        return code if code > 0 else 128 + received[0]
    return _status(code)


def _status(code: int) -> int:
    if code < 0:
        return 128 - code
    return code if code <= 255 else 1


def _descendants(pid: int) -> List[int]:
    """The processes below ``pid`` (from /proc; empty where there is none)."""
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the launcher's process group and to every process below it: pdsh starts each ssh
    in a session of its own, out of reach of the group signal."""
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in below:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


# ------------------------------------------------------------------------------ ssh launcher (dsplug's)
def ssh_plan(plan, args):
    """``plan``'s remote nodes with ``--launcher_args`` as ssh options, each node named in its
    failure messages and stopping its workers when its ssh connection closes."""
    ssh_args = tuple(shlex.split(getattr(args, "launcher_args", "") or ""))
    nodes = []
    for node in plan.nodes:
        env = {**node.env, NODE_ENV: f"node {node.node_rank} ({node.host})", WATCH_ENV: "1"}
        nodes.append(replace(node, ssh_args=ssh_args, env=env) if node.remote else node)
    return replace(plan, nodes=nodes)
