"""``optimizer.params`` schemas of the three 1-bit optimizers (DeepSpeed's arguments and defaults)."""
from __future__ import annotations

from typing import Tuple

from dsplug.config.params import betas_check, cross_checks, given
from dsplug.config.schema import MAX_LR, field, schema

_BACKENDS = ("nccl", "mpi", "gloo", "hccl", "ccl", "compressed")
_BACKEND_INERT = ("dsplug always communicates through its comm layer's process group (gloo on CPU, NCCL on "
                  "CUDA); the compressed all-reduce is dsplug's own")
_CUDA_AWARE_INERT = "dsplug moves tensors as its comm backend needs; CUDA-aware MPI is not used"
_IGNORED = "DeepSpeed's 1-bit optimizers accept and ignore it; use gradient_clipping / eps"


def _no_amsgrad(value):
    return "the 1-bit optimizers do not support the AMSGrad variant; remove amsgrad" if value else None


def _ordered(low_key: str, high_key: str, low_default: float, high_default: float, meaning: str):
    def check(data):
        low, high = given(data, low_key, (int, float)), given(data, high_key, (int, float))
        low = low_default if low is None and low_key not in data else low
        high = high_default if high is None and high_key not in data else high
        if low is not None and high is not None and low > high:
            return (low_key, f"{low_key} ({low}) must not exceed {high_key} ({high}): they bound {meaning}")
        return None

    return check


@schema
class _OneBitCommon:
    """The keys every 1-bit optimizer takes."""

    lr: float = field(1e-3, ge=0, le=MAX_LR, auto=True, doc="learning rate (<= 1e6, dsplug.config.schema.MAX_LR)")
    betas: Tuple[float, float] = field((0.9, 0.999), auto=True, check=betas_check,
                                       doc="decay rates of the first and second moment averages")
    eps: float = field(1e-8, ge=0, auto=True, doc="added to the denominator sqrt(v) + eps")
    weight_decay: float = field(0.0, ge=0, auto=True, doc="decoupled weight decay (p <- p * (1 - lr * wd))")
    bias_correction: bool = field(True, doc="divide the moments by (1 - beta^t) (DeepSpeed ignores it; dsplug "
                                            "applies it, so the warm-up equals AdamW / Lamb)")
    amsgrad: bool = field(False, check=_no_amsgrad, doc="not supported (must be false)")
    eps_inside_sqrt: bool = field(False, inert=_IGNORED, doc="accepted for DeepSpeed configs; no effect")
    max_grad_norm: float = field(0.0, ge=0, inert=_IGNORED, doc="accepted for DeepSpeed configs; no effect")
    cuda_aware: bool = field(False, inert=_CUDA_AWARE_INERT, doc="accepted for DeepSpeed configs; no effect")
    comm_backend_name: str = field("nccl", choices=_BACKENDS, case_insensitive=True, inert=_BACKEND_INERT,
                                   doc="accepted for DeepSpeed configs; dsplug uses its comm layer's backend")


@schema
class OneBitAdamParams(_OneBitCommon):
    """``optimizer.params`` for ``"type": "OneBitAdam"`` (DeepSpeed's OnebitAdam arguments)."""

    freeze_step: int = field(100000, ge=0, doc="warm-up steps of plain AdamW training before the variance "
                                                "freezes and the momentum is communicated in 1 bit")


@schema
class ZeroOneAdamParams(_OneBitCommon):
    """``optimizer.params`` for ``"type": "ZeroOneAdam"`` (DeepSpeed's ZeroOneAdam arguments)."""

    var_freeze_step: int = field(100000, ge=0, doc="the variance is updated (on an exponentially spaced schedule) "
                                                    "up to this step, then frozen and local steps begin")
    var_update_scaler: int = field(16, ge=1, doc="variance updates per interval: the interval between them "
                                                 "starts at 1 and doubles after every var_update_scaler updates")
    local_step_scaler: int = field(32678, ge=1, doc="after the variance freezes, the number of steps after which "
                                                    "the local-step interval doubles")
    local_step_clipper: int = field(16, ge=1, doc="the largest local-step interval (steps between synchronisations)")


@schema
class OneBitLambParams(_OneBitCommon):
    """``optimizer.params`` for ``"type": "OneBitLamb"`` (DeepSpeed's OnebitLamb arguments)."""

    weight_decay: float = field(0.0, ge=0, auto=True, doc="weight decay added to the update before the trust ratio")
    freeze_step: int = field(100000, ge=0, doc="warm-up steps of plain LAMB training before the variance and "
                                                "the trust ratio freeze and the momentum is communicated in 1 bit")
    max_coeff: float = field(10.0, ge=0, doc="upper bound of the warm-up trust ratio ||w|| / ||update||")
    min_coeff: float = field(0.01, ge=0, doc="lower bound of the warm-up trust ratio ||w|| / ||update||")
    coeff_beta: float = field(0.9, ge=0, lt=1, doc="decay of the running average of the trust ratio, frozen "
                                                   "after the warm-up")
    factor_max: float = field(4.0, ge=0, doc="largest factor applied to the frozen trust ratio")
    factor_min: float = field(0.5, ge=0, doc="smallest factor applied to the frozen trust ratio")
    factor_threshold: float = field(0.1, ge=0, doc="largest relative change of that factor from one step to the next")

    __rules__ = cross_checks(_ordered("min_coeff", "max_coeff", 0.01, 10.0, "the trust ratio"),
                             _ordered("factor_min", "factor_max", 0.5, 4.0, "the trust-ratio factor"))
