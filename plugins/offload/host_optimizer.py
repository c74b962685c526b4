"""Which optimizer steps the offloaded (host) partitions, and the optimizer that splits one step
between the host and the accelerator (``offload_optimizer.ratio`` < 1).

DeepSpeed's rules, with ``offload_optimizer.device`` cpu or nvme:

* the config's optimizer ``Adam`` / ``AdamW`` becomes :class:`dsplug.ops.adam.DeepSpeedCPUAdam` and
  ``Adagrad`` :class:`dsplug.ops.adagrad.DeepSpeedCPUAdagrad` with the same hyper-parameters
  (``torch_adam: true`` keeps torch's class);
* a client optimizer, or any other optimizer, is refused while the top-level
  ``zero_force_ds_cpu_optimizer`` is true (the default): it would step the host partitions with an
  implementation not made for the CPU. With it false, that optimizer steps the CPU tensors as is.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

FORCE_KEY = "zero_force_ds_cpu_optimizer"
#: DeepSpeed's CPU optimizers, accepted as they are under CPU offload
CPU_OPTIMIZER_NAMES = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion")


def is_cpu_optimizer(optimizer) -> bool:
    from dsplug.ops.cpu_optimizer import DeepSpeedCPUOptimizer

    return isinstance(optimizer, DeepSpeedCPUOptimizer)


def _selected(context):
    config = getattr(context, "config", None)
    return getattr(config, "optimizer", None) if config is not None else None


def _force(context) -> bool:
    config = getattr(context, "config", None)
    kernel = getattr(config, "kernel", None)
    return bool(getattr(kernel, FORCE_KEY, True)) if kernel is not None else True


def _options(selected) -> Dict:
    from dsplug.config.params import options_of

    return options_of(selected.params, selected.type)


def build_host_optimizer(groups: List[dict], build_optimizer, context, where: str):
    """The optimizer over ``groups`` (CPU tensors) under offload; ``where`` names the config key."""
    selected = _selected(context)
    name = selected.type.strip().lower() if selected is not None else None
    if name in ("adam", "adamw"):
        options = _options(selected)
        if not options.get("torch_adam", False):
            from dsplug.ops.adam import DeepSpeedCPUAdam

            decoupled = True if name == "adamw" else bool(options.get("adam_w_mode", True))
            return DeepSpeedCPUAdam(groups, lr=options.get("lr", 1e-3),
                                    bias_correction=options.get("bias_correction", True),
                                    betas=tuple(options.get("betas", (0.9, 0.999))), eps=options.get("eps", 1e-8),
                                    weight_decay=options.get("weight_decay", 0.0), adamw_mode=decoupled)
    if name == "adagrad":
        options = _options(selected)
        unsupported = {k: v for k, v in options.items() if k in ("maximize", "differentiable") and v}
        if not unsupported:
            from dsplug.ops.adagrad import DeepSpeedCPUAdagrad

            return DeepSpeedCPUAdagrad(groups, lr=options.get("lr", 1e-2), eps=options.get("eps", 1e-10),
                                       weight_decay=options.get("weight_decay", 0.0),
                                       lr_decay=options.get("lr_decay", 0.0),
                                       initial_accumulator_value=options.get("initial_accumulator_value", 0.0))
    built = build_optimizer(groups)
    if built is None or is_cpu_optimizer(built) or not _force(context):
        return built
    origin = (f"the config's optimizer {selected.type!r}" if selected is not None
              else "a client optimizer (passed to initialize)")
    raise ValueError(
        f"{where}: the optimizer step runs on the CPU, but {origin} builds {type(built).__module__}."
        f"{type(built).__qualname__}, which is not one of DeepSpeed's CPU optimizers ({', '.join(CPU_OPTIMIZER_NAMES)}). "
        f"Use \"optimizer\": {{\"type\": \"AdamW\"}} (or Adam / Adagrad) in the config, pass "
        f"dsplug.ops.adam.DeepSpeedCPUAdam, or set \"{FORCE_KEY}\": false at the top level of the config to step "
        f"this optimizer on the CPU tensors as it is")


class SplitOptimizer(torch.optim.Optimizer):
    """One optimizer whose step is done by two: ``host`` (the CPU share of every param group) and
    ``device`` (the rest, on the accelerator).

    ``param_groups`` hold every parameter of a group and the hyper-parameters schedulers change;
    each step copies them into the parts' groups. ``state`` is one dict shared with both parts
    (keyed by parameter), so checkpoints see one optimizer.
    ``host_index[g]`` / ``device_index[g]``: the part's group index for group g (None: no share).
    """

    def __init__(self, groups: List[dict], host, device, host_index: List[Optional[int]],
                 device_index: List[Optional[int]]):
        merged = []
        for gi, g in enumerate(groups):
            hyper = {}
            for part, index in ((device, device_index), (host, host_index)):
                if index[gi] is not None:
                    hyper.update({k: v for k, v in part.param_groups[index[gi]].items() if k != "params"})
            merged.append({**hyper, "params": list(g["params"])})
        super().__init__(merged, defaults={})
        self.host, self.device = host, device
        self.parts = ((host, list(host_index)), (device, list(device_index)))
        self._share_state()

    def _share_state(self) -> None:
        for part, _ in self.parts:
            if part.state is not self.state:
                self.state.update(part.state)
                part.state = self.state

    def sync_hyper(self) -> None:
        """Copy the hyper-parameters of ``param_groups`` (set by schedulers) into both parts."""
        for part, index in self.parts:
            for gi, pi in enumerate(index):
                if pi is None:
                    continue
                source, target = self.param_groups[gi], part.param_groups[pi]
                for key in target:
                    if key != "params" and key in source:
                        target[key] = source[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync_hyper()
        self.device.step()
        self.host.step()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for part, _ in self.parts:
            part.state = self.state

    def __repr__(self) -> str:
        return f"SplitOptimizer(host={type(self.host).__name__}, device={type(self.device).__name__})"
