"""Base of the DeepSpeed CPU optimizers (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion).

Each is a ``torch.optim.Optimizer`` whose ``step()`` calls its native op once per parameter
(one pass over that parameter's memory), or the op's pure-torch fallback when the op cannot be
built. Extras over DeepSpeed's classes, all keyword-only and off by default:

* ``moment_dtype="bf16"`` keeps the moments in bfloat16 (rounded to nearest even), cutting the
  bytes each step moves from 28 to 20 per fp32 parameter.
* ``num_threads``: threads of the native op (default: ``torch.get_num_threads()`` at each step).

``step(closure=None, fp16_param_groups=None)`` as DeepSpeed: ``fp16_param_groups`` (a tensor, a
list of tensors for one group, or a list of lists, one per group) receives a bf16 / fp16 copy of
each updated parameter in the same pass over memory.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .. import lazy_dynamo

lazy_dynamo.install()  # building an optimizer no longer imports torch._dynamo (2 s)

MOMENT_DTYPES = {
    None: None, "fp32": None, "float32": None, "float": None, torch.float32: None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
}


def parse_moment_dtype(value) -> Optional[torch.dtype]:
    key = value.lower() if isinstance(value, str) else value
    if key not in MOMENT_DTYPES:
        raise ValueError(f"moment_dtype={value!r} is not supported; use None/'fp32' (default) or 'bf16'")
    return MOMENT_DTYPES[key]


def check_hyper(name: str, value, low: float = 0.0, high: Optional[float] = None, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        bound = f" and {'<' if high_open else '<='} {high}" if high is not None else ""
        raise ValueError(f"invalid {name}: {value!r} (must be a number >= {low}{bound})")


def check_betas(betas) -> None:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"invalid betas: {betas!r} (must be a pair (beta1, beta2))") from None
    check_hyper("betas[0]", b1, 0.0, 1.0, high_open=True)
    check_hyper("betas[1]", b2, 0.0, 1.0, high_open=True)


class DeepSpeedCPUOptimizer(torch.optim.Optimizer):
    """Shared machinery; subclasses set BUILDER, STATE_KEYS and implement ``_update``."""

    BUILDER = None  # OpBuilder subclass of the op
    STATE_KEYS: Sequence[str] = ()  # moment tensors in self.state[p]
    STATE_ALIASES: Dict[str, str] = {}  # other optimizers' names for the same state (load_state_dict)
    SPARSE_GRADIENTS = False  # whether _update takes a sparse gradient (e.g. nn.Embedding(sparse=True))

    def __init__(self, params, defaults, *, fp32_optimizer_states: bool = True, moment_dtype=None,
                 num_threads: Optional[int] = None):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        self.moment_dtype = parse_moment_dtype(moment_dtype)
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer or None, got {num_threads!r}")
        self.num_threads = num_threads
        self.op = self.BUILDER().load()  # native, or the fallback with one warning

    # ------------------------------------------------------------------ state
    def state_dtype(self, param: torch.Tensor) -> torch.dtype:
        if self.moment_dtype is not None:
            if param.dtype == torch.float16:
                raise ValueError("moment_dtype='bf16' is not supported with float16 parameters "
                                 "(use fp32 or bf16 parameters, or moment_dtype=None)")
            return self.moment_dtype
        if param.dtype == torch.float32 or self.fp32_optimizer_states:
            return torch.float32
        return param.dtype

    def _init_state(self, param: torch.Tensor, group: dict, key=None) -> dict:
        state = self.state[param if key is None else key]
        state["step"] = 0
        for key in self.STATE_KEYS:
            state[key] = torch.zeros(param.shape, dtype=self.state_dtype(param), device="cpu")
        return state

    def _check_param(self, param: torch.Tensor, where: str) -> None:
        if param.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} updates CPU parameters only; {where} is on {param.device} "
                             f"(offload the optimizer to the CPU, e.g. ZeRO 'offload_optimizer': {{'device': 'cpu'}})")
        if param.grad.is_sparse and not self.SPARSE_GRADIENTS:
            raise ValueError(f"{type(self).__name__} does not support sparse gradients ({where})")
        if not param.is_contiguous():
            raise ValueError(f"{where} is not contiguous; {type(self).__name__} needs contiguous parameters")

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        if self.STATE_ALIASES:
            renamed = {}
            for pid, st in state_dict.get("state", {}).items():
                renamed[pid] = {self.STATE_ALIASES.get(k, k): v for k, v in st.items()}
            state_dict["state"] = renamed
        super().load_state_dict(state_dict)
        # torch casts floating state to the param's dtype: restore the moments' own dtype and layout
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                for key in self.STATE_KEYS:
                    if key in st:
                        st[key] = st[key].to(device="cpu", dtype=self.state_dtype(p)).contiguous()
                if torch.is_tensor(st.get("step")):
                    st["step"] = int(st["step"].item())

    # ------------------------------------------------------------------ step
    @staticmethod
    def _output_groups(fp16_param_groups, param_groups) -> Optional[List[List[torch.Tensor]]]:
        if fp16_param_groups is None:
            return None
        if torch.is_tensor(fp16_param_groups):
            groups = [[fp16_param_groups]]
        elif isinstance(fp16_param_groups, (list, tuple)) and fp16_param_groups and torch.is_tensor(fp16_param_groups[0]):
            groups = [list(fp16_param_groups)]
        elif isinstance(fp16_param_groups, (list, tuple)):
            groups = [list(g) for g in fp16_param_groups]
        else:
            raise TypeError(f"fp16_param_groups must be a tensor, a list of tensors or a list of lists, "
                            f"got {type(fp16_param_groups).__name__}")
        if len(groups) != len(param_groups):
            raise ValueError(f"fp16_param_groups has {len(groups)} group(s) but the optimizer has {len(param_groups)}")
        for gi, (outs, group) in enumerate(zip(groups, param_groups)):
            if len(outs) != len(group["params"]):
                raise ValueError(f"fp16_param_groups[{gi}] has {len(outs)} tensor(s) but param group {gi} has "
                                 f"{len(group['params'])} parameter(s)")
        return groups

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        outputs = self._output_groups(fp16_param_groups, self.param_groups)
        threads = self.num_threads or torch.get_num_threads()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                self._check_param(p, where)
                state = self.state[p] or self._init_state(p, group)
                state["step"] += 1
                out = outputs[gi][pi] if outputs is not None else None
                try:
                    self._update(p, p.grad, state, group, out, threads)
                except (TypeError, ValueError) as err:
                    name = f"fp16_param_groups[{gi}][{pi}]" if out is not None else where
                    raise type(err)(f"{type(self).__name__}.step: {name}: {err}") from None
        return loss

    def _update(self, param, grad, state, group, out, threads) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _update")  # abstract
