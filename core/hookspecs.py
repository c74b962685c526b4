"""The contract between the kernel and its plugins (the plugin author's manual).

A plugin is a module (or any object) named by an entry point in the group ``dsplug``::

    [project.entry-points.dsplug]
    my-lion = "my_package.lion_plugin"

and implements one or more of the hooks below with ``@dsplug.hookimpl``. Built-in plugins
register exactly the same way, from dsplug's own ``pyproject.toml``.

Category hooks
--------------
Each returns a list of :class:`dsplug.descriptors.PluginSpec` of its category. Importing the
plugin module and calling these hooks must be cheap (no torch work, no compilation): heavy
imports belong inside the ``factory``. The factory contract per category:

=================  ===============================================================================
accelerator        ``factory() -> Accelerator`` (see :mod:`dsplug.accelerator`);
                   ``extra={"priority": int}``: the highest-priority available one is picked
optimizer          ``factory(params, config, context) -> torch.optim.Optimizer``;
                   ``config`` is the parsed ``optimizer.params`` (an instance of ``schema``)
scheduler          ``factory(optimizer, config, context) -> scheduler`` with ``step()``,
                   ``get_last_lr()``, ``state_dict()``, ``load_state_dict()``
precision          ``factory(config, context) -> precision`` for the section it owns
zero_stage         ``factory(module, param_groups, build_optimizer, precision, config, context)
                   -> stage`` for ``zero_optimization.stage``: owns gradients -> update -> weights
offload_device     ``factory(config, context) -> device`` for ``offload_*.device``
monitor            ``factory(config, context) -> observer`` (an object with lifecycle hookimpls)
compression        ``factory(config, context) -> method``
observer           ``factory(config, context) -> observer`` (profilers, loggers)
section            no factory: the plugin only owns the schema of ``section``
=================  ===============================================================================

``context`` is the engine's :class:`dsplug.context.BuildContext` (accelerator, comm, config,
rank, world size, model): plugins talk to the world through it, never through globals.

Lifecycle hooks
---------------
Observers built by monitor / observer factories, and any registered plugin that implements these
directly, are called by every engine. They must not raise for ordinary training events.
"""
from __future__ import annotations

import pluggy

PROJECT = "dsplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: category -> name of the hook that returns that category's specs
CATEGORY_HOOKS = {
    "accelerator": "dsplug_accelerators",
    "optimizer": "dsplug_optimizers",
    "scheduler": "dsplug_schedulers",
    "precision": "dsplug_precisions",
    "zero_stage": "dsplug_zero_stages",
    "offload_device": "dsplug_offload_devices",
    "monitor": "dsplug_monitors",
    "compression": "dsplug_compression_methods",
    "observer": "dsplug_observers",
    "section": "dsplug_config_sections",
}


class CategorySpecs:
    """One hook per plugin category; each returns ``list[PluginSpec]``."""

    @hookspec
    def dsplug_accelerators(self):
        """Device backends (cpu, cuda, ...)."""

    @hookspec
    def dsplug_optimizers(self):
        """Optimizers selectable by ``optimizer.type``."""

    @hookspec
    def dsplug_schedulers(self):
        """LR schedulers selectable by ``scheduler.type``."""

    @hookspec
    def dsplug_precisions(self):
        """Precision modes (fp32, fp16, bf16, amp), each owning its config section."""

    @hookspec
    def dsplug_zero_stages(self):
        """ZeRO stages selectable by ``zero_optimization.stage``."""

    @hookspec
    def dsplug_offload_devices(self):
        """Offload targets selectable by ``offload_optimizer.device`` / ``offload_param.device``."""

    @hookspec
    def dsplug_monitors(self):
        """Metric sinks (tensorboard, csv_monitor, wandb, comet), each owning its section."""

    @hookspec
    def dsplug_compression_methods(self):
        """Compression methods under ``compression_training``."""

    @hookspec
    def dsplug_observers(self):
        """Training observers (flops profiler, comms logger) owning their sections."""

    @hookspec
    def dsplug_config_sections(self):
        """Config sections owned by a plugin that is not itself a selectable feature."""


class LifecycleSpecs:
    """Events of a training run. Every argument is passed by keyword."""

    @hookspec
    def dsplug_engine_built(self, engine):
        """The engine is fully constructed (model, optimizer, scheduler, precision in place)."""

    @hookspec
    def dsplug_forward_begin(self, engine):
        """A micro-step's forward pass is about to run."""

    @hookspec
    def dsplug_forward_end(self, engine, output):
        """A micro-step's forward pass returned ``output``."""

    @hookspec
    def dsplug_step_end(self, engine, metrics):
        """An optimizer step (at a gradient-accumulation boundary) finished.

        ``metrics`` maps names to floats: ``loss`` (mean over the accumulated micro-steps),
        ``lr``, ``loss_scale`` (when mixed precision scales), ``global_samples``,
        ``global_steps``, ``skipped`` (1.0 if an overflow skipped the step) and, with
        ``wall_clock_breakdown``, ``forward_ms`` / ``backward_ms`` / ``step_ms``.
        """

    @hookspec
    def dsplug_checkpoint_state(self, engine):
        """Return a dict of extra state to save with a checkpoint (or None). It is saved under this
        observer's name and handed back by ``dsplug_load_checkpoint_state``; keep it to tensors and
        plain Python values (checkpoints load with ``weights_only=True``)."""

    @hookspec
    def dsplug_load_checkpoint_state(self, engine, state):
        """A checkpoint is being loaded: ``state`` is what this observer returned when it was saved."""

    @hookspec
    def dsplug_engine_closed(self, engine):
        """The engine is being torn down: flush and close files."""
