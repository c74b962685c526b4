"""Builder of the async_io op (DeepNVMe's aio_handle)."""
from __future__ import annotations

import sys
from typing import List, Optional

from . import toolchain as tc
from .builder import OpBuilder


class AsyncIOBuilder(OpBuilder):
    """``AsyncIOBuilder().load().aio_handle(...)`` as in DeepSpeed.

    Uses libaio when its header and library are found at build time (``apt-get install
    libaio-dev``), else a portable thread-pool backend; both do O_DIRECT where possible.
    """

    NAME = "async_io"
    EXT_NAME = "async_io_op"
    PACKAGE = "dsplug.ops.aio"
    SOURCES = (("aio/aio_engine.cpp", "-O2"), ("aio/aio_bindings.cpp", "-O1"))
    USES_SIMD = False
    BUILD_SECONDS = 10  # measured: 9 s of CPU

    def libaio(self):
        """(header dir, library dir) of libaio, or (None, None)."""
        if not sys.platform.startswith("linux"):
            return None, None
        header, library = tc.find_libaio()
        return (header, library) if header and library else (None, None)

    def extra_cxx_flags(self) -> List[str]:
        header, _ = self.libaio()
        return ["-DDSPLUG_HAVE_LIBAIO=1", f"-I{header}"] if header else []

    def extra_ldflags(self) -> List[str]:
        _, library = self.libaio()
        return [f"-L{library}", "-laio"] if library else []

    def op_incompatibility(self) -> Optional[str]:
        return None  # the thread-pool backend only needs POSIX pread/pwrite

    def backend_detail(self) -> str:
        header, library = self.libaio()
        if header:
            return "libaio + O_DIRECT"
        found = tc.find_libaio()
        why = "libaio.h not found" if not found[0] else "libaio.so not found"
        return f"thread pool + O_DIRECT ({why}: apt-get install libaio-dev, or point CFLAGS/LDFLAGS at it)"

    def make_module(self, native):
        from dsplug.ops.native.aio import AsyncIOModule

        return AsyncIOModule(native)
