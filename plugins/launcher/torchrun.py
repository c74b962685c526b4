"""``python -m dsplug.plugins.launcher.torchrun [torch.distributed.run arguments]``.

Runs ``torch.distributed.run`` unchanged, except for the exit status: torchrun exits with 1
whatever its workers returned; this exits with the status of the first worker that failed
(128 + N for a worker killed by signal N), like DeepSpeed's launcher does. Its options are
matched exactly (no abbreviations), so a script's own ``--log`` reaches the script instead of
failing as an ambiguous abbreviation of torchrun's ``--log-dir`` / ``--logs-specs``.

On a remote node (started over ssh or pdsh) two variables apply:

* ``DSPLUG_LAUNCH_NODE`` (e.g. ``node 1 (worker-2)``): a failed worker is reported as
  ``dsplug launch: node 1 (worker-2): rank 3 (local rank 1) exited with status 13``;
* ``DSPLUG_LAUNCH_WATCH_STDOUT=1``: when the reader of this process's stdout goes away (the ssh
  connection to the launching machine closed: its launcher stopped or was killed), the node stops
  its workers (SIGTERM to this agent) instead of leaving them running unattended.
"""
from __future__ import annotations

import os
import select
import signal
import stat
import sys
import threading
from typing import Optional, Sequence

NODE_ENV = "DSPLUG_LAUNCH_NODE"
WATCH_ENV = "DSPLUG_LAUNCH_WATCH_STDOUT"


def watch_stdout(fd: int = 1, interval_ms: int = 200) -> Optional[threading.Thread]:
    """Start a daemon thread that sends SIGTERM to this process once ``fd``'s reader is gone.

    Only for a pipe or socket (what sshd gives a remote command); returns None for anything else."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None

    def watch():
        poller = select.poll()
        poller.register(fd, select.POLLERR | select.POLLHUP)
        while True:
            if poller.poll(interval_ms):
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="dsplug-launch-stdout-watch", daemon=True)
    thread.start()
    return thread


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    from .plan import exit_status

    parser = torch_run.get_args_parser()
    parser.allow_abbrev = False  # a script option such as --log is not an abbreviation of torchrun's --log-dir
    node = os.environ.get(NODE_ENV)
    if os.environ.get(WATCH_ENV) == "1":
        watch_stdout()
    try:
        record(torch_run.run)(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as failed:
        rank, failure = _first_cause(failed)
        status = exit_status(failure.exitcode) or 1
        if node:
            print(f"dsplug launch: {node}: rank {rank} (local rank {failure.local_rank}) exited with status {status}",
                  file=sys.stderr, flush=True)
        return status
    except SignalException as stopped:
        if node:
            print(f"dsplug launch: {node}: stopped by {signal.Signals(int(stopped.sigval)).name}", file=sys.stderr,
                  flush=True)
        return 128 + int(stopped.sigval)
    return 0


def _first_cause(failed):
    """``(rank, failure)`` to report: the rank most likely to have caused the others to end. A rank
    that exited with a status of its own comes first; then one killed by a signal (torchrun sends
    SIGTERM to the rest once one failed); last one that ended on a
    :class:`~dsplug.comm.faults.CommError` (it lost a peer that failed first). Within a kind, the
    earliest. torchrun's own order would put whichever it saw first, and ranks seen failing in one
    poll are ordered by their error files' timestamps, which only a rank that raised has."""
    def kind(failure) -> int:
        if "CommError" in str(failure.message):
            return 2
        return 1 if failure.exitcode < 0 else 0

    rank = min(failed.failures, key=lambda r: (kind(failed.failures[r]), failed.failures[r].timestamp, r))
    return rank, failed.failures[rank]


if __name__ == "__main__":
    sys.exit(main())
