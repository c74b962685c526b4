"""Pure-Python engine of the async_io op, used when the native op cannot be built.

Same interface as the C++ ``AioEngine`` (submit / wait / run_blocking on raw buffer addresses),
implemented with os.pread / os.pwrite on a thread pool (they release the GIL). Always buffered
I/O: no O_DIRECT, no libaio.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Tuple

DIRECT_IO_ALIGNMENT = 4096
END_OF_FILE = -1


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class _Request:
    def __init__(self, is_read, address, nbytes, filename, file_offset, fd, slices):
        self.is_read, self.address, self.nbytes = is_read, address, nbytes
        self.filename, self.file_offset, self.fd = filename, file_offset, fd
        self.pending = slices
        self.error: Tuple[int, str] = (0, "")
        self.lock = threading.Lock()

    def describe(self, offset, length):
        return (f"{'read' if self.is_read else 'write'} of {length} bytes at file offset {self.file_offset + offset} "
                f"{'from' if self.is_read else 'to'} '{self.filename}'")


class PyAioEngine:
    backend = "python"

    def __init__(self, block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism, backend="auto"):
        if backend not in ("auto", "threads", "python"):
            raise RuntimeError(f"aio backend {backend!r} is not available: the native async_io op is not built "
                               f"(pure-Python fallback only supports 'auto')")
        self.block_size = int(block_size)
        self.parallelism = int(intra_op_parallelism)
        self._pool = ThreadPoolExecutor(max_workers=self.parallelism, thread_name_prefix="dsplug-aio")
        self._cv = threading.Condition()
        self._submitted = self._completed = self._reported = 0
        self._errors: List[Tuple[int, str]] = []

    def _open(self, is_read, filename):
        flags = os.O_RDONLY if is_read else (os.O_WRONLY | os.O_CREAT)
        try:
            return os.open(filename, flags | getattr(os, "O_CLOEXEC", 0), 0o644), (0, "")
        except OSError as err:
            verb = "reading" if is_read else "writing"
            return None, (err.errno or 5, f"cannot open '{filename}' for {verb}: {err.strerror}")

    def _do_range(self, r: _Request, begin: int, end: int) -> None:
        view = _view(r.address, r.nbytes) if r.nbytes else memoryview(b"")
        off = begin
        while off < end:
            length = min(self.block_size, end - off)
            try:
                if r.is_read:
                    n = os.preadv(r.fd, [view[off:off + length]], r.file_offset + off)
                else:
                    n = os.pwrite(r.fd, view[off:off + length], r.file_offset + off)
            except OSError as err:
                self._fail(r, (err.errno or 5, f"{r.describe(off, length)} failed: {err.strerror}"))
                return
            if n == 0:
                self._fail(r, (END_OF_FILE if r.is_read else 5,
                               r.describe(off, end - off) + (" hit the end of the file" if r.is_read else " wrote nothing")))
                return
            off += n

    @staticmethod
    def _fail(r: _Request, error):
        with r.lock:
            if not r.error[0]:
                r.error = error

    def _run_slice(self, r: _Request, begin: int, end: int) -> None:
        try:
            if not r.error[0]:
                self._do_range(r, begin, end)
        finally:
            with r.lock:
                r.pending -= 1
                last = r.pending == 0
            if last:
                os.close(r.fd)
                with self._cv:
                    self._completed += 1
                    if r.error[0]:
                        self._errors.append(r.error)
                    self._cv.notify_all()

    def submit(self, is_read, address, nbytes, filename, file_offset):
        fd, error = self._open(is_read, filename)
        if fd is None:
            return error
        size = max(DIRECT_IO_ALIGNMENT, -(-nbytes // self.parallelism))
        bounds = [(b, min(nbytes, b + size)) for b in range(0, nbytes, size)] or [(0, 0)]
        r = _Request(is_read, address, nbytes, filename, file_offset, fd, len(bounds))
        with self._cv:
            self._submitted += 1
        for begin, end in bounds:
            self._pool.submit(self._run_slice, r, begin, end)
        return (0, "")

    def wait(self):
        with self._cv:
            self._cv.wait_for(lambda: self._completed == self._submitted)
            count = self._completed - self._reported
            self._reported = self._completed
            errors, self._errors = self._errors, []
        return count, errors

    def run_blocking(self, is_read, address, nbytes, filename, file_offset):
        fd, error = self._open(is_read, filename)
        if fd is None:
            return error
        r = _Request(is_read, address, nbytes, filename, file_offset, fd, 1)
        try:
            self._do_range(r, 0, nbytes)
        finally:
            os.close(fd)
        return r.error

    def __del__(self):
        try:
            self.wait()
            self._pool.shutdown(wait=True)
        except Exception:  # interpreter shutdown
            pass


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def lock_memory(address: int, nbytes: int) -> bool:
    libc = _libc()
    return bool(libc) and libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0


def unlock_memory(address: int, nbytes: int) -> bool:
    libc = _libc()
    return bool(libc) and libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0
