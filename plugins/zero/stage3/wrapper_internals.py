"""The internals of DeepSpeed's ZeRO-3 optimizer that stage 3 answers through ``engine.optimizer``.

DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3`` is ``engine.optimizer`` there, and scripts and
DeepSpeed's own tests read this rank's gradient partitions from it after ``backward()``. dsplug's
stage keeps the same partitions (reduced, accumulated over the micro-steps until the step clears
them), so :class:`Stage3WrapperInternals` hands them out under DeepSpeed's names, as the stage's
``wrapper_internals`` (see :class:`dsplug.optimizer_view.WrappedOptimizer`).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


class Stage3WrapperInternals:
    def __init__(self, stage) -> None:
        self._stage = stage

    def _partition(self, gi: int, i: int) -> Optional[torch.Tensor]:
        stage = self._stage
        grp = stage.groups[gi]
        if grp.grad_views and grp.grad_views[i] is None:  # a swapped sub-group (offload_optimizer on nvme)
            grads = stage.store.grads
            piece = grads.piece(gi, i) if grads.has_gradients() else None
        else:
            piece = grp.grad_views[i] if grp.grad is not None else None
        return piece.float() if piece is not None else None

    def get_fp32_grad_partitions(self) -> Dict[int, Dict[int, torch.Tensor]]:
        """``{param group: {index in the group: this rank's gradient partition}}`` in fp32, as
        DeepSpeed's. A partition kept in fp32 is the stage's own tensor; one accumulated in 16 bits
        (or swapped out) is an fp32 copy."""
        out: Dict[int, Dict[int, torch.Tensor]] = {}
        for gi, grp in enumerate(self._stage.groups):
            pieces = {i: self._partition(gi, i) for i in range(len(grp.params))}
            pieces = {i: t for i, t in pieces.items() if t is not None}
            if pieces:
                out[gi] = pieces
        return out

    @property
    def averaged_gradients(self) -> Dict[int, List[torch.Tensor]]:
        """``{param group: [this rank's gradient partition of each parameter]}`` (DeepSpeed's name)."""
        return {gi: [pieces[i] for i in sorted(pieces)] for gi, pieces in self.get_fp32_grad_partitions().items()}
