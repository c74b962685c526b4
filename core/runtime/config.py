"""DeepSpeed's ``deepspeed.runtime.config``: :class:`DeepSpeedConfig` and the config-key constants.

``DeepSpeedConfig(config)`` (a path, a dict or JSON text) parses the config as the engine would,
with the batch sizes resolved against the current data-parallel world size, and answers
DeepSpeed's attribute names (``train_batch_size``, ``zero_optimization_stage``, ``fp16_enabled``
...), which is how integrations such as Hugging Face's read a config. The kernel answers its own
keys (batch sizes, gradient clipping, checkpoint, optimizer, scheduler ...); each feature's
attributes come from the plugin owning its section (``PluginSpec.deepspeed_config``). ``"auto"`` values are
accepted and stay ``"auto"`` (the engine resolves them). The parsed
:class:`dsplug.config.DsplugConfig` is ``.config``; ``_param_dict`` is the resolved dict.
"""
from __future__ import annotations

import json
import types
import warnings
from typing import Any, Dict, Optional

from dsplug.api_paths import plugin_names

from ..config import ConfigError, DsplugConfig
from .constants import *  # noqa: F401,F403 - DeepSpeed's runtime.config re-exports its constants

#: DeepSpeed's name for the error a bad config raises
DeepSpeedConfigError = ConfigError

def _dtype(name: Optional[str]):
    if name is None:
        return None
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


class DeepSpeedConfig:
    """A config's values under DeepSpeed's ``DeepSpeedConfig`` attribute names.

    ``config``: a path, dict or JSON text (or a parsed :class:`~dsplug.config.DsplugConfig`).
    ``mpu`` (model parallelism) must be None. ``world_size``: the data-parallel size the batch sizes
    are resolved against (default: the current process group's size, 1 before
    ``init_distributed``).
    """

    def __init__(self, config, mpu=None, mesh_device=None, world_size: Optional[int] = None):
        if mpu is not None:
            raise NotImplementedError("DeepSpeedConfig: model parallelism (mpu) is not available in dsplug")
        from .. import comm

        self.global_rank = comm.get_rank()
        self.world_size = int(world_size) if world_size is not None else comm.get_world_size()
        self.config = config if isinstance(config, DsplugConfig) else DsplugConfig(config, world_size=self.world_size)
        self._param_dict: Dict[str, Any] = self.config.to_dict()
        self._initialize_params(self._param_dict)

    # ------------------------------------------------------------------ derived values
    def _initialize_params(self, d: Dict[str, Any]) -> None:
        kernel = self.config.kernel
        self.train_batch_size = kernel.train_batch_size
        self.train_micro_batch_size_per_gpu = kernel.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = kernel.gradient_accumulation_steps
        self.steps_per_print = kernel.steps_per_print
        self.dump_state = kernel.dump_state
        self.disable_allgather = kernel.disable_allgather
        self.communication_data_type = _dtype(kernel.communication_data_type)
        self.fp32_allreduce = kernel.fp32_allreduce
        self.prescale_gradients = kernel.prescale_gradients
        self.gradient_predivide_factor = kernel.gradient_predivide_factor
        self.gradient_allreduce_op = kernel.gradient_allreduce_op
        self.sparse_gradients_enabled = kernel.sparse_gradients
        self.gradient_clipping = kernel.gradient_clipping
        self.wall_clock_breakdown = kernel.wall_clock_breakdown
        self.memory_breakdown = kernel.memory_breakdown
        self.zero_allow_untested_optimizer = kernel.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = kernel.zero_force_ds_cpu_optimizer
        self.dataloader_drop_last = kernel.dataloader_drop_last
        self.seed = kernel.seed
        self.grad_accum_dtype = kernel.data_types.grad_accum_dtype
        checkpoint = kernel.checkpoint
        self.checkpoint_tag_validation_enabled = str(checkpoint.tag_validation).lower() != "ignore"
        self.checkpoint_tag_validation_fail = str(checkpoint.tag_validation).lower() == "fail"
        self.load_universal_checkpoint = checkpoint.load_universal
        self.use_node_local_storage = checkpoint.use_node_local_storage

        optimizer = d.get(OPTIMIZER)  # noqa: F405
        self.optimizer_name = optimizer["type"].lower() if optimizer else None
        self.optimizer_params = dict(optimizer.get("params", {})) if optimizer else None
        self.optimizer_legacy_fusion = False
        scheduler = d.get(SCHEDULER)  # noqa: F405
        self.scheduler_name = scheduler["type"] if scheduler else None
        self.scheduler_params = dict(scheduler.get("params", {})) if scheduler else None

        from ..unavailable import CONFIG_ATTRIBUTES

        own = [*vars(self), *(n for n in vars(DeepSpeedConfig) if not n.startswith("_"))]
        self._answered_by: Dict[str, str] = {name: "the kernel" for name in own}
        self._plugin_attributes()
        for name, value in CONFIG_ATTRIBUTES.items():  # features dsplug lacks: a config cannot enable them
            if name not in self._answered_by:
                setattr(self, name, value)
                self._answered_by[name] = "dsplug.unavailable"

    def _plugin_attributes(self) -> None:
        """Each plugin's ``PluginSpec.deepspeed_config`` answers the attributes of its feature
        (``fp16_enabled`` from the fp16 precision plugin, ``pld_params`` from progressive layer
        drop ...). A name already answered keeps its first answer; a clash or a failing plugin is
        reported with a warning naming the plugin."""
        for provided in self.config.registry.all():
            answer = provided.spec.deepspeed_config
            if answer is None:
                continue
            who = f"{provided.category}:{provided.name} ({provided.distribution})"
            try:
                values = dict(answer(self.config))
            except Exception as exc:  # noqa: BLE001 - one plugin's bug must not hide the other attributes
                warnings.warn(f"DeepSpeedConfig: the deepspeed_config of plugin {who} failed: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)
                continue
            for name, value in values.items():
                if name in self._answered_by:
                    warnings.warn(f"DeepSpeedConfig.{name}: plugin {who} answers it, but {self._answered_by[name]} "
                                  "already does; the first answer is kept", RuntimeWarning, stacklevel=3)
                    continue
                setattr(self, name, value)
                self._answered_by[name] = f"plugin {who}"

    def __getattr__(self, name):  # only called for a name nothing answered
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"DeepSpeedConfig has no attribute {name!r}: neither the kernel nor an installed plugin "
                             "answers it (a feature's attributes come from the plugin owning its config section; "
                             "`dsplug list` shows what is installed)")

    @property
    def monitor_config(self) -> Any:
        """DeepSpeed's monitor config object: one attribute per installed monitor's section
        (``tensorboard``, ``csv_monitor`` ...), the parsed section or its defaults when absent;
        ``enabled``: whether any monitor is."""
        names = sorted({p.spec.section for p in self.config.registry.all() if p.category == "monitor" and p.spec.section})
        sections = {name: self.config.section(name) for name in names}
        return types.SimpleNamespace(**sections, enabled=any(getattr(s, "enabled", False) for s in sections.values()))

    @property
    def checkpoint_config(self) -> Dict[str, Any]:
        return dict(self._param_dict.get(CHECKPOINT) or {})  # noqa: F405

    def _configure_train_batch_size(self) -> None:
        """Resolve ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
        ``gradient_accumulation_steps`` from their attributes as set now (None: infer it), against
        ``world_size``, as DeepSpeed does. A triple that does not fit raises ``AssertionError`` (what
        DeepSpeed raises here) naming the values; the attributes are then left as they were."""
        from ..config.batch import BatchError, infer_batch

        try:
            resolved = infer_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                   self.gradient_accumulation_steps, self.world_size)
        except BatchError as exc:
            raise AssertionError(str(exc)) from exc
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = resolved

    def print_user_config(self) -> None:
        print(json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        print(f"{name}:")
        for key in sorted(vars(self)):
            if not key.startswith("_") and key != "config":
                print(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        print("  json = " + json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self._param_dict!r})"


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]

# plugins add names here (the optimizer names ADAM_OPTIMIZER ... come from the optimizer plugins)
__getattr__, __dir__ = plugin_names(__name__)
