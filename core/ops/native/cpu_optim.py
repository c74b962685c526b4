"""The cpu_adam / cpu_adagrad / cpu_lion ops as Python callables.

Each kernel object wraps the native extension when it was built, else runs the same arithmetic
with torch (the fallback). Both paths compute in fp32 and round stored bf16 / fp16 values to
nearest even, so they agree to fp32 rounding (tests/core/test_ops_cpu_optim.py proves it).

Supported storage (the C++ kernels are instantiated for exactly these):
    param / grad   float32            bfloat16           float16
    moments        float32, bfloat16  float32, bfloat16  float32, float16
    output copy    float32, bfloat16, float16 (float32 params only)
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .handle import NativeOpHandle, thread_count
from .tensor_args import DTYPE_CODES, NO_OUTPUT, check_cpu_tensor

STATE_DTYPES = {
    torch.float32: (torch.float32, torch.bfloat16),
    torch.bfloat16: (torch.float32, torch.bfloat16),
    torch.float16: (torch.float32, torch.float16),
}
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_update_args(param, grad, states: Dict[str, torch.Tensor], out=None):
    """Validate one update's tensors; returns (numel, param code, state code, output code)."""
    check_cpu_tensor("param", param, dtypes=DTYPE_CODES)
    n = param.numel()
    check_cpu_tensor("grad", grad, numel=n)
    if grad.dtype != param.dtype:
        raise TypeError(f"grad has dtype {grad.dtype} but param has {param.dtype}; they must match")
    state_dtype = None
    first = None
    for name, tensor in states.items():
        check_cpu_tensor(name, tensor, dtypes=STATE_DTYPES[param.dtype], numel=n)
        if state_dtype is None:
            state_dtype, first = tensor.dtype, name
        elif tensor.dtype != state_dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but {first} has {state_dtype}; moments must share a dtype")
    out_code = NO_OUTPUT
    if out is not None:
        if param.dtype != torch.float32:
            raise ValueError(f"out (the lower-precision copy of the updated param) needs float32 params; "
                             f"param has dtype {param.dtype}")
        check_cpu_tensor("out", out, dtypes=OUTPUT_DTYPES, numel=n)
        out_code = DTYPE_CODES[out.dtype]
    return n, DTYPE_CODES[param.dtype], DTYPE_CODES[state_dtype], out_code


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when fp32 (updated in place), else an fp32 copy."""
    return t if t.dtype == torch.float32 else t.float()


def _store(dst: torch.Tensor, value: torch.Tensor) -> None:
    if dst is not value:
        dst.copy_(value)  # fp32 -> bf16 / fp16 rounds to nearest even


class CPUOptimizerKernel(NativeOpHandle):
    """Common part: which backend runs the update."""


class AdamKernel(CPUOptimizerKernel):
    op_name = "cpu_adam"

    def adam_update(self, param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                    bias_correction: bool = True, adamw_mode: bool = True, out=None,
                    num_threads: Optional[int] = None) -> None:
        """One Adam (adamw_mode=False: L2 decay added to the gradient) or AdamW (decoupled decay)
        step, in place. ``out`` receives a copy of the new param (bf16 / fp16) in the same pass."""
        n, p_code, s_code, o_code = check_update_args(param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, out)
        if int(step) < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if self.native is not None:
            self.native.adam_step(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                  _ptr(out), n, p_code, s_code, o_code, float(lr), float(beta1), float(beta2),
                                  float(eps), float(weight_decay), int(step), bool(bias_correction),
                                  bool(adamw_mode), thread_count(num_threads))
            return
        if bias_correction and _fused_adam_applies(param, grad, exp_avg, exp_avg_sq):
            fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
            with torch.no_grad():
                fused([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=float(lr),
                      beta1=float(beta1), beta2=float(beta2), weight_decay=float(weight_decay), eps=float(eps),
                      amsgrad=False, maximize=False)
                if out is not None:
                    out.copy_(param)
            return
        with torch.no_grad():
            p, g, m, v = _fp32(param), _fp32(grad), _fp32(exp_avg), _fp32(exp_avg_sq)
            if weight_decay != 0 and not adamw_mode:
                g = g.add(p, alpha=weight_decay)
            if weight_decay != 0 and adamw_mode:
                p.mul_(1.0 - lr * weight_decay)
            bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
            bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
            m.lerp_(g, 1.0 - beta1)  # = beta1*m + (1-beta1)*g
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
            for dst, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
                _store(dst, value)
            if out is not None:
                out.copy_(p)


def _fused_adam_applies(*tensors) -> bool:
    """torch's fused Adam kernel (one pass, vectorised) serves the fallback when every tensor is fp32:
    the same arithmetic as below to fp32 rounding, several times faster."""
    return hasattr(torch, "_fused_adamw_") and all(t.dtype == torch.float32 for t in tensors)


class AdagradKernel(CPUOptimizerKernel):
    op_name = "cpu_adagrad"

    def adagrad_update(self, param, grad, state_sum, *, step: int, lr: float, eps: float = 1e-10,
                       weight_decay: float = 0.0, lr_decay: float = 0.0, out=None,
                       num_threads: Optional[int] = None) -> None:
        """One Adagrad step in place, as torch.optim.Adagrad (weight decay added to the gradient,
        lr / (1 + (step - 1) * lr_decay))."""
        n, p_code, s_code, o_code = check_update_args(param, grad, {"state_sum": state_sum}, out)
        if int(step) < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if self.native is not None:
            self.native.adagrad_step(param.data_ptr(), grad.data_ptr(), state_sum.data_ptr(), _ptr(out), n, p_code,
                                     s_code, o_code, float(lr), float(eps), float(weight_decay), float(lr_decay),
                                     int(step), thread_count(num_threads))
            return
        with torch.no_grad():
            p, g, s = _fp32(param), _fp32(grad), _fp32(state_sum)
            if weight_decay != 0:
                g = g.add(p, alpha=weight_decay)
            clr = lr / (1.0 + (step - 1) * lr_decay)
            s.addcmul_(g, g, value=1.0)
            std = s.sqrt().add_(eps)
            p.addcdiv_(g, std, value=-clr)
            _store(param, p)
            _store(state_sum, s)
            if out is not None:
                out.copy_(p)


class LionKernel(CPUOptimizerKernel):
    op_name = "cpu_lion"

    def lion_update(self, param, grad, exp_avg, *, lr: float, beta1: float = 0.9, beta2: float = 0.99,
                    weight_decay: float = 0.0, out=None, num_threads: Optional[int] = None) -> None:
        """One Lion step in place: p = p * (1 - lr*wd) - lr * sign(b1*m + (1-b1)*g);
        m = b2*m + (1-b2)*g."""
        n, p_code, s_code, o_code = check_update_args(param, grad, {"exp_avg": exp_avg}, out)
        if self.native is not None:
            self.native.lion_step(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), _ptr(out), n, p_code, s_code,
                                  o_code, float(lr), float(beta1), float(beta2), float(weight_decay),
                                  thread_count(num_threads))
            return
        with torch.no_grad():
            p, g, m = _fp32(param), _fp32(grad), _fp32(exp_avg)
            update = torch.sign(m * beta1 + g * (1.0 - beta1))  # two products, as the native kernel
            if weight_decay != 0:
                p.mul_(1.0 - lr * weight_decay)
            p.add_(update, alpha=-lr)
            m.copy_(m * beta2 + g * (1.0 - beta2))
            _store(param, p)
            _store(exp_avg, m)
            if out is not None:
                out.copy_(p)
