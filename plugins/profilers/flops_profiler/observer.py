"""The engine observer that profiles one training step when ``flops_profiler.enabled``.

Timeline of the profiled step (``engine.global_steps + 1 == profile_step``; ``global_steps``
counts finished optimizer steps):

* ``dsplug_forward_begin`` (first micro-step): start the clock and counting on ``engine.module``;
* ``dsplug_forward_end``: stop counting, keep the forward latency (later micro-steps of a
  gradient-accumulation step are timed as part of the step but not counted again);
* ``dsplug_step_end``: take the whole step's latency, print the profile, clean up.

Only rank 0 profiles, like DeepSpeed.
"""
from __future__ import annotations

import time
from typing import Optional

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl

from .profiler import FlopsProfiler
from .report import StepLatency


class FlopsProfilerObserver(Observer):
    name = "flops_profiler"

    def __init__(self, config, context):
        self.config = config
        self.context = context
        self.active = getattr(context, "rank", 0) == 0
        self.profiler: Optional[FlopsProfiler] = None
        self.done = False
        self.last_text: Optional[str] = None  # the profile printed, for callers that want it
        self._step_start = 0.0
        self._fwd_start = 0.0
        self._fwd_latency: Optional[float] = None
        self._micro_steps = 0

    # ------------------------------------------------------------------ lifecycle hooks
    @hookimpl
    def dsplug_forward_begin(self, engine):
        if not self.active or self.done:
            return
        if self.profiler is not None:
            if self._fwd_latency is None:
                # the previous forward never ended (it raised): measure this one instead
                self._discard()
            else:
                self._micro_steps += 1
                return
        if engine.global_steps + 1 != self.config.profile_step:
            return
        self.profiler = FlopsProfiler(engine.module, ds_engine=engine,
                                      recompute_fwd_factor=self.config.recompute_fwd_factor,
                                      accelerator=getattr(self.context, "accelerator", None))
        self._micro_steps = 1
        self._fwd_latency = None
        self._step_start = self._fwd_start = self._now()
        self.profiler.start_profile()

    @hookimpl
    def dsplug_forward_end(self, engine, output):
        if self.profiler is None or self._fwd_latency is not None:
            return
        self._fwd_latency = self._now() - self._fwd_start
        self.profiler.stop_profile()

    @hookimpl
    def dsplug_step_end(self, engine, metrics):
        if self.profiler is None:
            return
        if self._fwd_latency is None:  # no forward finished in this step: nothing to report
            self._discard()
            return
        iter_latency = self._now() - self._step_start
        metrics = metrics or {}
        # the engine's wall-clock breakdown sums backward over the step's micro-steps; the counts
        # are of one micro-batch, so its FLOPS need the backward of one micro-step
        backward = _seconds(metrics.get("backward_ms"))
        latency = StepLatency(fwd=self._fwd_latency,
                              bwd=None if backward is None else backward / self._micro_steps,
                              step=_seconds(metrics.get("step_ms")), iter=iter_latency,
                              micro_steps=self._micro_steps)
        cfg = self.config
        try:
            self.last_text = self.profiler.format_model_profile(cfg.profile_step, cfg.module_depth, cfg.top_modules,
                                                                cfg.detailed, step_latency=latency)
            from .report import write_text

            write_text(self.last_text, cfg.output_file)
        finally:
            self.profiler.end_profile()
            self.profiler = None
            self.done = True

    @hookimpl
    def dsplug_engine_closed(self, engine):
        self._discard()

    # ------------------------------------------------------------------ helpers
    def _discard(self):
        if self.profiler is not None:
            self.profiler.end_profile()
            self.profiler = None
        self._fwd_latency = None

    def _now(self) -> float:
        accelerator = getattr(self.context, "accelerator", None)
        if accelerator is not None:
            accelerator.synchronize()
        return time.perf_counter()


def _seconds(milliseconds) -> Optional[float]:
    return None if milliseconds is None else float(milliseconds) / 1000.0
