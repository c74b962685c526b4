"""``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world``."""
from __future__ import annotations

from typing import Optional, Tuple

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


class BatchError(ValueError):
    pass


def infer_batch(
    train_batch: Optional[int], micro_batch: Optional[int], accumulation: Optional[int], world_size: int
) -> Tuple[int, int, int]:
    """Fill in the missing member(s) of the batch triple, or explain why they cannot be.

    Same inference as DeepSpeed: any two determine the third; ``train_batch_size`` alone means no
    accumulation; ``train_micro_batch_size_per_gpu`` alone likewise.
    """
    if world_size < 1:
        raise BatchError(f"world size must be >= 1, got {world_size}")
    tb, mb, gas, w = train_batch, micro_batch, accumulation, world_size
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * w:
            raise BatchError(
                f"{TB}={tb} is not {MB}={mb} × {GAS}={gas} × world size {w} (= {mb * gas * w}); "
                f"give two of the three and the third is inferred"
            )
    elif tb is not None and mb is not None:
        if tb % (mb * w):
            raise BatchError(
                f"{TB}={tb} is not divisible by {MB}={mb} × world size {w} (= {mb * w}), so "
                f"{GAS} cannot be inferred"
            )
        gas = tb // (mb * w)
    elif tb is not None and gas is not None:
        if tb % (gas * w):
            raise BatchError(
                f"{TB}={tb} is not divisible by {GAS}={gas} × world size {w} (= {gas * w}), so "
                f"{MB} cannot be inferred"
            )
        mb = tb // (gas * w)
    elif mb is not None and gas is not None:
        tb = mb * gas * w
    elif tb is not None:
        if tb % w:
            raise BatchError(f"{TB}={tb} is not divisible by world size {w}, so {MB} cannot be inferred")
        gas, mb = 1, tb // w
    elif mb is not None:
        gas, tb = 1, mb * w
    else:
        raise BatchError(f"set {TB} or {MB} (any two of {TB}, {MB}, {GAS} determine the third)")
    if min(tb, mb, gas) < 1:
        raise BatchError(f"batch sizes must be >= 1: {TB}={tb}, {MB}={mb}, {GAS}={gas}, world size {w}")
    return tb, mb, gas


def implied_world_size(train_batch: int, micro_batch: int, accumulation: int) -> Optional[int]:
    """The world size a fully given triple implies, or None when it implies none."""
    per_rank = micro_batch * accumulation
    if per_rank <= 0 or train_batch % per_rank:
        return None
    return train_batch // per_rank
