"""The contract between the kernel and its plugins: the plugin author's manual.

A plugin is a module (or any object) named by an entry point in the group ``dsplug``::

    [project.entry-points.dsplug]
    my-lion = "my_package.lion_plugin"

and implements one or more of the hooks below with ``@dsplug.hookimpl``. Built-in plugins
register exactly the same way, from dsplug's own ``pyproject.toml``. Hook implementations may
take any subset of a hook's arguments, always passed by keyword. A function named ``dsplug_*``
that matches no hook below is reported by ``dsplug list`` (a misspelled hook is never silently
ignored).

There are four kinds of hook:

* **Category hooks** (``dsplug_optimizers`` ...) describe what a plugin provides. Each returns a
  list of :class:`dsplug.PluginSpec`; the config value that selects a plugin is matched against
  ``spec.name``. Importing the plugin module and calling these hooks must be cheap (no torch
  work, no compilation): heavy imports belong inside the ``factory``. What each factory builds
  is a contract class in :mod:`dsplug.contracts` (its docstrings say what the engine calls and
  when).
* **Service hooks** (``dsplug_cli_commands``, ``dsplug_api_modules``, ``dsplug_estimate_*``,
  ``dsplug_auto_value``, ``dsplug_batch_sizes``, ``dsplug_engine_factory``,
  ``dsplug_reduction_groups``, ``dsplug_param_reduction``) let a plugin extend the kernel's own
  services: the command line, DeepSpeed's import paths, memory estimates, Hugging Face ``"auto"``
  values, the batch sizes (elastic training), the engine class ``initialize`` builds for a model
  (the pipeline engine for a ``PipelineModule``) and the group a parameter's gradient is averaged
  in (MoE experts). A few more (``dsplug_gathered_parameters``, ``dsplug_flops_counter``,
  ``dsplug_activation_checkpoint_function``, ``dsplug_launch_override``) are how one plugin
  asks for what another provides: plugins never import each other's modules.
* **Lifecycle hooks** (``dsplug_engine_built`` ...) are events of one engine. They are called
  on the engine's own event bus, which holds: the observers and monitors the config enabled;
  the parts the engine built that subclass a contract with checkpoint state (ZeRO stage,
  precision, compression methods); and every registered plugin that implements a lifecycle hook
  at module level. They must not raise for ordinary training events; when one does, the error
  names the plugin and the hook.
* **Comm hooks** (``dsplug_comm_op``, ``dsplug_comm_summary``) see every collective of the comm
  layer. They are called on :data:`dsplug.comm.events`, a process-wide plugin manager: an object
  that implements them is registered there (``dsplug.comm.events.register(obj)``, as the comms
  logger does for an engine's lifetime), and installed plugins that implement them at module level
  are registered there when the process-wide registry is created.

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

        ``ApiModule("dsplug.zero", "my_pkg.zero_api")``: ``import dsplug.zero`` (``deepspeed.zero``
        with the alias) gives a module whose names are those of ``my_pkg.zero_api``, so
        ``dsplug.zero.Init is my_pkg.zero_api.Init``. Any path below ``dsplug`` works, new ones
        included: the kernel holds no file for it, the import finder of :mod:`dsplug.api_paths`
        serves it and makes its parents packages. Where the kernel has a module at ``path``, the
        kernel's names win and the plugin's add to them (if that module ends with
        ``plugin_names(__name__)``: ``dsplug``, ``dsplug.runtime``, ``dsplug.ops``,
        ``dsplug.ops.adam``, ``dsplug.ops.lion``, ``dsplug.utils``). Called when a path that is not
        a kernel module is first imported; keep it cheap (the target is imported only when its path
        is). The paths of a blocked plugin do not resolve and the ImportError says so.
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

    # -- what one plugin asks of another: a plugin never imports another's modules, it asks these
    #    hooks (through ``registry.pm.hook``); None means no installed plugin provides the service

    @hookspec(firstresult=True)
    def dsplug_gathered_parameters(self, params, modifier_rank):
        """A context manager in which each parameter of ``params`` that you hold partitioned
        OUTSIDE any engine has its full value (stage 3: parameters built under
        ``dsplug.zero.Init`` before ``initialize``), or None when none of them is yours.

        Asked only by the kernel's ``dsplug.contracts.zero_stage.gathered_parameters`` (the
        service behind ``dsplug.zero.GatheredParameters`` and the compression methods), and only
        for parameters no engine's ZeRO stage trains: the parameters of an engine go to its
        stage's ``ZeroStage.gathered`` instead, which is what a ZeRO stage implements.
        ``params``: a list of parameters; ``modifier_rank``: None to read only (changes are
        dropped on exit), or the data-parallel rank whose full values every rank keeps (its part)
        on exit. Entering is a collective: every rank of the parameters' data-parallel group
        enters with the same parameters. Building the context manager must communicate nothing.
        """

    @hookspec(firstresult=True)
    def dsplug_flops_counter(self, module, accelerator):
        """An object that counts the floating-point operations of ``module``'s forward passes, or
        None when you provide none. It has DeepSpeed ``FlopsProfiler``'s methods:
        ``start_profile()`` (start counting), ``stop_profile()`` (stop), ``get_total_flops()`` (the
        operations of the forward passes in between) and ``end_profile()`` (remove every hook).

        ``accelerator``: the engine's accelerator (for timings), or None. Asked by the autotuning
        plugin to report FLOPS.
        """

    @hookspec(firstresult=True)
    def dsplug_activation_checkpoint_function(self):
        """The function ``checkpoint(function, *args)`` that returns ``function(*args)`` keeping
        only ``args`` and recomputes ``function`` in the backward pass (DeepSpeed's
        ``deepspeed.checkpointing.checkpoint``, configured by the engine's
        ``activation_checkpointing`` section), or None when you provide none.

        Asked by the pipeline plugin for a ``PipelineModule``'s default
        ``activation_checkpoint_func``, each time it checkpoints (keep it cheap).
        """

    @hookspec(firstresult=True)
    def dsplug_launch_override(self, args, resources):
        """Run ``dsplug launch`` your own way for these arguments: return the exit status, or
        None when they are not for you (the launcher then starts the script on every process).

        Asked by the launcher after it resolved the hosts and before it starts anything; the
        autotuning plugin answers for ``--autotuning tune|run`` (it runs experiments first).
        ``args``: the parsed ``dsplug launch`` arguments (an ``argparse.Namespace``);
        ``resources``: ``{host: [slot, ...]}``, what the launch would use.
        """

    @hookspec
    def dsplug_reduction_groups(self, model, context):
        """Create the process groups your :meth:`dsplug_param_reduction` answers will name for
        ``model``'s parameters (dsplug's MoE plugin creates the ``"ep_size_<E>"`` expert groups the
        experts' ``group_name`` marks name).

        Called by the engine once, on every rank, after the model is placed on its device and
        before its parameters are broadcast (:func:`dsplug.comm.groups.broadcast_module_state`)
        and the ZeRO stage is built. ``model``: the module being trained (after compression);
        ``context``: the engine's :class:`dsplug.context.BuildContext`. Every rank is called, so
        collectives are allowed, and creating a group (``dsplug.comm.new_group``) is one: create
        the same groups in the same order on every rank, also on a rank whose part of the model
        has none of your parameters (gather what the ranks need first).

        Return the names of the groups the model's parameters use (the same list on every rank),
        or None. The engine keeps the sorted union as ``engine.reduction_groups`` ([] for a
        model whose every parameter is reduced over the data-parallel group).
        """

    @hookspec(firstresult=True)
    def dsplug_param_reduction(self, param, context):
        """Where the gradient of ``param`` is averaged, when not over the whole data-parallel group.

        Asked through :meth:`dsplug.context.BuildContext.reduction_of` by the ZeRO stages when
        they are built (once per trained parameter) and by the engine when it broadcasts the
        initial weights (once per parameter), after :meth:`dsplug_reduction_groups`; keep it
        cheap. ``param``: a ``torch.nn.Parameter`` of the model; ``context``: the engine's
        :class:`dsplug.context.BuildContext` (``context.comm`` / ``context.world_size``: the
        data-parallel group).

        Return None for a parameter that is not yours: it is summed over the data-parallel
        group and divided by its size, every rank holding the same value. Otherwise a
        :class:`dsplug.descriptors.Reduction`: a ``key`` naming the group, the ``comm`` of the
        ranks holding the same value (the gradient is summed there, ZeRO stages 1-2 partition
        the parameter over them, the engine broadcasts its initial value from their first
        rank), the ``divisor`` of the sum, the ``shard_comm`` of the ranks holding different
        values (gradient norms add over it), and ``what`` / ``advice`` for error messages.
        dsplug's MoE plugin answers for parameters marked ``allreduce = False`` (DeepSpeed's
        expert marks): their expert-data-parallel group, divided by the data-parallel world
        size. ZeRO stage 3 refuses a parameter with an answer; stages 0-2 honour it. The first
        non-None answer wins (firstresult).
        """


class CommSpecs:
    """What the comm layer (:mod:`dsplug.comm`) reports, called on :data:`dsplug.comm.events`.

    While no ``dsplug_comm_op`` implementation is registered, collectives are neither timed nor
    synchronized: watching costs nothing until someone watches.
    """

    @hookspec
    def dsplug_comm_op(self, op, nbytes, latency_s, world_size, async_op, caller):
        """One collective (or point-to-point message) of the comm layer finished.

        Called on the rank that issued it, once per op, after it completed: right after a
        blocking op, at ``wait()`` of an op launched with ``async_op=True``. While any
        implementation is registered the device is synchronized before the op starts and before
        this call, so the latency covers the op's completion (no-op on CPU).

        * ``op``: the comm layer's name of the operation: ``"all_reduce"``, ``"broadcast"``,
          ``"all_gather"``, ``"reduce_scatter"``, ``"reduce"``, ``"barrier"``, ``"send"``,
          ``"recv"``, ``"all_to_all_single"``, ``"all_to_all"`` (a gloo reduce-scatter with an op
          other than sum runs and is reported as ``"all_reduce"``);
        * ``nbytes``: the message size in bytes: the tensor of an all-reduce / broadcast / reduce /
          send / recv, the whole output of an all-gather, the whole input of a reduce-scatter or
          an all-to-all, 0 for a barrier;
        * ``latency_s``: seconds from launch to completion (to ``wait()`` for an async op);
        * ``world_size``: the size of the group the op ran in;
        * ``async_op``: the op was launched with ``async_op=True``;
        * ``caller``: the qualified name of the function outside the comm layer that issued the op
          (``"GradientBuckets._launch"``). It costs a stack walk per op, so it is looked up only
          while some registered implementation takes this argument; take it only when you use it.

        Take any subset of the arguments. The answer is ignored; an exception propagates from the
        collective that reported it.
        """

    @hookspec
    def dsplug_comm_summary(self, show_straggler):
        """``dsplug.comm.log_summary(show_straggler)`` was called: print your summary (on the ranks
        that should print) and return it as text, or None when you keep none.

        ``show_straggler``: DeepSpeed's straggler analysis was asked for; an implementation may
        gather from every rank then (every rank calls ``log_summary``). When no implementation
        answers, ``log_summary`` says that no comms logger is active.
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
        ``dsplug_checkpoint_state`` (written with ``torch.save``), or ``bytes`` written as they are
        (a JSON index; read them back with :func:`dsplug.checkpoint.read_file_bytes`). Read them
        back in :meth:`dsplug_checkpoint_read`.
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
