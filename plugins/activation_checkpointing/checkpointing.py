"""DeepSpeed's activation checkpointing API: ``dsplug.checkpointing`` (``deepspeed.checkpointing``,
``deepspeed.runtime.activation_checkpointing.checkpointing``).

``checkpoint(function, *args)`` runs ``function`` without keeping its intermediate activations
and runs it again inside backward to get them (the reentrant scheme of DeepSpeed and of
``torch.utils.checkpoint.checkpoint(use_reentrant=True)``). What it keeps between forward and
backward is its inputs, and :func:`configure` chooses how:

* ``partition_activations``: with an ``mpu`` (``get_model_parallel_rank / _world_size / _group``,
  or the ``get_tensor_model_parallel_*`` spellings), each model-parallel rank keeps only its
  ``1/mp`` slice of every floating-point input; the slices are all-gathered (``dsplug.comm``)
  before the recompute. A size not divisible by ``mp`` is padded (DeepSpeed refuses it).
* ``checkpoint_in_cpu``: the kept inputs (or slices) live in host memory until the recompute.
* ``contiguous_checkpointing`` with ``num_checkpoints``: the slices are copied into buffers
  allocated once (per input position, one row per checkpoint index of the forward pass) and
  reused every step, instead of a fresh allocation per call. Needs ``partition_activations``,
  as in DeepSpeed.
* ``synchronize``: ``get_accelerator().synchronize()`` at the start and end of every checkpoint
  forward and backward.
* ``profile``: wall time of every checkpointed function's forward, recompute and backward,
  collected per function (:func:`collect_profile`); the engine reports it per step.

The recompute sees exactly the random numbers of the first forward: torch's CPU generator, the
accelerator's generator and the states of :func:`get_cuda_rng_tracker` are saved at forward and
restored around the recompute (dropout draws the same mask); the autocast state is restored too.

Differences from DeepSpeed (each a fix): the caller's input tensors are never emptied in place
(DeepSpeed sets ``arg.data`` to an empty tensor, breaking a caller that uses them again; here
the full input is freed as soon as nothing else holds it); a call under ``torch.no_grad()`` just
runs ``function`` (nothing to recompute, no buffer row taken); outputs keep their structure (a
1-tuple stays a tuple); a contiguous buffer row overwritten before its backward, or more calls
per forward than ``num_checkpoints``, is an error instead of silently wrong gradients.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
import warnings
from typing import Any, Dict, List, Optional

import attrs
import torch

from dsplug.accelerator import get_accelerator
from dsplug.logging import logger

from .config import ActivationCheckpointingConfig
from .rng import _CUDA_RNG_STATE_TRACKER, _MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker, get_cuda_rng_tracker

__all__ = [
    "configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint", "CheckpointFunction",
    "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
    "CudaRNGStatesTracker", "partition_activations_in_checkpoint", "set_num_layers", "detach_variable",
    "is_activation_to_checkpoint", "settings", "collect_profile", "format_profile",
    "_CUDA_RNG_STATE_TRACKER", "_MODEL_PARALLEL_RNG_TRACKER_NAME",
]


# ------------------------------------------------------------------------------ configuration
@attrs.define
class CheckpointingSettings:
    """The active configuration (:func:`settings`); DeepSpeed keeps these in module globals."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings = CheckpointingSettings()
_configured = False
_mpu = None
_mp_rank, _mp_size, _mp_group = 0, 1, None


def settings() -> CheckpointingSettings:
    """A copy of the active configuration."""
    return attrs.evolve(_settings)


def _section_of(deepspeed_config) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a DeepSpeed config (path, dict, JSON text, a
    parsed :class:`dsplug.config.DsplugConfig` or a ``DeepSpeedConfig``). Only this section is
    read, so a config whose batch sizes assume another world size (model parallelism) is fine."""
    from dsplug.config import DsplugConfig
    from dsplug.config.loader import load_raw
    from dsplug.config.schema import parse

    inner = getattr(deepspeed_config, "config", None)  # DeepSpeedConfig -> its DsplugConfig
    if isinstance(inner, DsplugConfig):
        deepspeed_config = inner
    if isinstance(deepspeed_config, DsplugConfig):
        section = deepspeed_config.sections.get("activation_checkpointing")
        return section if section is not None else ActivationCheckpointingConfig()
    raw, _ = load_raw(deepspeed_config)
    return parse(ActivationCheckpointingConfig, raw.get("activation_checkpointing", {}), "activation_checkpointing")


def _mp_of(mpu):
    if mpu is None:
        return 0, 1, None
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                mpu.get_tensor_model_parallel_group())
    return mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), mpu.get_model_parallel_group()


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Configure activation checkpointing (DeepSpeed's signature).

    ``mpu_``: the model-parallel unit (kept from an earlier call when None); ``deepspeed_config``:
    a DeepSpeed config (path, dict, JSON text) whose ``activation_checkpointing`` section gives
    the settings; every other argument that is not None overrides the config's value
    (``partition_activations``, ``contiguous_checkpointing`` = ``contiguous_memory_optimization``,
    ``num_checkpoints`` = ``number_checkpoints``, ``checkpoint_in_cpu`` = ``cpu_checkpointing``,
    ``synchronize`` = ``synchronize_checkpoint_boundary``, ``profile``). Settings not given fall
    back to the defaults (all off), as in DeepSpeed.
    """
    global _mpu
    section = _section_of(deepspeed_config) if deepspeed_config is not None else ActivationCheckpointingConfig()
    new = CheckpointingSettings(partition_activations=section.partition_activations,
                   contiguous_checkpointing=section.contiguous_memory_optimization,
                   num_checkpoints=section.number_checkpoints, checkpoint_in_cpu=section.cpu_checkpointing,
                   synchronize=section.synchronize_checkpoint_boundary, profile=section.profile)
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("num_checkpoints", num_checkpoints), ("checkpoint_in_cpu", checkpoint_in_cpu),
                        ("synchronize", synchronize), ("profile", profile)):
        if value is not None:
            setattr(new, name, int(value) if name == "num_checkpoints" else bool(value))
    if new.contiguous_checkpointing and not new.partition_activations:
        raise ValueError("dsplug.checkpointing.configure: contiguous checkpointing needs partition_activations "
                         "(as in DeepSpeed; without model parallelism a partition is the whole tensor)")
    if new.contiguous_checkpointing and (new.num_checkpoints is None or new.num_checkpoints < 1):
        raise ValueError("dsplug.checkpointing.configure: contiguous checkpointing needs num_checkpoints "
                         "(number_checkpoints), the number of checkpoint() calls per forward pass")
    _apply(new, mpu_ if mpu_ is not None else _mpu)


def _apply(new: CheckpointingSettings, mpu) -> None:
    global _settings, _configured, _mpu, _mp_rank, _mp_size, _mp_group
    _mpu = mpu
    _mp_rank, _mp_size, _mp_group = _mp_of(mpu)
    _settings = new
    _configured = True
    _BUFFERS.reset()
    from dsplug import comm

    if comm.get_rank() == 0:
        logger.info(f"activation checkpointing: partition_activations={new.partition_activations} "
                    f"(model parallel rank {_mp_rank} of {_mp_size}), cpu={new.checkpoint_in_cpu}, "
                    f"contiguous={new.contiguous_checkpointing} ({new.num_checkpoints} checkpoints), "
                    f"synchronize={new.synchronize}, profile={new.profile}")


def _configure_from_section(section: ActivationCheckpointingConfig) -> None:
    """The engine's configuration from its ``activation_checkpointing`` section (the mpu of an
    earlier :func:`configure` stays)."""
    new = CheckpointingSettings(partition_activations=section.partition_activations,
                   contiguous_checkpointing=section.contiguous_memory_optimization,
                   num_checkpoints=section.number_checkpoints, checkpoint_in_cpu=section.cpu_checkpointing,
                   synchronize=section.synchronize_checkpoint_boundary, profile=section.profile)
    _apply(new, _mpu)


def is_configured() -> bool:
    """True once :func:`configure` ran (or an engine was built with an ``activation_checkpointing`` section)."""
    return _configured


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter of ``partition_activations``."""
    _settings.partition_activations = bool(partition_activation)


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter of ``num_checkpoints`` (the contiguous buffers' rows)."""
    _settings.num_checkpoints = int(nlayers)
    _BUFFERS.reset()


def reset() -> None:
    """Free the contiguous checkpoint buffers and start the checkpoint index at 0 (DeepSpeed: call
    it after forward passes that had no backward; here calls under ``no_grad`` take no row)."""
    _BUFFERS.reset()


def _new_forward_pass() -> None:
    """A forward pass begins (the engine's ``dsplug_forward_begin``): checkpoint indices restart at 0."""
    _BUFFERS.rewind()


# ------------------------------------------------------------------------------ model-parallel seeds
def _tp_rank() -> int:
    if _mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(_mpu, name):
            return int(getattr(_mpu, name)())
    return 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the accelerator's default generator with ``seed`` (same on every model-parallel rank)
    and add the tracker state ``"model-parallel-rng"`` seeded ``seed + 2718 + model-parallel rank``
    (different per rank), as Megatron-LM / DeepSpeed do. Call after :func:`configure` (the mpu)."""
    from dsplug import comm

    model_parallel_seed = seed + 2718 + _tp_rank()
    if comm.get_rank() == 0:
        logger.info(f"> initializing model parallel seeds: model parallel rank {_tp_rank()}, model parallel seed "
                    f"{model_parallel_seed}, data parallel seed {seed}")
    _CUDA_RNG_STATE_TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the tracker's model-parallel state with ``seed + 2718 + model-parallel rank``."""
    with _CUDA_RNG_STATE_TRACKER.fork():
        get_accelerator().manual_seed(seed + 2718 + _tp_rank())


# ------------------------------------------------------------------------------ helpers
def is_activation_to_checkpoint(item) -> bool:
    """A floating-point tensor of at least ``mp`` elements not marked ``no_checkpointing``: what
    partitioning, CPU checkpointing and the contiguous buffers apply to (other tensors are kept as they are)."""
    return (torch.is_tensor(item) and item.is_floating_point() and item.numel() >= _mp_size
            and not getattr(item, "no_checkpointing", False))


def detach_variable(inputs, device=None):
    """Each tensor of the tuple ``inputs`` detached (moved to ``device`` if given), keeping its ``requires_grad``."""
    if not isinstance(inputs, tuple):
        raise RuntimeError(f"Only tuple of tensors is supported. Got Unsupported input type: {type(inputs).__name__}")
    out = []
    for inp in inputs:
        if not torch.is_tensor(inp):
            out.append(inp)
            continue
        x = (inp.to(device) if device is not None else inp).detach()
        x.requires_grad = inp.requires_grad
        out.append(x)
    return tuple(out)


def _device_is_host() -> bool:
    return get_accelerator().device_name() == "cpu"


def _rng_snapshot():
    return (torch.get_rng_state(), None if _device_is_host() else get_accelerator().get_rng_state(),
            get_cuda_rng_tracker().get_states())


def _rng_set(snapshot) -> None:
    cpu, device, tracker = snapshot
    torch.set_rng_state(cpu)
    if device is not None:
        get_accelerator().set_rng_state(device)
    get_cuda_rng_tracker().set_states(copy.copy(tracker))  # a fork stores into the table: keep ours


@contextlib.contextmanager
def _rng_as_of(snapshot):
    now = _rng_snapshot()
    _rng_set(snapshot)
    try:
        yield
    finally:
        _rng_set(now)


def _autocast_state(args) -> tuple:
    """``(enabled device types with their dtype, cache_enabled)`` to re-enter for the recompute."""
    types = {"cpu", get_accelerator().device_name()} | {a.device.type for a in args if torch.is_tensor(a)}
    enabled = []
    for device_type in sorted(types):
        try:
            if torch.is_autocast_enabled(device_type):
                enabled.append((device_type, torch.get_autocast_dtype(device_type)))
        except (RuntimeError, TypeError, AttributeError):  # an unknown device type / an older torch
            continue
    return tuple(enabled), torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def _autocast_as(state):
    enabled, cache = state
    with contextlib.ExitStack() as stack:
        for device_type, dtype in enabled:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        yield


def _synchronize_boundary() -> None:
    if _settings.synchronize:
        get_accelerator().synchronize()


# ------------------------------------------------------------------------------ profile
class _Profile:
    """Milliseconds per checkpointed function and phase since the last :func:`collect_profile`."""

    PHASES = ("forward_ms", "recompute_ms", "backward_ms")

    def __init__(self):
        self.rows: Dict[str, Dict[str, float]] = {}

    def add(self, name: str, phase: str, ms: float, call: bool = False) -> None:
        row = self.rows.setdefault(name, {"calls": 0, **{p: 0.0 for p in self.PHASES}})
        row[phase] += ms
        if call:
            row["calls"] += 1

    def collect(self) -> Dict[str, Dict[str, float]]:
        rows, self.rows = self.rows, {}
        return rows


_PROFILE = _Profile()


@contextlib.contextmanager
def _timed(name: str, phase: str, call: bool = False):
    if not _settings.profile:
        yield
        return
    accelerator = get_accelerator()
    accelerator.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        accelerator.synchronize()
        _PROFILE.add(name, phase, (time.perf_counter() - start) * 1000.0, call=call)


def collect_profile() -> Dict[str, Dict[str, float]]:
    """``{function name: {"calls", "forward_ms", "recompute_ms", "backward_ms"}}`` accumulated
    since the last call (with ``profile`` on), and start over. The engine calls it once per step."""
    return _PROFILE.collect()


def format_profile(rows: Dict[str, Dict[str, float]]) -> str:
    """One line per function of :func:`collect_profile`'s result."""
    if not rows:
        return "activation checkpointing: no checkpointed calls"
    parts = [f"{name} x{int(r['calls'])}: forward {r['forward_ms']:.2f} ms, recompute {r['recompute_ms']:.2f} ms, "
             f"backward {r['backward_ms']:.2f} ms" for name, r in sorted(rows.items())]
    return "activation checkpointing: " + "; ".join(parts)


def _name_of(function) -> str:
    while isinstance(function, functools.partial) or hasattr(function, "__wrapped__"):
        function = function.func if isinstance(function, functools.partial) else function.__wrapped__
    owner = getattr(function, "__self__", None)
    if isinstance(owner, torch.nn.Module):  # block.forward: the block's own class
        return f"{type(owner).__name__}.{getattr(function, '__name__', 'forward')}"
    if isinstance(function, torch.nn.Module):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or type(function).__name__


# ------------------------------------------------------------------------------ contiguous buffers
class _ContiguousBuffers:
    """Per floating-point input position, one buffer ``[num_checkpoints, width]`` allocated once and
    reused: the i-th checkpoint call of a forward pass copies its slice into row i."""

    def __init__(self):
        self.buffers: Dict[int, torch.Tensor] = {}
        self.owner: Dict[tuple, object] = {}
        self.next_index = 0

    def reset(self) -> None:
        self.buffers, self.owner, self.next_index = {}, {}, 0

    def rewind(self) -> None:
        self.next_index = 0

    def take_index(self, rows: int) -> int:
        index = self.next_index
        if index >= rows:
            raise RuntimeError(
                f"dsplug.checkpointing: checkpoint() was called {index + 1} times in one forward pass but "
                f"contiguous checkpointing has num_checkpoints={rows} buffer rows; set number_checkpoints "
                "(num_checkpoints) to the number of checkpointed calls per forward pass (call "
                "dsplug.checkpointing.reset() after a forward pass that had no backward)")
        self.next_index += 1
        return index

    def row(self, slot: int, index: int, rows: int, width: int, dtype, device, token) -> torch.Tensor:
        buffer = self.buffers.get(slot)
        if (buffer is None or buffer.shape[0] != rows or buffer.shape[1] < width or buffer.dtype != dtype
                or buffer.device != device):
            buffer = torch.empty((rows, width), dtype=dtype, device=device)
            if device.type == "cpu" and not _device_is_host():
                buffer = get_accelerator().pin_memory(buffer)  # host buffers for a device: pinned
            self.buffers[slot] = buffer  # earlier rows of the old buffer stay alive through their ctx
        self.owner[(slot, index)] = token
        return buffer[index, :width]

    def check(self, slot: int, index: int, token) -> None:
        if self.owner.get((slot, index)) is not token:
            raise RuntimeError(
                f"dsplug.checkpointing: the contiguous buffer row of checkpoint index {index} was overwritten by a "
                "later forward pass before this checkpoint's backward ran; with contiguous checkpointing run "
                "backward after each forward pass (or raise number_checkpoints)")


_BUFFERS = _ContiguousBuffers()


# ------------------------------------------------------------------------------ keeping the inputs
def _keep_inputs(ctx, args):
    """Decide per argument what is kept for the recompute; returns the tensors for save_for_backward
    (everything but the contiguous buffer rows, whose buffer is shared by the calls of a pass)."""
    s = _settings
    plan: List[tuple] = []
    to_save: List[torch.Tensor] = []
    slot = 0
    index = None
    token = object()
    for arg in args:
        if not torch.is_tensor(arg):
            plan.append(("object", arg))
            continue
        special = (s.partition_activations or s.checkpoint_in_cpu) and is_activation_to_checkpoint(arg)
        if not special:
            plan.append(("saved", len(to_save), arg.requires_grad))
            to_save.append(arg)
            continue
        data = arg.detach()
        if s.partition_activations:
            numel = data.numel()
            width = math.ceil(numel / _mp_size)
            start = min(_mp_rank * width, numel)
            piece = data.reshape(-1)[start:start + width]
            device = torch.device("cpu") if s.checkpoint_in_cpu else data.device
            if s.contiguous_checkpointing:
                if index is None:
                    index = _BUFFERS.take_index(s.num_checkpoints)
                kept = _BUFFERS.row(slot, index, s.num_checkpoints, width, data.dtype, device, token)
                ticket = (slot, index, token)
            else:
                kept = torch.empty(width, dtype=data.dtype, device=device)
                ticket = None
            kept[:piece.numel()].copy_(piece)
            if piece.numel() < width:
                kept[piece.numel():].zero_()  # padding of the last ranks' slices
            if ticket is None:  # a tensor of its own: saved through autograd (saved-tensor hooks see it)
                to_save.append(kept)
                kept = len(to_save) - 1
            plan.append(("partition", kept, tuple(data.shape), numel, data.device, arg.requires_grad, ticket))
            slot += 1
        else:  # checkpoint_in_cpu alone: a host copy of the whole input
            plan.append(("host", len(to_save), data.device, arg.requires_grad))
            to_save.append(data.to("cpu", copy=True))
    ctx.plan = plan
    return to_save


def _restore_inputs(ctx) -> tuple:
    """The inputs for the recompute: detached, with the original ``requires_grad``."""
    saved = ctx.saved_tensors
    inputs = []
    for entry in ctx.plan:
        kind = entry[0]
        if kind == "object":
            inputs.append(entry[1])
            continue
        if kind == "saved":
            _, i, requires_grad = entry
            x = saved[i]
        elif kind == "host":
            _, i, device, requires_grad = entry
            x = saved[i].to(device, non_blocking=True)
        else:
            _, kept, shape, numel, device, requires_grad, ticket = entry
            if ticket is not None:
                _BUFFERS.check(*ticket)
            else:
                kept = saved[kept]
            local = kept.to(device, non_blocking=True)
            if _mp_size > 1:
                from dsplug import comm

                full = torch.empty(local.numel() * _mp_size, dtype=local.dtype, device=device)
                comm.all_gather_into_tensor(full, local, group=_mp_group)
            else:
                full = local
            x = full[:numel].view(shape)
        x = x.detach()  # a leaf of its own for the recompute (it may share the kept storage)
        x.requires_grad = requires_grad
        inputs.append(x)
    return tuple(inputs)


# ------------------------------------------------------------------------------ the autograd function
class CheckpointFunction(torch.autograd.Function):
    """Runs ``run_function`` without a graph at forward and again, with one, inside backward."""

    @staticmethod
    def forward(ctx, run_function, structure, *args):
        _synchronize_boundary()
        name = _name_of(run_function)
        with _timed(name, "forward_ms", call=True):
            ctx.run_function = run_function
            ctx.profile_name = name
            ctx.rng = _rng_snapshot()
            ctx.autocast = _autocast_state(args)
            ctx.save_for_backward(*_keep_inputs(ctx, args))
            outputs = run_function(*args)  # autograd records nothing inside Function.forward
            if torch.is_tensor(outputs):
                structure["kind"], tensors = "tensor", (outputs,)
            elif isinstance(outputs, (tuple, list)):
                structure["kind"] = type(outputs)
                structure["flags"] = [torch.is_tensor(o) for o in outputs]
                structure["others"] = [o for o in outputs if not torch.is_tensor(o)]
                tensors = tuple(o for o in outputs if torch.is_tensor(o))
            else:
                raise TypeError(f"dsplug.checkpointing.checkpoint: the function must return a tensor or a tuple / list "
                                f"(tensors and other values), got {type(outputs).__name__}")
            ctx.mark_non_differentiable(*[t for t in tensors if not (t.is_floating_point() or t.is_complex())])
        _synchronize_boundary()
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad() or when an `inputs` parameter is passed "
                               "to .backward(); use .backward() without `inputs`")
        _synchronize_boundary()
        _BUFFERS.rewind()  # the backward of this forward pass started: the next forward starts at row 0
        with _timed(ctx.profile_name, "recompute_ms"):
            inputs = _restore_inputs(ctx)
            with _rng_as_of(ctx.rng), torch.enable_grad(), _autocast_as(ctx.autocast):
                outputs = ctx.run_function(*inputs)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        outputs = [o for o in outputs if torch.is_tensor(o)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        if not pairs:
            raise RuntimeError("none of output has requires_grad=True, this checkpoint() is not necessary")
        with _timed(ctx.profile_name, "backward_ms"):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.plan = ctx.run_function = None
        _synchronize_boundary()
        return (None, None, *[x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs])


def checkpoint(function, *args, **kwargs):
    """Checkpoint ``function(*args, **kwargs)``: its activations are recomputed in backward.

    Returns what ``function`` returns (a tensor, or a tuple / list whose non-tensor items pass
    through). Gradients flow to the tensor arguments that require them and to the parameters
    ``function`` uses; as with any reentrant checkpoint, when no tensor argument requires grad
    the parameters inside get none (a warning says so). Tensor keyword arguments take part like
    positional ones.
    """
    if kwargs:
        run_function, names, count = function, tuple(kwargs), len(args)

        def function(*all_args):
            return run_function(*all_args[:count], **dict(zip(names, all_args[count:])))

        function = functools.update_wrapper(function, run_function)
        args = args + tuple(kwargs.values())
    if not torch.is_grad_enabled():  # no backward will run: nothing to keep or recompute
        return function(*args)
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):
        warnings.warn("dsplug.checkpointing.checkpoint: none of the inputs have requires_grad=True; the gradients "
                      "of the parameters inside will be None", stacklevel=2)
    structure: Dict[str, Any] = {}
    tensors = CheckpointFunction.apply(function, structure, *args)
    if structure["kind"] == "tensor":
        return tensors[0]
    it, others = iter(tensors), iter(structure["others"])
    items = [next(it) if is_tensor else next(others) for is_tensor in structure["flags"]]
    kind = structure["kind"]
    return kind._make(items) if hasattr(kind, "_fields") else kind(items)  # a namedtuple keeps its type


def non_reentrant_checkpoint(function, *args, **kwargs):
    """torch's non-reentrant checkpoint (``use_reentrant=False``: works when no input requires
    grad) with the RNG tracker's states restored for the recompute as well. Partitioning, CPU
    and contiguous checkpointing and the profile apply to :func:`checkpoint` only."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    calls = [0]

    def run(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            return function(*a, **k)
        now = tracker.get_states()
        tracker.set_states(copy.copy(states))
        try:
            return function(*a, **k)
        finally:
            tracker.set_states(now)

    return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

