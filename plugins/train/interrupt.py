"""Ctrl-C in ``dsplug train``: finish the step, save a checkpoint, print the resume command, exit 130.

The first SIGINT only sets a flag (and rank 0 says so at once, with ``os.write``, which is safe
wherever the signal lands). The loop asks :meth:`Interrupt.agreed` at every step boundary; on
several processes that all-reduces the flag (MAX), so every rank stops, and saves, after the same
step, even a rank whose signal came a moment later or not at all. A second SIGINT raises
:class:`KeyboardInterrupt` at once: no checkpoint.

Under ``--nproc N`` the terminal's Ctrl-C reaches the launcher, which passes one SIGINT to
torchrun, which passes it to every worker (:func:`dsplug.plugins.launcher.execute`); a second
Ctrl-C there kills the workers.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

#: The exit status of a run stopped by Ctrl-C (what a shell reports for SIGINT).
EXIT_INTERRUPTED = 128 + int(signal.SIGINT)

FIRST_NOTICE = ("\ndsplug train: Ctrl-C: stopping after this step to save a checkpoint "
                "(press Ctrl-C again to quit at once, without it)\n")


class Interrupt:
    """The SIGINT handler of a training run; :meth:`install` it, ask :meth:`agreed` at step boundaries."""

    def __init__(self, announce: bool = True):
        self.requested = False
        self.announce = announce
        self._previous = None
        self._installed = False

    def install(self) -> "Interrupt":
        """Handle SIGINT from now on (only in the main thread, and not where SIGINT is ignored, as
        for a background job of a non-interactive shell)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            return self
        self._previous = signal.signal(signal.SIGINT, self._handle)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False

    def _handle(self, _signum, _frame) -> None:
        if self.requested:
            self.uninstall()
            raise KeyboardInterrupt
        self.requested = True
        if self.announce:
            try:
                os.write(sys.stderr.fileno(), FIRST_NOTICE.encode())
            except (OSError, ValueError, AttributeError):  # no usable stderr (captured, closed)
                pass

    def agreed(self, engine) -> bool:
        """Whether any rank was asked to stop; a collective on several processes (every rank calls it
        at the same step boundary)."""
        if engine.world_size <= 1:
            return self.requested
        import torch

        from dsplug import comm

        flag = torch.tensor([1.0 if self.requested else 0.0], device=engine.device)
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        return bool(flag.item())
