"""``--nproc N``: start N workers of ``python -m dsplug.plugins.train`` through the dsplug launcher.

The same plan ``dsplug launch --num_procs N -m dsplug.plugins.train ...`` builds, on this machine only
(a hostfile, even ``/job/hostfile``, is not consulted: ``--nproc`` means local processes).
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Optional, Sequence


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(nproc: int, worker_args: Sequence[str], master_port: Optional[int] = None,
                   threads: Optional[int] = None) -> int:
    """Run the workers to completion; returns the launcher's exit status (the first failure's).

    Each worker gets ``OMP_NUM_THREADS`` (``threads``, else 1 as torchrun would set it, unless
    the environment already has it), which also keeps torchrun from warning that it set it.
    On Ctrl-C the launcher passes one SIGINT to torchrun, which passes it to every worker and
    waits up to ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (600 unless set) while they save.
    """
    from dsplug.plugins.launcher import LaunchError, LaunchRequest, execute, plan_launch

    request = LaunchRequest(
        script="dsplug.plugins.train",
        script_args=tuple(worker_args),
        module=True,
        procs_per_node=nproc,
        master_port=master_port or free_port(),
        default_hostfile="",  # never a hostfile: --nproc is about this machine
    )
    try:
        plan = plan_launch(request)
    except LaunchError as exc:
        print(f"dsplug train: error: {exc}", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    if threads is not None:
        environ["OMP_NUM_THREADS"] = str(threads)
    else:
        environ.setdefault("OMP_NUM_THREADS", "1")
    # on Ctrl-C torchrun waits this long for the workers to save their checkpoint before it kills
    # them (its default, 30 s, is short for a large model; a second Ctrl-C stops them at once)
    environ.setdefault(SHUTDOWN_TIMEOUT_ENV, str(SHUTDOWN_TIMEOUT_S))
    return execute(plan, environ=environ, name="dsplug train")
