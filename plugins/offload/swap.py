"""Swap files for NVMe offload: a private directory per process, space checks before training,
checked reads and writes through the async_io op, and a pool of aligned host buffers.

* :class:`SwapDir` — ``<nvme_path>/dsplug-<what>-rank<r>-pid<pid>-<random>/``, created after checking
  that ``nvme_path`` exists, is a writable directory and has room for every byte that will be swapped
  (``os.statvfs``); removed by :meth:`SwapDir.close` (the engine's ``destroy()``) or, failing
  that, when the process exits. Its :data:`OWNER_FILE` records the owner (host, pid, the pid's
  start time, boot id, pid namespace), so that the directories of runs that died without
  cleaning up (killed, crashed, the machine rebooted) are found and removed by the next run on
  the same host, before its space check (:func:`reclaim_stale_swap_dirs`).
* :class:`SwapFiles` — whole tensors to and from files in a SwapDir through aio handles: one for
  reads and one per write *stream*, each waited for separately (a read can overlap writes still
  in flight, and the writes of one sub-group can be waited for while the next one's continue). Every read first checks
  that the file has exactly the bytes last written to it; with ``DSPLUG_DEBUG_SWAP=1`` the CRC-32
  of the bytes read must also equal the CRC-32 of the bytes written.
Swap buffers (aligned, page-locked) come from :meth:`.devices.NvmeOffload.swap_buffer`.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import weakref
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from dsplug.contracts.offload import OffloadError

DEBUG_ENV = "DSPLUG_DEBUG_SWAP"
SWAP_DIR_PREFIX = "dsplug-"
#: The file in each private swap directory naming the process that owns it (JSON).
OWNER_FILE = ".dsplug-owner.json"


#: the offload contract's error: a swap directory is unusable (missing, not writable, too small)
SwapError = OffloadError


class SwapCorruptionError(SwapError):
    """A swap file does not hold what was written to it."""


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{nbytes} B"  # pragma: no cover


def available_bytes(path: str) -> int:
    """Bytes an unprivileged process may still write on the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_swap_path(path: Optional[str], key: str, needed: int, reclaim: bool = False) -> str:
    """``path`` as an absolute directory that can take ``needed`` more bytes; else :class:`SwapError`
    naming the config key, the path and the bytes needed / available. With ``reclaim``, the swap
    directories of dead runs of this host are removed first (:func:`reclaim_stale_swap_dirs`)."""
    where = f"zero_optimization.{key}.nvme_path"
    if not path:
        raise SwapError(f"{where} is not set: device 'nvme' needs a directory for its swap files")
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(path):
        raise SwapError(f"{where} = {path!r} does not exist: create the directory (on a fast local NVMe drive) or "
                        f"point nvme_path at one; this run needs {_human(needed)} ({needed} bytes) there")
    if not os.path.isdir(path):
        raise SwapError(f"{where} = {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SwapError(f"{where} = {path!r} is not writable by this process (uid {os.getuid()}); choose a directory "
                        "it may create files in")
    if reclaim:
        reclaim_stale_swap_dirs(path)
    free = available_bytes(path)
    if needed > free:
        raise SwapError(f"{where} = {path!r}: not enough free space for the swap files: this process needs "
                        f"{_human(needed)} ({needed} bytes) but only {_human(free)} ({free} bytes) are available "
                        "(free some space, or offload less: ratio, sub_group_size, max_in_cpu)")
    return path


# ------------------------------------------------------------------------------ owners
_MAX_PID = 1 << 30  # Linux pids stay below 2**22; anything larger is not a pid


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def current_owner() -> Dict[str, Any]:
    """What :data:`OWNER_FILE` records for this process."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_time": _start_time(pid), "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace()}


def read_owner(swap_dir: str) -> Optional[Dict[str, Any]]:
    """The owner recorded in ``swap_dir``, or None (no owner file, or one that cannot be read)."""
    try:
        with open(os.path.join(swap_dir, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("host"), str) \
            or not isinstance(owner.get("pid"), int) or isinstance(owner.get("pid"), bool) \
            or not 0 < owner["pid"] < _MAX_PID:
        return None
    return owner


def owner_is_dead(owner: Dict[str, Any], me: Optional[Dict[str, Any]] = None) -> bool:
    """True only when the process recorded in ``owner`` certainly no longer runs: it was on this
    host, and either this host has rebooted since, or (same boot, same pid namespace) its pid is
    gone or now belongs to a process started at another time. Any doubt (another host, another
    pid namespace, a pid of another user's live process) answers False."""
    me = current_owner() if me is None else me
    if owner.get("host") != me["host"]:
        return False
    if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
        return True  # the machine was restarted: no process of that boot is alive
    if owner.get("pid_namespace") != me["pid_namespace"]:
        return False  # another container's pids: this process cannot see them
    pid = owner["pid"]
    if pid == os.getpid():
        return False
    if not _pid_alive(pid):
        return True
    started = owner.get("start_time")
    now = _start_time(pid)
    return started is not None and now is not None and now != started  # the pid was reused


def _tree_bytes(path: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _pid_alive(pid: int) -> bool:
    if not 0 < pid < _MAX_PID:
        return True  # not a process id: treat as alive, i.e. leave alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # PermissionError: another user's live process
    return True


def _remove_tree_owner_last(path: str) -> bool:
    """Delete ``path`` with its owner file last (a removal cut short is finished by a later run);
    True when it is gone."""
    try:
        names = [n for n in os.listdir(path) if n != OWNER_FILE]
    except OSError:
        return not os.path.lexists(path)
    for name in names:
        full = os.path.join(path, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                os.unlink(full)
        except OSError:
            pass
    try:
        if set(os.listdir(path)) <= {OWNER_FILE}:  # only then: keep the owner while anything else is left
            try:
                os.unlink(os.path.join(path, OWNER_FILE))
            except FileNotFoundError:
                pass
            os.rmdir(path)
    except OSError:
        pass
    return not os.path.lexists(path)


_RECLAIMING = ".reclaiming-"


def reclaim_stale_swap_dirs(root: str, log=None) -> List[str]:
    """Remove the private swap directories under ``root`` whose owner (:data:`OWNER_FILE`) was a
    process of this host that is no longer running (:func:`owner_is_dead`); returns their paths.
    Each removal is logged (``log``: a ``str -> None`` callable; default: the dsplug logger's
    warning). Directories of live processes, of other hosts or without an owner file (older
    dsplug versions, or not dsplug's) are left alone, as are symbolic links.

    A directory is first renamed to ``<name>.reclaiming-<pid>``: of several ranks scanning at
    once, exactly one claims (and reports) it, and one whose claimer died is claimed again."""
    if log is None:
        from dsplug.logging import logger

        log = logger.warning
    me = current_owner()
    removed: List[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(SWAP_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        base, claiming, claimer = entry.name.partition(_RECLAIMING)
        if claiming and (not claimer.isdigit() or len(claimer) > 9 or _pid_alive(int(claimer))):
            continue  # being removed right now by another process of this host (or not ours)
        owner = read_owner(entry.path)
        if owner is None or not owner_is_dead(owner, me):
            continue
        original = os.path.join(root, base)
        claimed = f"{original}{_RECLAIMING}{os.getpid()}"
        try:
            os.rename(entry.path, claimed)
        except OSError:
            continue  # another process claimed it first
        size = _tree_bytes(claimed)
        rebooted = bool(owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"])
        why = "the machine has restarted since" if rebooted else "that process is no longer running"
        if not _remove_tree_owner_last(claimed):
            log(f"dsplug offload: could not fully remove {claimed}, the stale swap directory left by process "
                f"{owner['pid']} on {owner['host']} ({why}); remove it by hand to free its space")
            continue
        removed.append(original)
        log(f"dsplug offload: removed the stale swap directory {original} ({_human(size)}) left by process "
            f"{owner['pid']} on {owner['host']}: {why}")
    return removed


class SwapDir:
    """A directory private to this process under ``nvme_path``; deleted by :meth:`close` or at exit.

    Before the space check, the swap directories that dead runs of this host left under
    ``nvme_path`` are removed (:func:`reclaim_stale_swap_dirs`); this one records its owner in
    :data:`OWNER_FILE` so that a later run can do the same if this process dies without cleaning up."""

    def __init__(self, nvme_path: Optional[str], key: str, rank: int, needed: int):
        root = check_swap_path(nvme_path, key, needed, reclaim=True)
        self.key = key
        self.needed = needed
        try:
            self.path = tempfile.mkdtemp(prefix=f"{SWAP_DIR_PREFIX}{key}-rank{rank}-pid{os.getpid()}-", dir=root)
        except OSError as err:
            raise SwapError(f"zero_optimization.{key}.nvme_path = {root!r}: cannot create a swap directory there: "
                            f"{err.strerror}") from None
        # runs at close(), when this object is collected, or at interpreter exit, whichever comes first
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.path, True)
        try:
            with open(os.path.join(self.path, OWNER_FILE), "w", encoding="utf-8") as f:
                json.dump(current_owner(), f)
        except OSError as err:
            self.close()
            raise SwapError(f"zero_optimization.{key}.nvme_path = {root!r}: cannot write to the swap directory "
                            f"{self.path}: {err.strerror}") from None

    def swap_file_names(self) -> List[str]:
        """The swap files in the directory now (without the owner file)."""
        return sorted(n for n in os.listdir(self.path) if n != OWNER_FILE)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def closed(self) -> bool:
        return not self._cleanup.alive

    def close(self) -> None:
        self._cleanup()


class SwapFiles:
    """Whole tensors written to and read from files of a :class:`SwapDir` through the async_io op."""

    def __init__(self, swap_dir: SwapDir, aio_config=None):
        from dsplug.op_builder import AsyncIOBuilder

        self.dir = swap_dir
        settings = _aio_settings(aio_config)
        self._ops, self._settings = AsyncIOBuilder().load(), settings
        self.reader = self._ops.aio_handle(*settings)
        self.writers = [self._ops.aio_handle(*settings)]
        self.written: Dict[str, int] = {}  # path -> bytes last written
        self.crc: Dict[str, int] = {}
        self.debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        self._reads: List[Tuple[torch.Tensor, str]] = []
        self._writes: Dict[int, List[torch.Tensor]] = {}  # stream -> tensors kept alive until written
        self.bytes_read = 0
        self.bytes_written = 0

    def path(self, name: str) -> str:
        return self.dir.file(name)

    # ------------------------------------------------------------------ writes
    @property
    def writer(self):
        return self.writers[0]

    def write(self, tensor: torch.Tensor, name: str, stream: int = 0) -> None:
        """Start writing ``tensor`` (CPU, contiguous) to file ``name`` on write stream ``stream``; it
        must not change until :meth:`wait_writes` of that stream."""
        while len(self.writers) <= stream:
            self.writers.append(self._ops.aio_handle(*self._settings))
        path = self.path(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self.debug:
            self.crc[path] = _crc(tensor)
        if path in self.written and self.written[path] > nbytes:
            os.truncate(path, nbytes)
        self.writers[stream].async_pwrite(tensor, path)
        self.written[path] = nbytes
        self._writes.setdefault(stream, []).append(tensor)
        self.bytes_written += nbytes

    def wait_writes(self, stream: Optional[int] = None) -> None:
        """Wait for the writes of ``stream`` (all streams when None)."""
        for s in ([stream] if stream is not None else list(self._writes)):
            if self._writes.pop(s, None):
                self.writers[s].wait()

    # ------------------------------------------------------------------ reads
    def read(self, tensor: torch.Tensor, name: str) -> None:
        """Start reading file ``name`` into ``tensor``; checked and complete after :meth:`wait_reads`."""
        path = self.path(name)
        nbytes = tensor.numel() * tensor.element_size()
        self._check_size(path, nbytes)
        self.reader.async_pread(tensor, path)
        self._reads.append((tensor, path))
        self.bytes_read += nbytes

    def wait_reads(self) -> None:
        if not self._reads:
            return
        reads, self._reads = self._reads, []
        self.reader.wait()
        if self.debug:
            for tensor, path in reads:
                expected = self.crc.get(path)
                if expected is not None and _crc(tensor) != expected:
                    raise SwapCorruptionError(
                        f"swap file {path} is corrupted: the CRC-32 of the {tensor.numel() * tensor.element_size()} "
                        f"bytes read ({_crc(tensor):#010x}) differs from what was written ({expected:#010x}); "
                        f"something else wrote to this run's private swap directory, or the drive returned bad data")

    def read_now(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        self.read(tensor, name)
        self.wait_reads()
        return tensor

    def _check_size(self, path: str, nbytes: int) -> None:
        expected = self.written.get(path)
        if expected is None:
            raise SwapError(f"swap file {path} was never written by this run (nothing to read)")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise SwapCorruptionError(f"swap file {path} has disappeared (it held {expected} bytes): something "
                                      "deleted this run's private swap directory") from None
        if size != expected:
            raise SwapCorruptionError(f"swap file {path} has {size} bytes but {expected} were written to it: it was "
                                      "truncated or overwritten by something else")
        if nbytes != expected:
            raise SwapError(f"swap file {path} holds {expected} bytes, the tensor to read into has {nbytes}")

    def close(self) -> None:
        self.wait_writes()
        self.wait_reads()


def _crc(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return zlib.crc32(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _aio_settings(aio_config) -> tuple:
    """(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism) from the aio section."""
    if aio_config is None:
        from .config import AioConfig

        aio_config = AioConfig()
    return (int(aio_config.block_size), int(aio_config.queue_depth), bool(aio_config.single_submit),
            bool(aio_config.overlap_events), int(aio_config.thread_count))


__all__ = ["SwapDir", "SwapFiles", "SwapError", "SwapCorruptionError", "check_swap_path", "available_bytes",
           "DEBUG_ENV", "OWNER_FILE", "reclaim_stale_swap_dirs", "current_owner", "read_owner", "owner_is_dead"]
