"""Bounded collectives: a dead or stopped rank makes every survivor fail within the comm timeout.

* **The bound.** ``comm_timeout_s`` (kernel config key) or ``DSPLUG_COMM_TIMEOUT`` (seconds, an
  environment variable) sets the timeout of the process group (torch's default is 30 minutes);
  the config key wins over the variable. A group created before the engine (``zero.Init``, the
  user's own ``init_process_group``) gets the timeout re-applied. On gloo every synchronous
  collective honours the group timeout, and asynchronous works are waited with the same bound.
* **The diagnosis.** Every rank's ``(hostname, pid)`` is recorded when the group is made (through
  the group's store, no collective). A collective that fails (a peer's connection closed, or the
  bound elapsed) is re-raised as :class:`CommError` naming the operation (``with
  comm.operation("save_checkpoint"):``), the collective, and the state of every peer on this host
  (dead, stopped, alive; "unknown" for other hosts), e.g. ``dsplug: save_checkpoint: rank 1
  (pid 4242 on this host) died; all_gather did not complete within 30 s``.
* **No second wait.** After a failure the group is unusable (gloo closes the pairs it timed out
  on): every later collective on it raises at once instead of waiting out the bound again, so
  a survivor's error path (and its exit) is bounded by one timeout.
* **A bounded exit.** A process whose group failed does not go through the interpreter's own
  teardown, which can take tens of seconds there (collecting every module with a process group
  whose peer is dead or stopped): when it ends — an uncaught exception (status 1) or
  ``sys.exit(status)`` — the exit handlers run (monitors close their files, logging flushes) for
  at most :data:`EXIT_FLUSH_S` seconds, stdout and stderr are flushed, and the process leaves
  with ``os._exit``. So it exits within ``comm_timeout_s`` + a few seconds of the fault. A script
  that catches the :class:`CommError` and returns normally keeps the ordinary (slow) exit: its
  status cannot be known early; end it with ``sys.exit(...)``. A group made anew after the
  failure (elastic recovery) disarms this.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

#: environment variable: seconds a collective may wait for the other ranks
ENV_TIMEOUT = "DSPLUG_COMM_TIMEOUT"
#: torch's own default for gloo (and what dsplug used before the timeout was configurable)
DEFAULT_TIMEOUT = timedelta(minutes=30)

_labels: contextvars.ContextVar = contextvars.ContextVar("dsplug_comm_operation", default=())
_state: Dict[str, object] = {"timeout": None, "peers": None, "peers_of": None, "failure": None, "failed_group": None}

#: words in torch / gloo / NCCL errors that mean a peer or the transport failed (not a misuse)
_TRANSPORT_WORDS = ("timed out", "timeout", "connection", "closed by peer", "reset by peer", "broken pipe",
                    "pair closure", "socket", "gloo/transport", "nccl error", "remote worker")


class CommError(RuntimeError):
    """A collective failed or did not complete within the comm timeout.

    ``operation`` is the label of the enclosing :func:`operation` (e.g. ``"save_checkpoint"``,
    ``""`` outside any), ``collective`` the collective (``"all_gather"``), ``peers`` maps each
    other rank to its state seen from here (``"dead"``, ``"stopped"``, ``"alive"``, ``"unknown"``).
    """

    def __init__(self, message: str, operation: str = "", collective: str = "",
                 peers: Optional[Dict[int, str]] = None):
        super().__init__(message)
        self.operation = operation
        self.collective = collective
        self.peers = dict(peers or {})

    def dead_ranks(self):
        return sorted(r for r, s in self.peers.items() if s in ("dead", "stopped"))

    def copy(self) -> "CommError":
        return CommError(str(self), self.operation, self.collective, self.peers)


# ------------------------------------------------------------------------------ the bound
def env_timeout() -> Optional[timedelta]:
    """``DSPLUG_COMM_TIMEOUT`` as a timedelta (None when unset or empty)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: expected a number of seconds (e.g. 300)") from None
    if not seconds > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: the timeout must be > 0 seconds")
    return timedelta(seconds=seconds)


def as_timedelta(timeout) -> Optional[timedelta]:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def timeout() -> timedelta:
    """The bound every collective on the default group waits at most."""
    known = _state["timeout"]
    if known is not None:
        return known
    if dist.is_available() and dist.is_initialized():
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            return backend.options._timeout
        except Exception:  # noqa: BLE001 - a backend without readable options
            pass
    return DEFAULT_TIMEOUT


def created(timeout_: timedelta) -> None:
    """The default group was just made with ``timeout_`` (by :func:`dsplug.comm.init_distributed`)."""
    _state.update(timeout=timeout_, failure=None, failed_group=None)


def set_timeout(timeout_) -> None:
    """Apply ``timeout_`` (seconds or timedelta) to the existing default group."""
    timeout_ = as_timedelta(timeout_)
    c10d = dist.distributed_c10d
    c10d._set_pg_timeout(timeout_)
    for group in list(getattr(c10d._world, "pg_map", {})):  # subgroups made so far (new_group)
        if group is not c10d._get_default_group() and not c10d._rank_not_in_group(group):
            try:
                c10d._set_pg_timeout(timeout_, group)
            except Exception:  # noqa: BLE001 - a subgroup of a backend that cannot: keeps its own
                pass
    _state["timeout"] = timeout_


def forget() -> None:
    """The default group is gone (destroyed)."""
    _state.update(timeout=None, peers=None, peers_of=None, failure=None, failed_group=None)


def seconds(td: timedelta) -> str:
    s = td.total_seconds()
    return f"{s:g}" if s < 600 else f"{s:.0f}"


# ------------------------------------------------------------------------------ peers
def _group_id() -> Optional[int]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return id(dist.distributed_c10d._get_default_group())


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record_peers() -> None:
    """Remember every rank's (hostname, pid) of the default group, once per group.

    Every rank of the group must call this (it reads the others' entries from the group's store,
    waiting at most the store's timeout); it never issues a collective.
    """
    group = _group_id()
    if group is None or _state["peers_of"] == group:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    me = [socket.gethostname(), os.getpid(), _start_time(os.getpid())]
    peers = {rank: tuple(me)}
    try:
        if world > 1:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"dsplug/peer/{rank}", json.dumps(me))
            for r in range(world):
                if r != rank:
                    peers[r] = tuple(json.loads(store.get(f"dsplug/peer/{r}").decode()))
    except Exception:  # noqa: BLE001 - the diagnosis is a nicety; never fail the init for it
        pass
    _state.update(peers=peers, peers_of=group)


def _local_state(pid: int, start: Optional[str]) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "dead"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "dead"
        except OSError:
            pass
        return "alive"
    if start is not None and len(fields) > 19 and fields[19] != start:
        return "dead"  # the pid now belongs to another process
    code = fields[0] if fields else "?"
    if code in ("Z", "X", "x"):
        return "dead"
    if code in ("T", "t"):
        return "stopped"
    return "alive"


def peer_states() -> Dict[int, str]:
    """Each other rank's state as seen from here: dead / stopped / alive, or unknown (another host)."""
    peers = _state["peers"] or {}
    if not peers:
        return {}
    rank = dist.get_rank() if dist.is_initialized() else -1
    host = socket.gethostname()
    states = {}
    for r, (peer_host, pid, start) in sorted(peers.items()):
        if r == rank:
            continue
        states[r] = _local_state(int(pid), start) if peer_host == host else "unknown"
    return states


def _describe(states: Dict[int, str]) -> str:
    peers = _state["peers"] or {}
    if not peers:
        return "the ranks' processes were not recorded (state of the peers unknown)"
    failed, remote = [], []
    for r, state in states.items():
        host, pid = peers[r][0], peers[r][1]
        if state == "dead":
            failed.append(f"rank {r} (pid {pid} on this host) died")
        elif state == "stopped":
            failed.append(f"rank {r} (pid {pid} on this host) is stopped (SIGSTOP or a debugger) and not responding")
        elif state == "unknown":
            remote.append(f"{r} ({host})")
    if failed:
        text = ", ".join(failed)
        if remote:
            text += f"; state of ranks on other hosts unknown: {', '.join(remote)}"
        return text
    if remote:
        return (f"every other rank on this host is alive; one on another host may have died or stalled "
                f"(state unknown: ranks {', '.join(remote)})")
    return "every other rank is alive (one of them is stalled, or the network failed)"


# ------------------------------------------------------------------------------ failures
def _label() -> str:
    names = []
    for name in _labels.get():
        if not names or names[-1] != name:  # a wrapper naming what its callee names too
            names.append(name)
    return " / ".join(names)


def is_transport_error(exc: BaseException) -> bool:
    """True when ``exc`` (from torch.distributed) says a peer or the transport failed."""
    for name in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        kind = getattr(dist, name, None)
        if kind is not None and isinstance(exc, kind):
            return True
    text = str(exc).lower()
    return any(word in text for word in _TRANSPORT_WORDS)


def failure(collective: str, started: float, exc: BaseException) -> BaseException:
    """The error to raise for ``exc`` from ``collective`` (issued at ``started``, perf_counter):
    a :class:`CommError` with the diagnosis when a peer or the transport failed, else ``exc``."""
    if isinstance(exc, CommError):
        return exc
    states = peer_states()
    if not is_transport_error(exc) and not any(s in ("dead", "stopped") for s in states.values()):
        return exc
    # a peer killed a moment ago can still be exiting: look again for up to a second
    deadline = time.monotonic() + 1.0
    while not any(s in ("dead", "stopped") for s in states.values()) and time.monotonic() < deadline \
            and any(s == "alive" for s in states.values()):
        time.sleep(0.1)
        states = peer_states()
    bound = timeout()
    elapsed = time.perf_counter() - started
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "timed out" in text.lower() or "timeout" in text.lower() or elapsed >= 0.9 * bound.total_seconds():
        what = f"{collective} did not complete within {seconds(bound)} s"
    else:
        what = f"{collective} failed after {elapsed:.1f} s (timeout {seconds(bound)} s): {_short(text)}"
    label = _label()
    me = dist.get_rank() if dist.is_initialized() else 0
    message = f"dsplug: {label + ': ' if label else ''}{_describe(states)}; {what} [seen by rank {me}, pid {os.getpid()}]"
    error = CommError(message, label, collective, states)
    if _state["failure"] is None or _state["failed_group"] != _group_id():
        _state.update(failure=error, failed_group=_group_id())
        print(message, file=sys.stderr, flush=True)
        arm_exit()
    return error


def _short(text: str) -> str:
    # gloo's messages start with the source location: keep what follows it
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(" This is typically caused", 1)[0]
    return text if len(text) <= 200 else text[:197] + "..."


def check_usable(collective: str) -> None:
    """Raise at once when the default group already failed (it cannot complete a collective)."""
    first = _state["failure"]
    if first is None:
        return
    if _state["failed_group"] != _group_id():
        _state.update(failure=None, failed_group=None)
        return
    label = _label()
    raise CommError(f"dsplug: {label + ': ' if label else ''}{collective} not issued: the process group failed "
                    f"earlier ({first})", label, collective, first.peers)


def last_failure() -> Optional[CommError]:
    """The first failure of the current default group (None when it has not failed)."""
    if _state["failure"] is not None and _state["failed_group"] == _group_id():
        return _state["failure"]
    return None


@contextlib.contextmanager
def operation(label: str) -> Iterator[None]:
    """Name what the collectives issued inside are for (``"save_checkpoint"``): a failure names it.

    An exception that escapes because a collective failed inside (even wrapped by another error,
    e.g. a plugin hook's) is re-raised as the :class:`CommError` naming the dead rank.
    """
    token = _labels.set(_labels.get() + (label,))
    before = last_failure()
    try:
        yield
    except CommError:
        raise
    except BaseException as exc:
        cause = _comm_error_in(exc)
        if cause is None:
            now = last_failure()
            cause = now if now is not None and now is not before else None
        if cause is not None:
            raise cause.copy() from exc
        raise
    finally:
        _labels.reset(token)


def _comm_error_in(exc: BaseException) -> Optional[CommError]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CommError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def bounded_wait(work, gloo: bool) -> None:
    """``work.wait()``, at most the comm timeout on gloo (on NCCL a CPU-side bounded wait would
    block the host, so there the group timeout and NCCL's watchdog bound it)."""
    if gloo:
        work.wait(timeout=timeout())
    else:
        work.wait()


def peers() -> Dict[int, Tuple]:
    """Recorded ``rank -> (hostname, pid, start time)`` of the default group."""
    return dict(_state["peers"] or {})


# ------------------------------------------------------------------------------ leaving after a failure
#: seconds the exit handlers may take after a comm failure before the process leaves anyway
EXIT_FLUSH_S = 2.0
_exit: Dict[str, object] = {"armed": False, "status": None}


def arm_exit() -> None:
    """(at the first failure) make this process leave promptly when it ends: an uncaught
    exception (after the traceback is printed) or ``sys.exit`` then ends in :func:`leave`."""
    if _exit["armed"]:
        return
    _exit["armed"] = True
    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):
        previous_hook(kind, value, tb)
        if last_failure() is not None:
            leave(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = excepthook
    real_exit = sys.exit

    def exit_(status=None):
        _exit["status"] = (status,)
        real_exit(status)

    exit_.__doc__ = real_exit.__doc__
    sys.exit = exit_
    import atexit

    atexit.register(_leave_at_exit)  # registered now: runs before the handlers registered earlier


def _leave_at_exit() -> None:
    if last_failure() is None or _exit["status"] is None:
        return  # no failure on the current group, or an exit status we cannot know: the usual exit
    leave(exit_status(_exit["status"][0]))


def exit_status(code) -> int:
    """The status Python gives ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def leave(status: int) -> None:
    """Flush and end this process now, skipping the interpreter's teardown: the remaining exit
    handlers run for at most :data:`EXIT_FLUSH_S` seconds (the comm layer's own, which destroys
    the failed group, is skipped), then stdout / stderr are flushed and ``os._exit(status)``."""
    import atexit
    import threading

    threading.Thread(target=_leave_after, args=(EXIT_FLUSH_S, status), daemon=True, name="dsplug-exit").start()
    atexit.unregister(_leave_at_exit)
    comm_module = sys.modules.get(__name__.rsplit(".", 1)[0])
    for name in ("_let_workers_finish_at_exit", "_destroy_at_exit"):
        handler = getattr(comm_module, name, None)
        if handler is not None:
            atexit.unregister(handler)
    try:
        atexit._run_exitfuncs()  # monitors close their files, logging flushes
    except BaseException:  # noqa: BLE001 - leaving anyway
        pass
    _hard_exit(status)


def _leave_after(seconds: float, status: int) -> None:
    time.sleep(seconds)
    print(f"dsplug: exit handlers still running {seconds:g} s after the comm failure; leaving now", file=sys.stderr)
    _hard_exit(status)


def _hard_exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream
            pass
    os._exit(status)
