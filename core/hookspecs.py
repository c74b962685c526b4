"""The contract between the kernel and its plugins: the plugin author's manual.

A plugin is a module (or any object) named by an entry point in the group ``dsplug``::

    [project.entry-points.dsplug]
    my-lion = "my_package.lion_plugin"

and implements one or more of the hooks below with ``@dsplug.hookimpl``. Built-in plugins
register exactly the same way, from dsplug's own ``pyproject.toml``. Hook implementations may
take any subset of a hook's arguments, always passed by keyword. A function named ``dsplug_*``
that matches no hook below is reported by ``dsplug list`` (a misspelled hook is never silently
ignored).

There are three kinds of hook:

* **Category hooks** (``dsplug_optimizers`` ...) describe what a plugin provides. Each returns a
  list of :class:`dsplug.PluginSpec`; the config value that selects a plugin is matched against
  ``spec.name``. Importing the plugin module and calling these hooks must be cheap (no torch
  work, no compilation): heavy imports belong inside the ``factory``. What each factory builds
  is a contract class in :mod:`dsplug.contracts` (its docstrings say what the engine calls and
  when).
* **Service hooks** (``dsplug_cli_commands``, ``dsplug_api_modules``, ``dsplug_estimate_*``,
  ``dsplug_auto_value``, ``dsplug_batch_sizes``, ``dsplug_engine_factory``) let a plugin extend
  the kernel's own services: the command line, DeepSpeed's import paths, memory estimates,
  Hugging Face ``"auto"`` values, the batch sizes (elastic training) and the engine class
  ``initialize`` builds for a model (the pipeline engine for a ``PipelineModule``).
* **Lifecycle hooks** (``dsplug_engine_built`` ...) are events of one engine. They are called
  on the engine's own event bus, which holds: the observers and monitors the config enabled;
  the parts the engine built that subclass a contract with checkpoint state (ZeRO stage,
  precision, compression methods); and every registered plugin that implements a lifecycle hook
  at module level. They must not raise for ordinary training events; when one does, the error
  names the plugin and the hook.

``context`` below is the engine's :class:`dsplug.context.BuildContext` (accelerator, comm,
config, rank, world size, model, registry): plugins talk to the world through it, never through
globals.
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
    """One hook per plugin category; each returns ``list[PluginSpec]`` of that category."""

    @hookspec
    def dsplug_accelerators(self):
        """Device backends. ``factory() -> dsplug.contracts.Accelerator``.

        The backend named by ``DSPLUG_ACCELERATOR`` (or ``DS_ACCELERATOR``) is used; otherwise the
        available one (``is_available()``) with the highest ``spec.priority``.
        """

    @hookspec
    def dsplug_optimizers(self):
        """Optimizers selected by ``optimizer.type``.

        ``factory(param_groups, params, context) -> torch.optim.Optimizer`` where ``params`` is the
        parsed ``optimizer.params`` (an instance of ``spec.schema``; its fields are the keys a user
        may write, checked strictly). The ZeRO stage decides which tensors the optimizer steps
        (fp32 master partitions at stages 1-3). ``spec.states_per_param`` feeds memory estimates.
        """

    @hookspec
    def dsplug_schedulers(self):
        """LR schedulers selected by ``scheduler.type``.

        ``factory(optimizer, params, context) -> dsplug.contracts.LRScheduler``. The engine calls
        ``step()`` once per applied optimizer step; its state is saved with every checkpoint.
        """

    @hookspec
    def dsplug_precisions(self):
        """Precision modes, each owning its config section (``fp16``, ``bf16``, ``amp``).

        ``factory(section, context) -> dsplug.contracts.Precision``. The mode whose section has
        ``enabled: true`` is used, else the spec with ``default=True`` (fp32).
        """

    @hookspec
    def dsplug_zero_stages(self):
        """ZeRO stages, selected by the section spec whose ``selects`` is ``("zero_stage", field)``
        (``zero_optimization.stage``: DeepSpeed's 0-3 or any registered name).

        ``factory(module, param_groups, build_optimizer, precision, section, context) ->
        dsplug.contracts.ZeroStage``. ``build_optimizer(groups)`` builds the configured (or client)
        optimizer over the groups the stage chooses. The stage owns the path gradients -> update
        -> weights, and the module's and optimizer's checkpoint state. Give the spec
        ``traits=dsplug.contracts.ZeroStageTraits(...)``: what it partitions and offloads, read by
        config checks without building it.
        """

    @hookspec
    def dsplug_offload_devices(self):
        """Offload targets, selected by ``offload_optimizer.device`` / ``offload_param.device``.

        ``factory(section, context) -> dsplug.contracts.OffloadDevice``: storage (allocate, read,
        write, prefetch, free) with declared capabilities; ZeRO stages build and use them. Make the
        factory the device class (or give ``traits=`` its capabilities) so config checks see them.
        """

    @hookspec
    def dsplug_monitors(self):
        """Metric sinks (tensorboard, csv_monitor, wandb, comet), each owning its section.

        ``factory(section, context) -> dsplug.contracts.Monitor`` (or None when disabled). The
        monitor joins the engine's event bus.
        """

    @hookspec
    def dsplug_compression_methods(self):
        """Compression methods, selected by their key under ``compression_training``.

        ``spec.name`` is the key (``"weight_quantization"``); ``spec.schema`` parses its value.
        ``factory(section, context) -> dsplug.contracts.CompressionMethod`` (or None when the section
        is disabled); the engine applies ``compress(model)`` at initialize, in order of
        ``spec.priority`` (highest first) and then config order, and joins the method to its event bus.
        """

    @hookspec
    def dsplug_observers(self):
        """Training observers (profilers, loggers) owning their sections.

        ``factory(section, context) -> dsplug.contracts.Observer`` (or None when disabled).
        """

    @hookspec
    def dsplug_config_sections(self):
        """Config sections owned by a plugin that is not itself a selectable feature (no factory).

        A section spec may set ``selects=(category, field)`` to name the field that selects a
        plugin of another category.
        """


class ServiceSpecs:
    """Hooks that extend the kernel's services."""

    @hookspec
    def dsplug_cli_commands(self):
        """Subcommands of the ``dsplug`` command: a list of :class:`dsplug.descriptors.CliCommand`.

        Called when the command line is built, so keep it cheap. Two plugins contributing the same
        command name is reported and the later one skipped.
        """

    @hookspec
    def dsplug_api_modules(self):
        """DeepSpeed import paths this plugin provides: a list of :class:`dsplug.descriptors.ApiModule`.

        ``ApiModule("dsplug.zero", "my_pkg.zero_api")``: ``dsplug.zero.Init`` resolves to
        ``my_pkg.zero_api.Init`` on first use. The kernel must hold a forwarding module at ``path``
        (see :func:`dsplug.public.forward_to_plugin`).
        """

    @hookspec(firstresult=True)
    def dsplug_estimate_model_state_bytes(self, num_params, world_size, config):
        """Per-rank bytes of model states for ``config`` (``dsplug config explain``).

        ``num_params``: the model's parameter count; ``world_size``: data-parallel ranks;
        ``config``: the :class:`dsplug.DsplugConfig`. Return a dict with at least ``total`` (and
        any breakdown: ``parameters``, ``gradients``, ``optimizer_states``), or None when this
        plugin does not own the estimate. The first non-None answer wins (firstresult).
        """

    @hookspec
    def dsplug_batch_sizes(self, config, world_size, report):
        """The batch sizes, when a plugin decides them (elastic training does, from its section).

        Called while a :class:`dsplug.DsplugConfig` is built, after every section is parsed and
        before the kernel infers the batch triple. ``config``: that config (``raw``, ``kernel``
        with the keys the user gave, ``sections``); ``world_size``: the data-parallel size, or
        None when unknown (``dsplug config check``); ``report``: record errors / notices there
        with the JSON path at fault (``report.error(path, message)``).

        Return None when not yours. Otherwise a dict with some of ``train_batch_size``,
        ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``: they replace the
        config's own keys (a key left out counts as not given) and the kernel infers and checks
        the triple from them as usual. Checking the user's own batch keys against yours is your
        job. Return ``{}`` after recording an error. Two plugins answering is an error naming both.
        """

    @hookspec(firstresult=True)
    def dsplug_auto_value(self, path, hidden_size):
        """The value of an ``"auto"`` key derived from the model (Hugging Face's convention).

        ``path``: the dotted JSON path (``"zero_optimization.reduce_bucket_size"``);
        ``hidden_size``: the model's hidden size. Return the value, or None if not yours.
        """

    @hookspec(firstresult=True)
    def dsplug_engine_factory(self, model, mpu):
        """The engine class for ``model`` when it needs its own (DeepSpeed returns a
        ``PipelineEngine`` for a ``PipelineModule``).

        Asked by ``dsplug.initialize`` with the ``model`` and ``mpu`` it was given. Return None
        when the model is not yours, else a subclass of :class:`dsplug.engine.Engine` (or a
        callable with its keyword arguments: ``model``, ``config``, ``optimizer``,
        ``model_parameters``, ``training_data``, ``lr_scheduler``, ``collate_fn``,
        ``dist_init_required``, ``mpu``) returning one. The first non-None answer wins; keep the
        check cheap (``initialize`` asks for every model) and raise for a model that is yours but
        cannot be trained with these arguments.
        """


class LifecycleSpecs:
    """Events of one engine's training run. Every argument is passed by keyword."""

    @hookspec(historic=True)
    def dsplug_engine_built(self, engine):
        """The engine is fully constructed (model, optimizer, scheduler, precision in place).

        Historic: an observer joining the bus later (``engine.add_observer``) still receives it.
        """

    @hookspec
    def dsplug_engine_methods(self, engine):
        """Methods this part adds to the engine, as ``{name: callable}`` (called with the
        caller's arguments): DeepSpeed engine methods that belong to a feature, e.g.
        ``set_custom_curriculum_learning_schedule``. Collected once, after the engine is built;
        a name the engine already has, or that two parts add, is an error naming it.
        """

    @hookspec
    def dsplug_forward_begin(self, engine):
        """A micro-step's forward pass is about to run.

        May return a dict of keyword arguments the engine adds to this call of the model's
        forward, as DeepSpeed's engine passes ``curriculum_seqlen`` (curriculum learning) or
        ``progressive_layer_drop`` / ``pld_theta``. Keywords the caller passed win; two plugins
        returning the same keyword is an error naming it.
        """

    @hookspec
    def dsplug_dataloader_options(self, engine, dataset, batch_size):
        """``engine.deepspeed_io`` (``initialize(training_data=...)``) is building a training
        loader over ``dataset`` (micro-batches of ``batch_size``) and the caller gave no
        ``data_sampler``.

        May return a dict of ``torch.utils.data.DataLoader`` keyword arguments that replace the
        engine's default sampling (a ``DistributedSampler``): ``batch_sampler`` (required: an
        iterable of this rank's micro-batches of dataset indices; it then owns shuffling,
        sharding over ranks and the number of epochs) and optionally ``num_workers`` /
        ``pin_memory``. DeepSpeed's data-efficiency curriculum sampler comes this way. Two
        plugins answering is an error naming both.
        """

    @hookspec
    def dsplug_forward_end(self, engine, output):
        """A micro-step's forward pass returned ``output``."""

    @hookspec
    def dsplug_step_end(self, engine, metrics):
        """An optimizer step (at a gradient-accumulation boundary) finished.

        ``metrics`` maps names to floats: ``loss`` (mean over the accumulated micro-steps),
        ``lr``, ``global_samples``, ``global_steps``, ``skipped`` (1.0 if the step was skipped),
        what the precision adds (``loss_scale`` when it scales) and, with
        ``wall_clock_breakdown``, ``forward_ms`` / ``backward_ms`` / ``step_ms``. Implementations
        may add keys for those called after them (call order is pluggy's: last registered first).
        """

    @hookspec
    def dsplug_checkpoint_state(self, engine, scope, options):
        """Contribute state to a checkpoint being saved: return ``{key: state}`` or None.

        Called on every rank, once per ``scope``:

        * ``"model"``: the shared file, written by rank 0 only (state that is the same on every
          rank: module weights, scheduler, schedules). Collectives are allowed here (ZeRO-3
          gathers its partitions); every rank is called.
        * ``"rank"``: this rank's own file (partitions, per-rank buffers).

        Keys are yours to choose and share one namespace per file: prefix them with your plugin
        name. Two implementations returning the same key is an error naming both. Values must be
        tensors and plain Python data (checkpoints load with ``weights_only=True``).
        ``options`` is a :class:`dsplug.contracts.SaveOptions` (tag, ``exclude_frozen_parameters``).
        """

    @hookspec
    def dsplug_checkpoint_files(self, engine, shared, options):
        """Files of your own in the checkpoint being saved: return ``{file name: state}`` that THIS
        rank writes, or None.

        Called on every rank after every ``dsplug_checkpoint_state`` contribution is collected.
        ``shared`` is the merged ``scope="model"`` dict the shared file will hold (``"module"``:
        the module state dict): remove from it, in place, entries your files hold instead (MoE
        experts, one file per expert, as DeepSpeed keeps them out of the model file). The engine
        writes the files crash-safely into the tag directory with its own and lists them in the
        manifest (verified when read). A name must be a plain file name, not one of the engine's
        files, and written by one rank only (a clash is an error naming the file). Values as for
        ``dsplug_checkpoint_state``. Read them back in :meth:`dsplug_checkpoint_read`.
        """

    @hookspec
    def dsplug_checkpoint_read(self, engine, checkpoint):
        """A checkpoint's files are read; nothing is loaded yet. Complete ``checkpoint.model`` /
        ``checkpoint.rank`` (a :class:`dsplug.contracts.CheckpointView`) in place from the files you
        wrote with :meth:`dsplug_checkpoint_files` (under ``checkpoint.path``; read them with
        :func:`dsplug.checkpoint.load_file`), e.g. put the entries you took out back into
        ``checkpoint.model["module"]`` under this run's names, so every part then loads as usual.
        An error on any rank stops the load on every rank with its message.
        """

    @hookspec
    def dsplug_load_checkpoint_state(self, engine, checkpoint):
        """A checkpoint is being loaded; take back what you saved.

        ``checkpoint`` is a :class:`dsplug.contracts.CheckpointView`: ``model`` (the shared file's
        dict), ``rank`` (this rank's file's dict), ``saved_world_size``, ``read_rank(r)`` (another
        rank's dict, to re-slice partitions saved at another world size) and ``options`` (the
        ``load_checkpoint`` flags). A key you look for may be absent (a checkpoint from before
        your plugin was installed): leave your state as it is then. Parts that must load first
        (the module, before optimizer state) use ``@hookimpl(tryfirst=True)``.
        """

    @hookspec
    def dsplug_engine_closed(self, engine):
        """The engine is being torn down: flush and close files, remove hooks."""
