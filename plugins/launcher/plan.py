"""A launch request -> one command per node -> running them.

Every node runs ``python -m dsplug.plugins.launcher.torchrun`` (``torch.distributed.run`` with the
failed worker's exit code passed through) with ``--nnodes/--nproc_per_node/--node_rank/
--master_addr/--master_port``; workers run the user script through :mod:`dsplug.plugins.launcher.shim`
unless ``--no_local_rank``. A single node runs locally; several nodes (or ``--force_multi``) run
over ``ssh host '<command>'``, where the remote command is built from :func:`shlex.quote`-d
words only, so nothing from a hostfile, the environment or the command line is ever interpreted
by the remote shell.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .envfile import check_env_key, default_env_files, remote_exports
from .errors import LaunchError
from .hostfile import DEFAULT_HOSTFILE, read_hostfile
from .resources import Resources, check_procs_per_node, limit_resources, select_resources

DEFAULT_MASTER_PORT = 29500
TORCHRUN_MODULE = "dsplug.plugins.launcher.torchrun"
SHIM_MODULE = "dsplug.plugins.launcher.shim"
LOCALHOST = "localhost"
_ADDRESS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*\Z")


@dataclass(frozen=True)
class LaunchRequest:
    """What the user asked for; every field has the meaning of the ``dsplug launch`` flag of that name."""

    script: str
    script_args: Tuple[str, ...] = ()
    hostfile: Optional[str] = None  # None: DEFAULT_HOSTFILE when it exists, else this machine alone
    include: str = ""
    exclude: str = ""
    num_nodes: Optional[int] = None
    procs_per_node: Optional[int] = None  # --num_gpus / --num_procs
    master_addr: Optional[str] = None
    master_port: int = DEFAULT_MASTER_PORT
    local_rank_arg: bool = True  # False: --no_local_rank
    module: bool = False
    no_python: bool = False
    force_multi: bool = False
    ssh_port: Optional[int] = None
    python: str = field(default_factory=lambda: sys.executable)
    cwd: str = field(default_factory=os.getcwd)
    # Slots of "localhost" when no hostfile is used, and the variable that limits which devices a
    # process sees. Either may be a zero-argument callable, asked only when the value is needed
    # (the CLI passes accelerator queries, which import torch).
    local_devices: Union[int, Callable[[], int]] = 1
    visible_devices_env: Union[str, Callable[[], str]] = "CUDA_VISIBLE_DEVICES"
    env_files: Optional[Tuple[str, ...]] = None  # None: ~/.deepspeed_env and ./.deepspeed_env
    default_hostfile: str = DEFAULT_HOSTFILE


@dataclass
class NodeCommand:
    """The command for one node: ``argv`` run in ``cwd`` with ``env`` added to the node's environment."""

    host: str
    node_rank: int
    slots: Tuple[int, ...]
    argv: Tuple[str, ...]
    env: Dict[str, str]
    cwd: str
    remote: bool
    ssh_port: Optional[int] = None
    ssh_args: Tuple[str, ...] = ()  # more ssh options (``--launcher ssh --launcher_args '-F cfg'``)

    def remote_shell_command(self) -> str:
        """The string the remote shell runs; every word is quoted."""
        words = ["cd", shlex.quote(self.cwd), "&&"]
        if self.env:
            words.append("env")
            words += [shlex.quote(f"{key}={value}") for key, value in self.env.items()]
        words += [shlex.quote(word) for word in self.argv]
        return " ".join(words)

    def process_argv(self) -> List[str]:
        """What this machine executes (no shell involved here)."""
        if not self.remote:
            return list(self.argv)
        port = ["-p", str(self.ssh_port)] if self.ssh_port is not None else []
        return ["ssh", *port, *self.ssh_args, self.host, self.remote_shell_command()]

    def display(self) -> str:
        """A shell line equivalent to running this node's command (what ``--print_only`` shows)."""
        if self.remote:
            return shlex.join(self.process_argv())
        prefix = ["env", *(f"{key}={value}" for key, value in self.env.items())] if self.env else []
        return shlex.join(prefix + list(self.argv))


@dataclass
class LaunchPlan:
    resources: Resources
    master_addr: str
    master_port: int
    multi_node: bool
    nodes: List[NodeCommand]


def _check_request(req: LaunchRequest) -> None:
    if req.module and req.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if (req.include or req.exclude) and (req.num_nodes is not None or req.procs_per_node is not None):
        raise LaunchError(
            "--num_nodes/--num_gpus/--num_procs cannot be combined with --include/--exclude; "
            "name the hosts and slots in the filter instead"
        )
    if req.procs_per_node is not None:
        check_procs_per_node(req.procs_per_node)
    if req.num_nodes is not None and req.num_nodes < 1:
        raise LaunchError(f"--num_nodes must be a positive integer, got {req.num_nodes}")
    if not 1 <= req.master_port <= 65535:
        raise LaunchError(f"--master_port must be in 1..65535, got {req.master_port}")
    if req.ssh_port is not None and not 1 <= req.ssh_port <= 65535:
        raise LaunchError(f"--ssh_port must be in 1..65535, got {req.ssh_port}")
    if req.master_addr is not None and not _ADDRESS.match(req.master_addr):
        raise LaunchError(
            f"--master_addr {req.master_addr!r} is not a host name or IP address "
            "(letters, digits, '.', '_', ':', '-')"
        )
    if not req.script:
        raise LaunchError("no script given; usage: dsplug launch [options] script.py [script args]")


def _resource_pool(req: LaunchRequest) -> Tuple[Dict[str, int], str, bool]:
    """(pool, description for messages, whether it came from a hostfile)."""
    if req.hostfile is not None:
        return read_hostfile(req.hostfile), f"hostfile {req.hostfile!r}", True
    if os.path.isfile(req.default_hostfile):
        return read_hostfile(req.default_hostfile), f"hostfile {req.default_hostfile!r}", True
    if req.procs_per_node is not None:  # the device count would be overridden anyway
        return {LOCALHOST: req.procs_per_node}, "this machine (no hostfile)", False
    count = _resolve(req.local_devices)
    if count < 1:
        raise LaunchError("this machine reports no devices; pass --num_gpus/--num_procs N")
    return {LOCALHOST: count}, "this machine (no hostfile)", False


def _resolve(value):
    return value() if callable(value) else value


def _worker_target(req: LaunchRequest) -> List[str]:
    """The part of the torchrun command line naming what each worker runs."""
    if req.local_rank_arg:
        mode = ["--module"] if req.module else ["--no_python"] if req.no_python else []
        return ["-m", SHIM_MODULE, *mode, req.script, *req.script_args]
    if req.module:
        return ["-m", req.script, *req.script_args]
    if req.no_python:
        return ["--no-python", req.script, *req.script_args]
    return [req.script, *req.script_args]


def plan_launch(req: LaunchRequest, environ: Optional[Mapping[str, str]] = None) -> LaunchPlan:
    """Resolve resources and build each node's command; raises :class:`LaunchError` on bad input."""
    environ = os.environ if environ is None else environ
    _check_request(req)
    pool, source, from_hostfile = _resource_pool(req)
    if not from_hostfile and req.num_nodes is not None and req.num_nodes > 1:
        raise LaunchError(
            f"--num_nodes {req.num_nodes} needs a hostfile listing the nodes; none was given "
            f"with --hostfile and {req.default_hostfile} does not exist"
        )
    resources = select_resources(pool, req.include, req.exclude, source)
    resources = limit_resources(resources, req.num_nodes, req.procs_per_node, source)
    multi_node = req.force_multi or len(resources) > 1
    hosts = list(resources)
    master_addr = req.master_addr or (hosts[0] if multi_node else "127.0.0.1")

    exports: Dict[str, str] = {}
    if multi_node:
        files = req.env_files if req.env_files is not None else default_env_files(environ, req.cwd)
        exports = remote_exports(environ, req.cwd, files)
    target = _worker_target(req)
    nodes = []
    for rank, host in enumerate(hosts):
        slots = resources[host]
        env = dict(exports)
        if slots != list(range(len(slots))):  # a subset of the devices: make only those visible
            name = check_env_key(_resolve(req.visible_devices_env), "visible devices variable")
            env[name] = ",".join(str(s) for s in slots)
        argv = [
            req.python, "-u", "-m", TORCHRUN_MODULE,
            "--nnodes", str(len(hosts)),
            "--nproc_per_node", str(len(slots)),
            "--node_rank", str(rank),
            "--master_addr", master_addr,
            "--master_port", str(req.master_port),
            *target,
        ]  # fmt: skip
        nodes.append(NodeCommand(host, rank, tuple(slots), tuple(argv), env, req.cwd, multi_node, req.ssh_port))
    return LaunchPlan(resources, master_addr, req.master_port, multi_node, nodes)


def exit_status(returncode: int) -> int:
    """A child's return code as a shell exit status (death by signal N -> 128 + N)."""
    if returncode < 0:
        return 128 + (-returncode)
    return returncode if returncode <= 255 else 1


#: Signals :func:`execute` passes on to the node commands (the first time) instead of dying of them.
FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def execute(
    plan: LaunchPlan,
    environ: Optional[Mapping[str, str]] = None,
    popen: Callable[..., subprocess.Popen] = subprocess.Popen,
    poll_interval: float = 0.1,
    name: str = "dsplug launch",
    stop_others_after: Optional[float] = None,
    elastic: bool = False,
) -> int:
    """Start every node's command and wait; returns the first failing node's exit status, else 0.

    Local node commands (torchrun) run in their own session, so a Ctrl-C at the terminal reaches
    only this process, which passes exactly one SIGINT to each of them; torchrun passes it on to
    its workers and waits for them (a training script can then finish its step and save, as
    ``dsplug train`` does). SIGTERM and SIGHUP are passed on the same way. A second signal stops
    every child at once (terminate, then kill). After a signal the result is the children's
    failure status, else ``128 + signal``. ``name`` prefixes the messages.

    With ``stop_others_after`` (seconds; multi-node runs that are not elastic), once a node fails
    the nodes still running get that long to end on their own (their ranks usually fail at once
    when a peer is gone), then they are stopped: their ssh connections close, and each remote
    node then stops its workers (``DSPLUG_LAUNCH_WATCH_STDOUT``, :mod:`.torchrun`).

    ``elastic`` (each node an elastic agent): a node that fails is reported and the others go on
    without it; the job succeeded (0) when a node finished it, whatever nodes were lost on the way.
    """
    base_env = dict(os.environ if environ is None else environ)
    received: List[int] = []
    previous: Dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig_name in FORWARDED_SIGNALS:
            sig = getattr(signal, sig_name, None)
            if sig is None or signal.getsignal(sig) == signal.SIG_IGN:
                continue  # e.g. SIGINT of a background job: not ours to handle
            previous[sig] = signal.signal(sig, lambda signum, _frame: received.append(signum))
    running: List[Tuple[NodeCommand, subprocess.Popen]] = []
    try:
        for node in plan.nodes:
            if node.remote:
                running.append((node, popen(node.process_argv(), env=base_env, cwd=node.cwd)))
            else:
                running.append((node, popen(node.process_argv(), env={**base_env, **node.env}, cwd=node.cwd,
                                            start_new_session=True)))
        status, handled, finished = 0, 0, 0
        failed_at: Optional[float] = None
        stopped: List[NodeCommand] = []
        pending = list(running)
        while pending:
            if failed_at is not None and time.monotonic() - failed_at >= stop_others_after:
                hosts = ", ".join(f"node {n.node_rank} ({n.host})" for n, _ in pending)
                print(f"{name}: stopping {hosts}: still running {stop_others_after:g} s after a node failed",
                      file=sys.stderr, flush=True)
                stopped.extend(node for node, _proc in pending)
                _stop(pending)
                failed_at = None
            if len(received) > handled:
                if handled == 0:
                    _forward(running, received[0], name)
                handled = len(received)
                if handled > 1:  # asked twice: stop now
                    print(f"{name}: {signal.Signals(received[-1]).name} again: stopping the workers now",
                          file=sys.stderr, flush=True)
                    _stop(running)
                    return status or 128 + received[0]
            for item in list(pending):
                node, proc = item
                code = proc.poll()
                if code is None:
                    continue
                pending.remove(item)
                finished += code == 0
                if code != 0:
                    node_status = exit_status(code)
                    if received and node_status == 128 + received[0]:
                        continue  # stopped by the signal it was sent: expected, not a failure to report
                    if stopped and node in stopped:
                        continue  # stopped here after another node failed
                    status = status or node_status  # the first failure decides the exit status
                    where = f"node {node.node_rank} ({node.host})" if plan.multi_node else "the local workers"
                    why = " (ssh's own failure: the host could not be reached, refused the connection, or the " \
                          "connection dropped)" if node.remote and node_status == 255 else ""
                    goes_on = "; the other nodes go on without it (elastic)" if elastic and pending else ""
                    print(f"{name}: {where} exited with status {node_status}{why}{goes_on}", file=sys.stderr,
                          flush=True)
                    if stop_others_after is not None and not received and failed_at is None and not stopped:
                        failed_at = time.monotonic()
            if pending:
                time.sleep(poll_interval)
        if elastic and finished and not received:
            return 0
        return status or (128 + received[0] if received else 0)
    except BaseException:
        _stop(running)  # an error here (or a KeyboardInterrupt where no handler could be set): no orphans
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward(running: Sequence[Tuple[NodeCommand, subprocess.Popen]], sig: int, name: str) -> None:
    """Pass ``sig`` once to every child still running."""
    for _node, proc in running:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except OSError:
                pass
    again = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
    print(f"{name}: got {signal.Signals(sig).name}: passed it on to the workers; waiting for them to finish "
          f"({again} again to stop them at once)", file=sys.stderr, flush=True)


def _stop(running: Sequence[Tuple[NodeCommand, subprocess.Popen]], grace: float = 10.0) -> None:
    """Stop every still-running child now: SIGTERM, then SIGKILL after ``grace`` seconds."""
    for _node, proc in running:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for _node, proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
