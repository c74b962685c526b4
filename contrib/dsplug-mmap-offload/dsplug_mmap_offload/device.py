"""The ``mmap`` offload device: each stored tensor is a file mapped into memory.

``allocate(name, numel, dtype)`` creates ``<dir>/<name>.bin`` of the tensor's size and maps it
shared (``torch.UntypedStorage.from_file(path, shared=True)``), so the tensor handed out *is*
the file's contents: the ZeRO stage's CPU optimizer updates it in place (byte-addressable),
and the OS writes dirty pages back and may drop clean ones when memory is short.

``<dir>`` is a directory private to this process, ``dsplug-mmap-<section>-rank<r>-pid<pid>-*``
under the section's ``nvme_path`` (the system's temporary directory when unset), made on the
first :meth:`~MmapOffload.reserve` or :meth:`~MmapOffload.allocate` after checking the free
space, and removed by :meth:`~MmapOffload.close` (``engine.destroy()``) or at interpreter exit.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Optional

from dsplug.contracts.offload import BYTE_ADDRESSABLE, OffloadDevice, OffloadError, Stored


class MmapOffload(OffloadDevice):
    name = "mmap"
    capabilities = frozenset({BYTE_ADDRESSABLE})

    def __init__(self, config, context):
        super().__init__(config, context)
        self.dir: Optional[str] = None
        self._cleanup = None

    # ------------------------------------------------------------------ the directory
    def root(self) -> str:
        path = getattr(self.config, "nvme_path", None)
        return os.path.abspath(os.path.expanduser(os.fspath(path))) if path else tempfile.gettempdir()

    def _free_bytes(self, path: str) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def reserve(self, nbytes: int) -> None:
        root = self.dir or self.root()
        if not os.path.isdir(root):
            raise OffloadError(f"{self.config_path}.nvme_path = {root!r} is not a directory: the mmap device keeps "
                               "its files there (create it, or leave nvme_path unset for the temporary directory)")
        free = self._free_bytes(root)
        if nbytes > free:
            raise OffloadError(f"{self.config_path}.nvme_path = {root!r}: the mmap device needs {nbytes} more bytes "
                               f"of files but only {free} are available there")
        if self.dir is None:
            key = self.config_path.rsplit(".", 1)[-1].replace(" ", "_")
            try:
                self.dir = tempfile.mkdtemp(prefix=f"dsplug-mmap-{key}-rank{self.rank}-pid{os.getpid()}-", dir=root)
            except OSError as err:
                raise OffloadError(f"{self.config_path}.nvme_path = {root!r}: cannot create a directory there: "
                                   f"{err.strerror}") from None
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    # ------------------------------------------------------------------ storage
    def allocate(self, name: str, numel: int, dtype) -> Stored:
        import torch

        numel = int(numel)
        nbytes = numel * dtype.itemsize
        if self.dir is None:
            self.reserve(nbytes)
        path = os.path.join(self.dir, f"{name}.bin")
        if os.path.exists(path):
            raise OffloadError(f"{self.config_path}: {name!r} is already stored on device 'mmap' (free it first)")
        if nbytes == 0:
            return Stored(name, 0, dtype, tensor=torch.empty(0, dtype=dtype), token=None)
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)  # creates the file, mapped
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))
        return Stored(name, numel, dtype, tensor=tensor, token=path)

    def free(self, stored: Stored) -> None:
        stored.tensor = None
        if stored.token is not None:
            try:
                os.unlink(stored.token)
            except FileNotFoundError:
                pass
            stored.token = None

    def location(self, stored: Stored) -> Optional[str]:
        return stored.token

    def close(self) -> None:
        """Remove the directory (mappings still referenced stay valid until released)."""
        if self._cleanup is not None:
            self._cleanup()
