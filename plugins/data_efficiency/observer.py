"""The data-efficiency engine observer and the engine methods it adds.

With the ``data_efficiency`` section enabled the factory (:func:`build_observer`) builds a :class:`DataEfficiency` observer on the engine's event bus, which

* gives the training loader its sampling (``dsplug_dataloader_options``): a
  :class:`~.sampler.DeepSpeedDataSampler` when curriculum sampling is on;
* configures the model's :class:`~.random_ltd.RandomLayerTokenDrop` layers when the engine is built
  and updates their kept-token count after every optimizer step (``dsplug_step_end``);
* checkpoints the sampler and the random-LTD schedule (shared file keys
  ``data_efficiency.data_sampler`` / ``data_efficiency.random_ltd``);
* adds ``engine.set_custom_curriculum_learning_schedule`` (curriculum on) and
  ``engine.random_ltd_initialize`` / ``engine.random_ltd_scheduler`` /
  ``engine.convert_to_random_ltd(layer_class)`` (random-LTD on).

Every engine also gets DeepSpeed's accessors (``data_efficiency_enabled()``,
``curriculum_learning_enabled()``, ``random_ltd_enabled()``, ``..._config()``,
``random_ltd_num_layer()``), from :func:`engine_methods` (the plugin's ``dsplug_engine_methods`` hook).
"""
from __future__ import annotations

from dsplug.contracts import Observer
from dsplug.hookspecs import hookimpl

from .config import DataEfficiencyConfig, curriculum_on, random_ltd_on

SECTION = "data_efficiency"
SAMPLER_KEY = "data_efficiency.data_sampler"
RANDOM_LTD_KEY = "data_efficiency.random_ltd"


class DataEfficiency(Observer):
    name = SECTION

    def __init__(self, config: DataEfficiencyConfig, context):
        self.config = config
        self.context = context
        self.curriculum = curriculum_on(config)
        self.random_ltd = random_ltd_on(config)
        self.sampler = None  # the latest training sampler built
        self._pending_sampler_state = None  # loaded before any sampler was built
        self._custom_schedules = {}
        self.scheduler = None
        self.layers = []
        if self.random_ltd:
            from .random_ltd import RandomLTDScheduler

            self.scheduler = RandomLTDScheduler(config.data_routing.random_ltd,
                                                global_batch_size=context.config.train_batch_size)

    # ------------------------------------------------------------------ curriculum sampling
    @hookimpl
    def dsplug_dataloader_options(self, engine, dataset, batch_size):
        if not self.curriculum:
            return None
        from .sampler import DeepSpeedDataSampler

        sampler = DeepSpeedDataSampler(self.config, len(dataset), batch_size, engine.global_rank, engine.world_size,
                                       None, engine.gradient_accumulation_steps(), engine.global_rank,
                                       drop_last=engine.config.dataloader_drop_last)
        if self._custom_schedules:
            sampler.set_custom_curriculum_learning_schedule(self._custom_schedules)
        if self._pending_sampler_state is not None:
            sampler.load_state_dict(self._pending_sampler_state)
            self._pending_sampler_state = None
        self.sampler = sampler
        sampling = self.config.data_sampling
        return {"batch_sampler": sampler, "num_workers": sampling.num_workers, "pin_memory": sampling.pin_memory}

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict):
        """``{metric: fn(step) -> difficulty}``, or one ``fn`` for every metric with schedule_type custom."""
        metrics = self.config.data_sampling.curriculum_learning.curriculum_metrics
        if callable(schedule_func_dict):
            schedule_func_dict = {n: schedule_func_dict for n, m in metrics.items() if m.schedule_type == "custom"}
        unknown = sorted(set(schedule_func_dict) - set(metrics))
        if unknown:
            raise KeyError(f"set_custom_curriculum_learning_schedule: {unknown} are not curriculum metrics "
                           f"(configured: {sorted(metrics)})")
        self._custom_schedules.update(schedule_func_dict)
        if self.sampler is not None:
            self.sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    # ------------------------------------------------------------------ random-LTD
    def convert_to_random_ltd(self, engine, layer_class):
        """``engine.convert_to_random_ltd(layer_class)``: DeepSpeed's ``convert_to_random_ltd(engine,
        layer_class)`` as an engine method, for code that reaches random-LTD through the engine
        (the ``dsplug train`` model) rather than through the import path."""
        from .random_ltd import convert_to_random_ltd

        return convert_to_random_ltd(engine, layer_class)

    def random_ltd_initialize(self, engine):
        from .random_ltd import initialize_layers

        self.layers = initialize_layers(engine.module, self.config.data_routing.random_ltd, self.scheduler)
        self.scheduler.update_seq(engine.global_steps)
        return self.layers

    @hookimpl
    def dsplug_engine_built(self, engine):
        if not self.random_ltd:
            return
        from dsplug.logging import log_rank0

        from .random_ltd import random_ltd_layers

        if random_ltd_layers(engine.module):
            self.random_ltd_initialize(engine)
        else:
            self.scheduler.update_seq(engine.global_steps)
            log_rank0("data_efficiency: random_ltd is enabled but the model has no RandomLayerTokenDrop layers "
                      "yet; wrap its transformer layers with convert_to_random_ltd(model_or_engine, LayerClass)")

    @hookimpl
    def dsplug_step_end(self, engine):
        if self.random_ltd:
            self.scheduler.count_step()
            self.scheduler.update_seq(engine.global_steps)

    # ------------------------------------------------------------------ engine methods, checkpoints
    @hookimpl
    def dsplug_engine_methods(self, engine):
        methods = {}
        if self.curriculum:
            methods["set_custom_curriculum_learning_schedule"] = self.set_custom_curriculum_learning_schedule
        if self.random_ltd:
            methods["random_ltd_initialize"] = lambda: self.random_ltd_initialize(engine)
            methods["random_ltd_scheduler"] = self.scheduler  # DeepSpeed's engine attribute
            methods["convert_to_random_ltd"] = lambda layer_class: self.convert_to_random_ltd(engine, layer_class)
        return methods

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        if scope != "model":
            return None
        state = {}
        if self.curriculum:
            state[SAMPLER_KEY] = self.sampler.state_dict() if self.sampler is not None else self._pending_sampler_state
        if self.random_ltd:
            state[RANDOM_LTD_KEY] = self.scheduler.state_dict()
        return state

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        if checkpoint.options.load_module_only:
            return
        saved = checkpoint.model.get(SAMPLER_KEY)
        if self.curriculum and saved is not None:
            if self.sampler is not None:
                self.sampler.load_state_dict(saved)
            else:
                self._pending_sampler_state = saved
        saved = checkpoint.model.get(RANDOM_LTD_KEY)
        if self.random_ltd and saved is not None:
            self.scheduler.load_state_dict(saved)


def build_observer(config, context):
    """``factory(config, context)``: the observer, or None when no data-efficiency feature is on."""
    if config is None:
        return None
    if isinstance(config, dict):
        from dsplug.config.schema import parse

        config = parse(DataEfficiencyConfig, config, SECTION)
    if not (curriculum_on(config) or random_ltd_on(config)):
        return None
    return DataEfficiency(config, context)


def deepspeed_config(config):
    """DeepSpeed's ``DeepSpeedConfig`` attributes: ``data_efficiency_enabled`` and
    ``data_efficiency_config`` (the section with its defaults filled in)."""
    from dsplug.config.schema import to_dict

    section = config.sections.get(SECTION)
    section = section if section is not None else DataEfficiencyConfig()
    return {"data_efficiency_enabled": bool(section.enabled), "data_efficiency_config": to_dict(section)}


def _section(engine) -> DataEfficiencyConfig:
    section = engine.config.sections.get(SECTION)
    return section if section is not None else DataEfficiencyConfig()


def engine_methods(engine):
    """DeepSpeed's data-efficiency accessors (on every engine)."""
    from dsplug.config.schema import to_dict

    return {
        "data_efficiency_enabled": lambda: bool(_section(engine).enabled),
        "data_efficiency_config": lambda: to_dict(_section(engine)),
        "data_sampling_enabled": lambda: bool(_section(engine).enabled and _section(engine).data_sampling.enabled),
        "data_sampling_config": lambda: to_dict(_section(engine).data_sampling),
        "curriculum_learning_enabled": lambda: curriculum_on(_section(engine)),
        "curriculum_learning_config": lambda: to_dict(_section(engine).data_sampling.curriculum_learning),
        "random_ltd_enabled": lambda: random_ltd_on(_section(engine)),
        "random_ltd_config": lambda: to_dict(_section(engine).data_routing.random_ltd),
        "random_ltd_num_layer": lambda: _section(engine).data_routing.random_ltd.random_ltd_layer_num,
    }
