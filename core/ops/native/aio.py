"""DeepNVMe's ``aio_handle`` over the native async_io engine (or the pure-Python fallback).

    h = AsyncIOBuilder().load().aio_handle(block_size=1048576, queue_depth=128,
                                           single_submit=False, overlap_events=False,
                                           intra_op_parallelism=1)
    h.async_pwrite(tensor, "/nvme/t.bin"); h.wait()      # -> 1 (requests completed)
    h.sync_pread(tensor, "/nvme/t.bin")                  # blocking, -> completed count

Tensors are checked here (dense, contiguous, CPU) and the engine gets raw addresses. Files are
checked before anything is queued, so a missing directory, a missing file or a file smaller than
the tensor raises at once with the file name and the sizes; I/O errors of queued requests raise
from ``wait()``. A tensor must not be touched until ``wait()`` returns (the engine writes into or
reads from its memory meanwhile); the handle keeps it alive until then.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from typing import List, Optional, Tuple

import torch

from .tensor_args import check_cpu_tensor

BACKEND_ENV = "DSPLUG_AIO_BACKEND"
BACKENDS = ("auto", "libaio", "threads")
LOCKED_ALIGNMENT = 4096


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"aio_handle: {name} must be a positive integer, got {value!r}")
    return value


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class AioHandle:
    """Reads and writes whole tensors from / to files, blocking or not (DeepNVMe API).

    Arguments as DeepSpeed's aio_handle; ``backend`` (dsplug extension; default
    $DSPLUG_AIO_BACKEND or "auto") picks "libaio" or the "threads" engine of the native op.
    """

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1, *, backend: Optional[str] = None,
                 _ops: Optional["AsyncIOModule"] = None):
        self._block_size = _positive_int("block_size", block_size)
        self._queue_depth = _positive_int("queue_depth", queue_depth)
        self._intra_op_parallelism = _positive_int("intra_op_parallelism", intra_op_parallelism)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        backend = (backend or os.environ.get(BACKEND_ENV) or "auto").strip().lower()
        if backend not in BACKENDS:
            raise ValueError(f"aio_handle: backend {backend!r} is not valid; choose one of {', '.join(BACKENDS)}")
        if _ops is None:
            from dsplug.op_builder import AsyncIOBuilder

            _ops = AsyncIOBuilder().load()
        self._ops = _ops
        self._engine = _ops.engine_class(self._block_size, self._queue_depth, self._single_submit,
                                         self._overlap_events, self._intra_op_parallelism, backend)
        self._pending: List[Tuple[torch.Tensor, str, int, bool, bool]] = []
        self._locked = {}

    # ------------------------------------------------------------------ settings
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    @property
    def backend(self) -> str:
        """"libaio" or "threads" (native engine) or "python" (fallback)."""
        return self._engine.backend

    def __repr__(self) -> str:
        return (f"aio_handle(block_size={self._block_size}, queue_depth={self._queue_depth}, "
                f"single_submit={self._single_submit}, overlap_events={self._overlap_events}, "
                f"intra_op_parallelism={self._intra_op_parallelism}, backend={self.backend!r})")

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _buffer(buffer) -> Tuple[int, int]:
        check_cpu_tensor("buffer", buffer)
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()

    @staticmethod
    def _path(filename) -> str:
        try:
            path = os.fsdecode(os.fspath(filename))
        except TypeError:
            raise TypeError(f"filename must be a str or os.PathLike, got {type(filename).__name__}") from None
        if not path:
            raise ValueError("filename must not be empty")
        return path

    @staticmethod
    def _offset(file_offset) -> int:
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise ValueError(f"file_offset must be a non-negative integer, got {file_offset!r}")
        return file_offset

    @staticmethod
    def _check_readable(path: str, nbytes: int, offset: int) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"cannot read {nbytes} bytes into the tensor: no such file",
                                    path) from None
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "cannot read a tensor from a directory", path)
        if stat.S_ISREG(st.st_mode) and st.st_size < offset + nbytes:
            raise EOFError(f"cannot read {nbytes} bytes at offset {offset} from '{path}': the file has only "
                           f"{st.st_size} bytes, so the read would go {offset + nbytes - st.st_size} bytes past "
                           f"its end (the tensor is larger than the file)")

    @staticmethod
    def _check_writable(path: str, nbytes: int) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"cannot write {nbytes} bytes: directory '{parent}' does not exist",
                                    path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, f"cannot write {nbytes} bytes: the path is a directory", path)

    @staticmethod
    def _target(filename, fd):
        """What a request opens: ``filename``, or, for DeepSpeed's ``fd=`` (a file descriptor the
        caller opened), the same file reopened through ``/proc/self/fd`` (Linux)."""
        if fd is None:
            if filename is None:
                raise TypeError("give the file: filename= (a path) or fd= (an open file descriptor)")
            return filename
        if filename is not None:
            raise TypeError(f"give filename= or fd=, not both (got {filename!r} and fd {fd!r})")
        if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
            raise ValueError(f"fd must be an open file descriptor (a non-negative int), got {fd!r}")
        link = f"/proc/self/fd/{fd}"
        if not os.path.isdir("/proc/self/fd"):
            raise OSError(errno.ENOSYS, "fd= needs /proc/self/fd (Linux) to reopen the file; give filename= instead")
        if not os.path.lexists(link):
            raise OSError(errno.EBADF, f"fd {fd} is not an open file descriptor of this process")
        return link

    def _prepare(self, buffer, filename, file_offset, is_read, fd=None):
        address, nbytes = self._buffer(buffer)
        path, offset = self._path(self._target(filename, fd)), self._offset(file_offset)
        if is_read:
            self._check_readable(path, nbytes, offset)
        else:
            self._check_writable(path, nbytes)
        return address, nbytes, path, offset

    @staticmethod
    def _raise(error, more: int = 0):
        code, message = error
        if more:
            message += f" (and {more} more failed request{'s' if more > 1 else ''})"
        if code == -1:  # END_OF_FILE: the file shrank after it was checked
            raise EOFError(message)
        raise OSError(code, message)

    @staticmethod
    def _validate(buffer, path: str, offset: int, is_read: bool) -> None:
        data = _bytes_of(buffer)
        with open(path, "rb") as f:
            f.seek(offset)
            expected = f.read(len(data))
        if expected != data.tobytes():
            at = next((i for i, (a, b) in enumerate(zip(expected, data)) if a != b), min(len(expected), len(data)))
            raise RuntimeError(f"validation of {'read' if is_read else 'write'} of '{path}' failed: tensor and file "
                               f"differ at byte {at} (of {len(data)}, file offset {offset})")

    # ------------------------------------------------------------------ I/O
    def _submit(self, buffer, filename, file_offset, is_read, validate, fd=None) -> None:
        address, nbytes, path, offset = self._prepare(buffer, filename, file_offset, is_read, fd)
        code, message = self._engine.submit(is_read, address, nbytes, path, offset)
        if code:
            self._raise((code, message))
        self._pending.append((buffer, path, offset, is_read, bool(validate)))

    def wait(self) -> int:
        """Block until every queued read / write is done; returns how many completed."""
        count, errors = self._engine.wait()
        pending, self._pending = self._pending, []
        if errors:
            self._raise(errors[0], len(errors) - 1)
        for buffer, path, offset, is_read, validate in pending:
            if validate:
                self._validate(buffer, path, offset, is_read)
        return count

    @staticmethod
    def _async_flag(async_op, kwargs) -> bool:
        if "async" in kwargs:  # DeepSpeed's keyword, not a valid Python parameter name
            async_op = kwargs.pop("async")
        if kwargs:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(kwargs)}")
        return bool(async_op)

    def pread(self, buffer, filename=None, validate: bool = False, async_op: bool = False, file_offset: int = 0,
              fd: Optional[int] = None, **kwargs) -> int:
        """Read ``filename`` (or the file open as ``fd``) from ``file_offset`` into ``buffer``.
        Non-blocking when async (returns 0; call wait()), else waits and returns the completed count."""
        async_op = self._async_flag(async_op, kwargs)
        self._submit(buffer, filename, file_offset, True, validate, fd)
        return 0 if async_op else self.wait()

    def pwrite(self, buffer, filename=None, validate: bool = False, async_op: bool = False, file_offset: int = 0,
               fd: Optional[int] = None, **kwargs) -> int:
        """Write ``buffer`` to ``filename`` (or the file open as ``fd``) at ``file_offset`` (created
        if missing, not truncated)."""
        async_op = self._async_flag(async_op, kwargs)
        self._submit(buffer, filename, file_offset, False, validate, fd)
        return 0 if async_op else self.wait()

    def sync_pread(self, buffer, filename=None, file_offset: int = 0, fd: Optional[int] = None) -> int:
        return self.pread(buffer, filename, False, False, file_offset, fd)

    def sync_pwrite(self, buffer, filename=None, file_offset: int = 0, fd: Optional[int] = None) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset, fd)

    def async_pread(self, buffer, filename=None, file_offset: int = 0, fd: Optional[int] = None) -> int:
        return self.pread(buffer, filename, False, True, file_offset, fd)

    def async_pwrite(self, buffer, filename=None, file_offset: int = 0, fd: Optional[int] = None) -> int:
        return self.pwrite(buffer, filename, False, True, file_offset, fd)

    def _blocking(self, buffer, filename, validate, file_offset, is_read) -> int:
        address, nbytes, path, offset = self._prepare(buffer, filename, file_offset, is_read)
        error = self._engine.run_blocking(is_read, address, nbytes, path, offset)
        if error[0]:
            self._raise(error)
        if validate:
            self._validate(buffer, path, offset, is_read)
        return 0

    def read(self, buffer, filename, validate: bool = False, file_offset: int = 0) -> int:
        """Blocking read on the calling thread, outside the queue (returns 0)."""
        return self._blocking(buffer, filename, validate, file_offset, True)

    def write(self, buffer, filename, validate: bool = False, file_offset: int = 0) -> int:
        """Blocking write on the calling thread, outside the queue (returns 0)."""
        return self._blocking(buffer, filename, validate, file_offset, False)

    # ------------------------------------------------------------------ locked buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype whose memory is
        4 KiB-aligned (so I/O on it uses O_DIRECT) and, when the OS allows, locked in RAM (mlock)."""
        if isinstance(num_elem, bool) or not isinstance(num_elem, int) or num_elem < 0:
            raise ValueError(f"num_elem must be a non-negative integer, got {num_elem!r}")
        if not isinstance(example_tensor, torch.Tensor):
            raise TypeError(f"example_tensor must be a torch.Tensor, got {type(example_tensor).__name__}")
        itemsize = example_tensor.element_size()
        nbytes = num_elem * itemsize
        raw = torch.empty(nbytes + LOCKED_ALIGNMENT, dtype=torch.uint8)
        pad = (-raw.data_ptr()) % LOCKED_ALIGNMENT
        tensor = raw[pad:pad + nbytes].view(example_tensor.dtype)
        if nbytes and self._ops.lock_memory(tensor.data_ptr(), nbytes):
            self._locked[tensor.data_ptr()] = nbytes
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Unlock a tensor from new_cpu_locked_tensor (its memory is freed with the tensor)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        nbytes = self._locked.pop(tensor.data_ptr(), None)
        if nbytes is not None:
            self._ops.unlock_memory(tensor.data_ptr(), nbytes)
        return True


class AsyncIOModule:
    """What ``AsyncIOBuilder().load()`` returns: ``aio_handle(...)`` plus DeepSpeed's
    ``aio_read`` / ``aio_write`` helpers."""

    def __init__(self, native=None):
        self.native = native
        if native is not None:
            self.engine_class = native.AioEngine
            self.lock_memory, self.unlock_memory = native.lock_memory, native.unlock_memory
        else:
            from . import aio_fallback

            self.engine_class = aio_fallback.PyAioEngine
            self.lock_memory, self.unlock_memory = aio_fallback.lock_memory, aio_fallback.unlock_memory

    @property
    def is_native(self) -> bool:
        return self.native is not None

    @property
    def libaio_compiled(self) -> bool:
        return bool(self.native is not None and self.native.libaio_compiled())

    def __repr__(self) -> str:
        kind = ("native, libaio" if self.libaio_compiled else "native, thread pool") if self.native else "python fallback"
        return f"<async_io op: {kind}>"

    def aio_handle(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                   overlap_events: bool = False, intra_op_parallelism: int = 1, *,
                   backend: Optional[str] = None) -> AioHandle:
        return AioHandle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism,
                         backend=backend, _ops=self)

    def aio_read(self, buffer, filename, block_size=1048576, queue_depth=128, single_submit=False,
                 overlap_events=False, validate=False) -> int:
        return self.aio_handle(block_size, queue_depth, single_submit, overlap_events).read(buffer, filename, validate)

    def aio_write(self, buffer, filename, block_size=1048576, queue_depth=128, single_submit=False,
                  overlap_events=False, validate=False) -> int:
        return self.aio_handle(block_size, queue_depth, single_submit, overlap_events).write(buffer, filename, validate)
