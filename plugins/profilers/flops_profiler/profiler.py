"""``FlopsProfiler``: per-module parameters, MACs, FLOPs and forward latency of a PyTorch model.

How it measures: every module gets a forward pre-hook and a forward hook. The pre-hook opens a
*frame* for the module (and starts its clock); the torch functions replaced by
:mod:`.patching` add the FLOPs / MACs of each call to the innermost open frame; the hook closes
the frame (and stops the clock). A module's own counts therefore hold only the functions called
directly in its ``forward``; its totals (:func:`get_module_flops`) add those of every module
below it, each module object once even when it appears at several places in the tree.

The per-module numbers live in an attribute ``_dsplug_flops_profile`` on each module between
:meth:`FlopsProfiler.start_profile` and :meth:`FlopsProfiler.end_profile`.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Optional

from .formatting import duration_to_string, macs_to_string, number_to_string, params_to_string
from .patching import FunctionPatch

STATS_ATTR = "_dsplug_flops_profile"


class ModuleProfile:
    """What was measured for one module object (its own work, not its children's)."""

    __slots__ = ("flops", "macs", "duration", "calls", "_starts")

    def __init__(self):
        self.flops = 0
        self.macs = 0
        self.duration = 0.0  # seconds, inclusive of children
        self.calls = 0
        self._starts: List[float] = []


def _profile_of(module) -> Optional[ModuleProfile]:
    return module.__dict__.get(STATS_ATTR)


def _unique_modules(module) -> Iterable[Any]:
    return module.modules()  # torch yields each module object once


def get_module_flops(module) -> int:
    """Forward FLOPs of ``module`` and everything below it (0 where nothing was profiled)."""
    return sum(p.flops for p in map(_profile_of, _unique_modules(module)) if p is not None)


def get_module_macs(module) -> int:
    """Forward MACs of ``module`` and everything below it."""
    return sum(p.macs for p in map(_profile_of, _unique_modules(module)) if p is not None)


def get_module_params(module) -> int:
    """Trainable parameters (``requires_grad``) of ``module`` and its children, each counted once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def get_module_duration(module) -> float:
    """Forward seconds of ``module``. A container never called itself (a ``ModuleList`` whose
    parent calls its items) takes the sum of its children's."""
    profile = _profile_of(module)
    if profile is not None and profile.calls:
        return profile.duration
    return sum(get_module_duration(child) for child in module.children())


def _check_ignore_list(ignore_list) -> tuple:
    import torch.nn as nn

    if ignore_list is None:
        return ()
    if isinstance(ignore_list, type):
        ignore_list = [ignore_list]
    try:
        items = tuple(ignore_list)
    except TypeError:
        raise TypeError(f"ignore_list must be a list of torch.nn.Module classes, got {ignore_list!r}") from None
    for item in items:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f"ignore_list must hold torch.nn.Module classes (e.g. torch.nn.Dropout), got {item!r}")
    return items


class FlopsProfiler:
    """Measures the latency, estimated FLOPs / MACs and parameters of every module of ``model``.

    ``ds_engine``: the training engine, when profiling inside one; the summary then shows its world
    size, data / model parallel sizes and micro-batch size. ``recompute_fwd_factor``: the share of
    the forward pass recomputed during backward by activation checkpointing (0.0 none, 1.0 all);
    it enters the backward-FLOPS estimate. ``accelerator``: synchronised around every timing
    (default: :func:`dsplug.accelerator.get_accelerator`).

    Typical use::

        prof = FlopsProfiler(model)
        prof.start_profile()
        model(batch)
        prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        prof.print_model_profile(profile_step=step)
        prof.end_profile()
    """

    def __init__(self, model, ds_engine=None, recompute_fwd_factor: float = 0.0, *, accelerator=None):
        import torch.nn as nn

        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler needs a torch.nn.Module, got {type(model).__name__}")
        if isinstance(recompute_fwd_factor, bool) or not isinstance(recompute_fwd_factor, (int, float)) \
                or not 0.0 <= recompute_fwd_factor <= 1.0:
            raise ValueError(f"recompute_fwd_factor must be a number in [0, 1], got {recompute_fwd_factor!r}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False  # counting is running (between start_profile and stop_profile)
        self.batch_size: Optional[int] = None  # inferred from the model's first input when profiled
        self._accelerator = accelerator
        self._profiled: List[Any] = []  # modules carrying a ModuleProfile
        self._handles: List[Any] = []
        self._frames: List[Optional[ModuleProfile]] = []
        self._patch: Optional[FunctionPatch] = None
        self._sync = None

    # ---------------------------------------------------------------------------- lifecycle
    def start_profile(self, ignore_list=None) -> None:
        """Start counting. ``ignore_list``: module classes whose work (including everything they
        call and contain) is left out of the profile. Restarting a running profile resets it."""
        if self.started:
            self.reset_profile()
            return
        ignored = _check_ignore_list(ignore_list)
        self._sync = self._synchronizer()
        self._attach_profiles()
        self._patch = FunctionPatch(self._record)
        try:
            self._patch.install()
            self._register_hooks(ignored)
        except BaseException:
            self.end_profile()
            raise
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting: put the torch functions back and remove the hooks. The measurements stay
        readable (totals, :meth:`print_model_profile`) until :meth:`end_profile`."""
        if self._patch is not None:
            self._patch.restore()
            self._patch = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._frames.clear()
        self.started = False

    def reset_profile(self) -> None:
        """Zero every measurement (keeps counting if it was running)."""
        for module in self._profiled:
            module.__dict__[STATS_ATTR] = ModuleProfile()
        self._frames.clear()
        self.batch_size = None

    def end_profile(self) -> None:
        """Stop counting and remove every trace of the profile from the model."""
        self.stop_profile()
        for module in self._profiled:
            module.__dict__.pop(STATS_ATTR, None)
        self._profiled.clear()

    @property
    def has_profile(self) -> bool:
        return bool(self._profiled)

    # ---------------------------------------------------------------------------- totals
    def get_total_flops(self, as_string: bool = False):
        total = get_module_flops(self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False):
        total = get_module_macs(self.model)
        return macs_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False):
        total = get_module_params(self.model)
        return params_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False):
        total = get_module_duration(self.model)
        return duration_to_string(total) if as_string else total

    # ---------------------------------------------------------------------------- output
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None, *, step_latency=None) -> None:
        """Print the summary, the top modules per depth and (``detailed``) the module tree.

        ``output_file``: write there instead of stdout. ``step_latency``: a
        :class:`.report.StepLatency` with the training step's timings (the engine observer gives
        one); without it only the forward pass is reported.
        """
        from .report import write_text

        write_text(self.format_model_profile(profile_step, module_depth, top_modules, detailed,
                                             step_latency=step_latency), output_file)

    def format_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                             detailed: bool = True, *, step_latency=None) -> str:
        """The text :meth:`print_model_profile` prints."""
        from .report import render_profile

        if not self.has_profile:
            raise RuntimeError("nothing has been profiled: call start_profile(), run the model's forward pass, "
                               "then print (before end_profile())")
        return render_profile(self, profile_step=profile_step, module_depth=module_depth,
                              top_modules=top_modules, detailed=detailed, step_latency=step_latency)

    def topology(self) -> Dict[str, Optional[int]]:
        """World / data-parallel / model-parallel sizes and micro-batch size, from ``ds_engine``
        where it has them (None when unknown)."""
        engine = self.ds_engine

        def attr(*names):
            for name in names:
                value = getattr(engine, name, None)
                value = value() if callable(value) else value
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
            return None

        world = attr("world_size") if engine is not None else None
        dp = attr("dp_world_size", "data_parallel_size") if engine is not None else None
        mp = attr("mp_world_size", "model_parallel_size") if engine is not None else None
        batch = attr("train_micro_batch_size_per_gpu") if engine is not None else None
        return {"world_size": world, "dp_size": dp if dp is not None else world, "mp_size": mp or 1,
                "batch_size": batch if batch is not None else self.batch_size}

    # ---------------------------------------------------------------------------- internals
    def _synchronizer(self):
        accelerator = self._accelerator
        if accelerator is None:
            from dsplug.accelerator import get_accelerator

            accelerator = get_accelerator()
        return accelerator.synchronize

    def _attach_profiles(self) -> None:
        self._profiled = list(self.model.modules())
        self.reset_profile()

    def _record(self, name: str, flops: int, macs: int) -> None:
        frame = self._frames[-1] if self._frames else None
        if frame is not None:
            frame.flops += flops
            frame.macs += macs

    def _register_hooks(self, ignored: tuple) -> None:
        def walk(module, seen):
            if id(module) in seen:
                return
            seen.add(id(module))
            if ignored and isinstance(module, ignored):
                # a frame that swallows every count made inside the module and its children
                self._handles.append(module.register_forward_pre_hook(lambda m, a: self._frames.append(None)))
                self._handles.append(module.register_forward_hook(lambda m, a, o: self._frames.pop(),
                                                                  always_call=True))
                return
            self._handles.append(module.register_forward_pre_hook(self._open_frame))
            self._handles.append(module.register_forward_hook(self._close_frame, always_call=True))
            for child in module.children():
                walk(child, seen)

        walk(self.model, set())
        self._handles.append(self.model.register_forward_pre_hook(self._note_batch_size, with_kwargs=True))

    def _open_frame(self, module, args) -> None:
        profile = module.__dict__[STATS_ATTR]
        self._frames.append(profile)
        self._sync()
        profile._starts.append(time.perf_counter())

    def _close_frame(self, module, args, output) -> None:
        profile = module.__dict__[STATS_ATTR]
        self._sync()
        if profile._starts:
            profile.duration += time.perf_counter() - profile._starts.pop()
            profile.calls += 1
        if self._frames:
            self._frames.pop()

    def _note_batch_size(self, module, args, kwargs) -> None:
        if self.batch_size is not None:
            return
        import torch

        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                self.batch_size = int(value.shape[0])
                return
