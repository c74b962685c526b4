"""DeepSpeed's top-level API: ``initialize``, ``init_distributed``, ``add_config_arguments``."""
from __future__ import annotations

import argparse

from .comm import init_distributed  # noqa: F401  (re-exported as dsplug.init_distributed)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None):
    """Build an engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The engine is a :class:`dsplug.engine.Engine`, or the subclass a plugin names for this model
    through the ``dsplug_engine_factory`` hook (a ``PipelineEngine`` for a ``PipelineModule``).

    ``mpu``: a model-parallel unit (DeepSpeed's six ``get_{model,data}_parallel_{rank,group,world_size}``
    methods, e.g. Megatron's): data-parallel reductions, ZeRO partitions, the batch arithmetic and
    the data loader use its data-parallel group, and checkpoints are written per model-parallel slice.

    The config comes from ``config`` (path, dict or JSON text), ``config_params`` (a dict, the older
    name), or ``args.deepspeed_config`` (from :func:`add_config_arguments`).
    """
    from .engine import Engine
    from .registry import get_registry

    source = _config_source(args, config, config_params)
    # a plugin may train this model with its own engine class (the pipeline plugin: PipelineModule)
    engine_class = get_registry().pm.hook.dsplug_engine_factory(model=model, mpu=mpu) or Engine
    engine = engine_class(model=model, config=source, optimizer=optimizer, model_parameters=model_parameters,
                          training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                          dist_init_required=dist_init_required, mpu=mpu)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_source(args, config, config_params):
    given = [c for c in (config, config_params) if c is not None]
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        given.append(from_args)
    if not given:
        raise ValueError("dsplug.initialize: no config given; pass config= (a path, dict or JSON text) or "
                         "args with --deepspeed_config")
    if len(given) > 1:
        raise ValueError("dsplug.initialize: the config was given more than once (config=, config_params= and "
                         "args.deepspeed_config); give exactly one")
    return given[0]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` arguments to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (helper flag for user code, no impact on dsplug)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
