"""The engine observer of an autotuning experiment: measures the run, writes the result, ends it.

Active only when the experiment's config says so (:func:`build_observer`):

* ``autotuning.metric_path`` set (with ``enabled``): a **metric run**. Steps are counted from 0 in
  this process. Each step ``k`` with ``start_profile_step <= k <= end_profile_step`` is timed
  from its first micro-step's forward to the end of its optimizer step (the accelerator
  synchronised at both ends, as DeepSpeed's forward / backward / step timers measure it: data
  loading between steps is left out). After step ``end_profile_step`` every rank writes nothing
  but rank 0, which writes ``metric_path``; then every rank ends the run (``SystemExit(0)``), as
  DeepSpeed's engine exits after its profile steps.

      latency    = max over ranks of the summed step time / measured steps      (ms)
      throughput = train_batch_size / latency                                   (samples/s)
      flops      = 3 * forward FLOPs of one micro-batch * gradient_accumulation_steps / latency
                                                                                (FLOPS per GPU)

  The forward FLOPs come from the plugin answering ``dsplug_flops_counter`` (the flops profiler),
  counted on the first forward of step 0 (outside the measured window, so the profiler's hooks
  do not slow the timing) -- or, when ``start_profile_step`` is 0, on the step after the window,
  which then runs one extra step. Backward is taken as twice the forward, DeepSpeed's
  convention.
* ``autotuning.model_info.profile`` with ``model_info_path``: a **model-info run**. During the
  first forward pass every tensor autograd saves for backward is counted (each storage once,
  parameters excluded): the activation bytes of one micro-batch. After the first optimizer step
  rank 0 writes ``{"num_params", "trainable_num_params", "activation_mem_per_gpu",
  "activation_mem_per_sample", "micro_batch_size"}`` and every rank ends the run. Parameter
  counts use ``ds_numel`` for ZeRO-3 partitioned parameters.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl
from dsplug.registry import get_registry


def write_json_atomic(path: str, data: Dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (readers never see half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build_observer(config, context):
    """``factory(section, context)``: the observer when this run is an autotuning experiment, else None."""
    if config is None or not config.enabled:
        return None
    profile = config.model_info is not None and config.model_info.profile  # with model_info_path (a schema rule)
    if not profile and not config.metric_path:
        return None
    return AutotuningObserver(config, context, model_info_run=profile)


class AutotuningObserver(Observer):
    name = "autotuning"

    def __init__(self, config, context, model_info_run: bool = False):
        self.config = config
        self.context = context
        self.model_info_run = model_info_run
        self.rank = int(getattr(context, "rank", 0) or 0)
        self.world_size = int(getattr(context, "world_size", 1) or 1)
        self.steps = 0  # optimizer steps finished by this engine
        # metric run
        self.start, self.end = int(config.start_profile_step), int(config.end_profile_step)
        self.flops_step = 0 if self.start >= 1 else self.end + 1
        self.finish_after = self.end + 1 if self.start >= 1 else self.end + 2  # steps run when we end
        self._t0: Optional[float] = None
        self.elapsed = 0.0
        self.measured = 0
        self._profiler = None
        self.forward_flops: Optional[int] = None
        self.flops_note: Optional[str] = None
        # model-info run
        self._hooks = None
        self.activation_bytes: Optional[int] = None
        self._seen = set()
        self._param_ptrs = set()
        self._counted = [0]
        #: what was written (for in-process callers and tests)
        self.result: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------------ lifecycle hooks
    @hookimpl
    def dsplug_forward_begin(self, engine):
        if self.model_info_run:
            if self.steps == 0 and self._hooks is None and self.activation_bytes is None:
                self._start_counting_activations(engine)
            return None
        if self.start <= self.steps <= self.end and self._t0 is None:
            self._t0 = self._now()
        if self.steps == self.flops_step and self._profiler is None and self.forward_flops is None:
            self._start_flops(engine)
        return None

    @hookimpl
    def dsplug_forward_end(self, engine, output):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        if self._profiler is not None:
            try:
                self._profiler.stop_profile()
                self.forward_flops = int(self._profiler.get_total_flops())
            finally:
                self._profiler.end_profile()
                self._profiler = None

    @hookimpl
    def dsplug_step_end(self, engine, metrics):
        self.steps += 1
        if self.model_info_run:
            self._finish_model_info(engine)
            return
        if self._t0 is not None:
            self.elapsed += self._now() - self._t0
            self.measured += 1
            self._t0 = None
        if self.steps >= self.finish_after:
            self._finish_metric(engine)

    @hookimpl
    def dsplug_engine_closed(self, engine):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        if self._profiler is not None:
            self._profiler.end_profile()
            self._profiler = None

    # ------------------------------------------------------------------ metric run
    def _start_flops(self, engine) -> None:
        registry = getattr(self.context, "registry", None) or get_registry()
        counter = registry.pm.hook.dsplug_flops_counter(module=engine.module,
                                                         accelerator=getattr(self.context, "accelerator", None))
        if counter is None:  # the flops profiler plugin is blocked or missing
            self.flops_note = ("no flops profiler: no installed plugin counts FLOPs (dsplug_flops_counter; the "
                               "flops profiler plugin is blocked or not installed)")
            self.forward_flops = None
            self.flops_step = -1
            return
        self._profiler = counter
        self._profiler.start_profile()

    def _finish_metric(self, engine) -> None:
        mine = {"elapsed": self.elapsed, "measured": self.measured}
        every = self._gather(mine)
        elapsed = max(m["elapsed"] for m in every)
        measured = min(m["measured"] for m in every)
        if measured <= 0 or elapsed <= 0:
            raise RuntimeError(f"autotuning: no step was measured between start_profile_step {self.start} and "
                               f"end_profile_step {self.end}")
        latency_s = elapsed / measured
        batch = int(engine.train_batch_size())
        gas = int(engine.gradient_accumulation_steps())
        flops_per_step = None if self.forward_flops is None else 3 * self.forward_flops * gas
        self.result = {
            "latency": latency_s * 1000.0,
            "throughput": batch / latency_s,
            "flops": None if flops_per_step is None else flops_per_step / latency_s,
            "units": {"latency": "ms per step", "throughput": "samples/s", "flops": "FLOPS per GPU"},
            "measured_steps": measured,
            "start_profile_step": self.start,
            "end_profile_step": self.end,
            "train_batch_size": batch,
            "train_micro_batch_size_per_gpu": int(engine.train_micro_batch_size_per_gpu()),
            "gradient_accumulation_steps": gas,
            "world_size": self.world_size,
            "forward_flops_per_micro_batch": self.forward_flops,
            "flops_per_step_per_gpu": flops_per_step,
        }
        if self.flops_note:
            self.result["flops_note"] = self.flops_note
        if self.rank == 0:
            write_json_atomic(self.config.metric_path, self.result)
            print(f"dsplug autotuning: measured {measured} steps: latency {self.result['latency']:.3f} ms, "
                  f"throughput {self.result['throughput']:.2f} samples/s; wrote {self.config.metric_path}; "
                  f"ending the run", flush=True)
        raise SystemExit(0)

    # ------------------------------------------------------------------ model-info run
    def _start_counting_activations(self, engine) -> None:
        import torch

        params = list(engine.module.parameters())
        self._param_ptrs = {p.data_ptr() for p in params}
        self._seen = set()
        self.activation_bytes = None
        counted = self._counted = [0]

        def pack(t):
            if isinstance(t, torch.nn.Parameter) or t.data_ptr() in self._param_ptrs:
                return t
            try:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
                key, size = id(t), t.numel() * t.element_size()
            if key not in self._seen:
                self._seen.add(key)
                counted[0] += size
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def _finish_model_info(self, engine) -> None:
        if self._hooks is not None:  # no forward_end came (should not happen); close the context
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        params = list(engine.module.parameters())
        numel = [int(getattr(p, "ds_numel", p.numel())) for p in params]
        mbs = int(engine.train_micro_batch_size_per_gpu())
        activation = int(self._counted[0])
        mine = {"activation": activation}
        activation = max(m["activation"] for m in self._gather(mine))
        self.result = {
            "num_params": sum(numel),
            "trainable_num_params": sum(n for n, p in zip(numel, params) if p.requires_grad),
            "activation_mem_per_gpu": activation,
            "activation_mem_per_sample": activation / mbs,
            "micro_batch_size": mbs,
            "world_size": self.world_size,
        }
        if self.rank == 0:
            write_json_atomic(self.config.model_info_path, self.result)
            print(f"dsplug autotuning: model info {self.result}; wrote {self.config.model_info_path}; ending the run",
                  flush=True)
        raise SystemExit(0)

    # ------------------------------------------------------------------ helpers
    def _gather(self, mine: Dict[str, Any]):
        comm = getattr(self.context, "comm", None)
        if self.world_size <= 1 or comm is None:
            return [mine]
        return list(comm.all_gather_object(mine))

    def _now(self) -> float:
        accelerator = getattr(self.context, "accelerator", None)
        if accelerator is not None:
            accelerator.synchronize()
        return time.perf_counter()
