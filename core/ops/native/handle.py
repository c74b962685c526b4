"""What every loaded native op object shares: which backend runs it, and the thread count rule."""
from __future__ import annotations

from typing import Optional


class NativeOpHandle:
    """A loaded op: the native extension module, or ``None`` when the pure-torch fallback runs."""

    op_name = ""

    def __init__(self, native=None):
        self.native = native

    @property
    def is_native(self) -> bool:
        return self.native is not None

    @property
    def isa(self) -> str:
        """SIMD path of the native build ("avx512", "avx2", "scalar") or "torch"."""
        return self.native.simd_isa() if self.native is not None else "torch"

    @property
    def threads(self) -> str:
        """Whose threads run the kernel: ``"openmp team (<runtime>)"`` (torch's, see
        csrc/includes/dsplug_omp_team.h), ``"own threads"``, or ``"torch"`` (the fallback)."""
        if self.native is None:
            return "torch"
        library = getattr(self.native, "omp_team_library", lambda: "")()
        return f"openmp team ({library.rsplit('/', 1)[-1]})" if library else "own threads"

    @property
    def backend(self) -> str:
        return f"native ({self.isa})" if self.native is not None else "torch fallback"

    def __repr__(self) -> str:
        return f"<{self.op_name} op: {self.backend}>"


def thread_count(num_threads: Optional[int]) -> int:
    """Threads a native kernel uses: torch's intra-op count unless given (then at least 1)."""
    if num_threads is None:
        import torch

        return torch.get_num_threads()
    if int(num_threads) < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    return int(num_threads)
