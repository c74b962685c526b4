"""Optimizer and parameter state in an offload device, for the ZeRO stages.

A device (``zero_optimization.offload_optimizer.device`` / ``offload_param.device``) is storage
(:class:`dsplug.contracts.OffloadDevice`): this module decides what goes there and how the step
reaches it, talking to the device only through the contract.

* :func:`open_devices` — the devices a ZeRO section names (``"none"`` opens nothing);
* :func:`build_host_optimizer` — which optimizer steps the offloaded share on the CPU
  (DeepSpeed's rules: the config's ``Adam`` / ``AdamW`` become :class:`dsplug.ops.adam.DeepSpeedCPUAdam`,
  ``Adagrad`` :class:`dsplug.ops.adagrad.DeepSpeedCPUAdagrad`, ``torch_adam: true`` keeps torch's
  class; any other optimizer is refused while the top-level ``zero_force_ds_cpu_optimizer`` is true,
  and steps the CPU tensors as it is otherwise) and :class:`SplitOptimizer` (``ratio`` < 1: part
  of the step on the CPU, the rest on the accelerator);
* :class:`PlacedState` — a CPU optimizer's element-wise state kept in a byte-addressable device
  (one stored flat tensor per state and param group), so that it lives where the section says;
* :class:`SwapBufferPool` — host buffers from :meth:`~dsplug.contracts.OffloadDevice.swap_buffer`
  for devices that need swap buffers;
* :func:`host_share` / :func:`sub_groups` — how a group's pieces split between host and accelerator
  (``ratio``) and into swapped sub-groups (``sub_group_size``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from dsplug.contracts.offload import OffloadDevice, OffloadError, Stored, open_offload_device

FP32 = torch.float32
HALF = (torch.float16, torch.bfloat16)
FORCE_KEY = "zero_force_ds_cpu_optimizer"
#: DeepSpeed's CPU optimizers, accepted as they are under CPU offload
CPU_OPTIMIZER_NAMES = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion")
OFFLOAD_KEYS = ("offload_param", "offload_optimizer")


# ------------------------------------------------------------------------------ devices
def open_devices(zero_config, context) -> Dict[str, OffloadDevice]:
    """``{"offload_param" | "offload_optimizer": device}`` for the sections that name a device
    (``"none"`` is left out: nothing to open to keep everything where it is)."""
    devices = {}
    try:
        for key in OFFLOAD_KEYS:
            section = getattr(zero_config, key, None)
            device = open_offload_device(section, context, f"zero_optimization.{key}") if section is not None else None
            if device is not None:
                devices[key] = device
    except BaseException:
        for device in devices.values():
            device.close()
        raise
    return devices


# ------------------------------------------------------------------------------ the CPU optimizer
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
    """The parsed ``optimizer.params`` as keyword arguments."""
    from dsplug.config.schema import extra_of, fields_of

    params = selected.params
    if params is None:
        return {}
    if isinstance(params, dict):
        return dict(params)
    options = {a.name: getattr(params, a.name) for a in fields_of(type(params))}
    options.update(extra_of(params))
    return options


def build_host_optimizer(groups: List[dict], build_optimizer, context, where: str):
    """The optimizer over ``groups`` (CPU tensors) under offload; ``where`` names the config key."""
    selected = _selected(context)
    name = selected.type.strip().lower() if selected is not None else None
    if name in ("adam", "adamw"):
        options = _options(selected)
        if options.get("torch_adam", False):  # torch's class asked for by name: stepped as it is, as in DeepSpeed
            return build_optimizer(groups)
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
    from ..errors import ZeRORuntimeException

    raise ZeRORuntimeException(
        f"{where}: the optimizer step runs on the CPU, but {origin} builds {type(built).__module__}."
        f"{type(built).__qualname__}, which is not one of DeepSpeed's CPU optimizers ({', '.join(CPU_OPTIMIZER_NAMES)}). "
        f"Use \"optimizer\": {{\"type\": \"AdamW\"}} (or Adam / Adagrad) in the config, pass "
        f"dsplug.ops.adam.DeepSpeedCPUAdam, or set \"{FORCE_KEY}\": false at the top level of the config to step "
        f"this optimizer on the CPU tensors as it is")


def step_writes_partitions(optimizer, local_chunks: List[List[torch.Tensor]]) -> bool:
    """Whether ``optimizer.step(fp16_param_groups=local_chunks)`` can write the model's 16-bit
    host partitions in the same pass (a CPU optimizer and 16-bit CPU outputs)."""
    return is_cpu_optimizer(optimizer) and all(c.device.type == "cpu" and c.dtype in HALF
                                               for chunks in local_chunks for c in chunks)


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


# ------------------------------------------------------------------------------ state in a device
class PlacedState:
    """A CPU optimizer's element-wise state (``STATE_KEYS``) in a byte-addressable device: per
    param group and state, one stored flat tensor whose slices are the views' state, filled with
    what the optimizer's ``_init_state`` starts an element at (zeros; Adagrad's initial
    accumulator), probed on a one-element tensor so no parameter-sized temporary is made.

    Loading a checkpoint replaces the optimizer's state tensors with new ones; :meth:`rehome`
    copies them back into the stored tensors so the state stays where the section put it.
    Optimizers that are not CPU optimizers keep their own state (created at their first step)."""

    def __init__(self, device: OffloadDevice, optimizer, prefix: str = ""):
        self.device = device
        self.optimizer = optimizer
        self.stored: List[Stored] = []
        #: (view, key) -> the stored slice that holds its state
        self.slices: Dict[tuple, torch.Tensor] = {}
        keys = tuple(getattr(optimizer, "STATE_KEYS", ()))
        with torch.no_grad():
            for gi, group in enumerate(optimizer.param_groups):
                views = [v for v in group["params"] if v.numel()]
                if not views or not keys:
                    continue
                flats = {}
                for key in keys:
                    dtype = optimizer.state_dtype(views[0])
                    stored = device.allocate(f"{prefix}group{gi}_{key}", sum(v.numel() for v in views), dtype)
                    self.stored.append(stored)
                    flats[key] = device.tensor(stored)
                probe = torch.empty(1, dtype=views[0].dtype)
                start = optimizer._init_state(probe, group)  # noqa: SLF001 - the optimizer's own initial state
                optimizer.state.pop(probe, None)
                for key in keys:
                    flats[key].copy_(start[key].reshape(-1)[0])
                offset = 0
                for view in views:
                    state = optimizer.state[view]
                    state.update({k: v for k, v in start.items() if k not in keys})
                    for key in keys:
                        piece = flats[key][offset:offset + view.numel()].view(view.shape)
                        state[key] = piece
                        self.slices[(id(view), key)] = piece
                    offset += view.numel()

    def rehome(self) -> None:
        """State tensors replaced (a checkpoint load): copy them into the stored slices."""
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for view in group["params"]:
                    state = self.optimizer.state.get(view)
                    if not state:
                        continue
                    for key, value in list(state.items()):
                        piece = self.slices.get((id(view), key))
                        if piece is not None and torch.is_tensor(value) and value is not piece:
                            piece.copy_(value.reshape(piece.shape))
                            state[key] = piece

    def tensors(self) -> List[torch.Tensor]:
        return [self.device.tensor(s) for s in self.stored]


# ------------------------------------------------------------------------------ swap buffers
class SwapBufferPool:
    """``count`` host buffers of ``numel`` elements of ``dtype`` from ``device.swap_buffer``,
    handed out and returned."""

    def __init__(self, device: OffloadDevice, count: int, numel: int, dtype: torch.dtype):
        self.count, self.numel, self.dtype = int(count), int(numel), dtype
        self._buffers = [device.swap_buffer(max(1, self.numel), dtype) for _ in range(self.count)]
        self._free = list(range(self.count))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> torch.Tensor:
        if not self._free:
            raise OffloadError(f"all {self.count} swap buffers are in use")
        return self._buffers[self._free.pop(0)]

    def give(self, buffer: torch.Tensor) -> None:
        for i, b in enumerate(self._buffers):
            if b.data_ptr() == buffer.data_ptr():
                if i in self._free:
                    raise OffloadError("a swap buffer was returned twice")
                self._free.append(i)
                return
        raise OffloadError("returned a tensor that is not one of the pool's buffers")

    def nbytes(self) -> int:
        return self.count * max(1, self.numel) * torch.empty(0, dtype=self.dtype).element_size()


# ------------------------------------------------------------------------------ splitting
def host_share(sizes: List[int], ratio: float) -> int:
    """How many leading pieces go to the host: the longest prefix within ``ratio`` of the elements."""
    total = sum(sizes)
    if ratio >= 1.0:
        return len(sizes)
    limit, used = ratio * total, 0
    for i, k in enumerate(sizes):
        if used + k > limit:
            return i
        used += k
    return len(sizes)


def sub_groups(sizes: List[int], first: int, last: int, sub_group_size: int) -> List[List[int]]:
    """Pieces ``first..last-1`` cut into runs of about ``sub_group_size`` elements (whole pieces)."""
    out, run, used = [], [], 0
    for i in range(first, last):
        if run and used + sizes[i] > sub_group_size:
            out.append(run)
            run, used = [], 0
        run.append(i)
        used += sizes[i]
    if run:
        out.append(run)
    return out
