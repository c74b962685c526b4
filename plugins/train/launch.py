"""``--nproc N``: start N workers of ``python -m dsplug.plugins.train`` with ``dsplug launch``.

The command ``dsplug launch --num_procs N --no_hostfile --module dsplug.plugins.train ...`` is run
in this process, through the kernel's command line (the launcher is another plugin: it is asked
for by its command name, never imported). ``--no_hostfile``: this machine only, even where
``/job/hostfile`` exists -- ``--nproc`` means local processes.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Dict, Iterator, Optional, Sequence

WORKER_MODULE = "dsplug.plugins.train"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_argv(nproc: int, worker_args: Sequence[str], master_port: int) -> list:
    """The ``dsplug`` command line that starts the workers."""
    return ["launch", "--num_procs", str(nproc), "--master_port", str(master_port), "--no_hostfile",
            "--module", WORKER_MODULE, *worker_args]


def worker_environment(threads: Optional[int]) -> Dict[str, str]:
    """What the workers' environment gets on top of this process's."""
    extra = {}
    if threads is not None:
        extra["OMP_NUM_THREADS"] = str(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        extra["OMP_NUM_THREADS"] = "1"
    # on Ctrl-C torchrun waits this long for the workers to save their checkpoint before it kills
    # them (its default, 30 s, is short for a large model; a second Ctrl-C stops them at once)
    if SHUTDOWN_TIMEOUT_ENV not in os.environ:
        extra[SHUTDOWN_TIMEOUT_ENV] = str(SHUTDOWN_TIMEOUT_S)
    return extra


@contextlib.contextmanager
def _environment(extra: Dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` while the launcher runs (it starts the workers with it)."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch_workers(nproc: int, worker_args: Sequence[str], master_port: Optional[int] = None,
                   threads: Optional[int] = None) -> int:
    """Run the workers to completion; returns the launcher's exit status (the first failure's).

    Each worker gets ``OMP_NUM_THREADS`` (``threads``, else 1 as torchrun would set it, unless
    the environment already has it), which also keeps torchrun from warning that it set it.
    On Ctrl-C the launcher passes one SIGINT to torchrun, which passes it to every worker and
    waits up to ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (600 unless set) while they save.
    """
    from dsplug import cli
    from dsplug.registry import get_registry

    if not any(command.name == "launch" for command, _origin in get_registry().cli_commands()):
        print("dsplug train: error: --nproc starts its workers with `dsplug launch`, and no installed plugin "
              "provides that command (the launcher plugin is blocked or not installed; `dsplug list` shows what "
              "is installed)", file=sys.stderr)
        return 2
    with _environment(worker_environment(threads)):
        return cli.main(launch_argv(nproc, worker_args, master_port or free_port()))
