"""What ``initialize``'s ``optimizer=`` / ``lr_scheduler=`` / ``model_parameters=`` become.

* :func:`param_groups`: the parameter groups the ZeRO stage partitions (a client optimizer's own
  groups, remembered by index; else ``model_parameters``; frozen parameters left out);
* :func:`optimizer_builder`: how the stage builds the optimizer over its groups (the client's,
  re-bound; a client callable; the config's ``optimizer`` section);
* :func:`build_scheduler`: the scheduler (a client object or callable; the config's ``scheduler``).

A client optimizer / scheduler takes the place of the config's section, as DeepSpeed documents.
"""
from __future__ import annotations

import logging
from typing import List

import torch

from .logging import log_rank0

CLIENT_GROUP_INDEX = "_dsplug_client_group"


class SchedulerBindingError(ValueError, AssertionError):
    """An ``lr_scheduler`` object built on an optimizer that is not the engine's: stepping it would
    change the learning rate of an optimizer that never steps. Also an ``AssertionError``: DeepSpeed
    asserts this, and code written against it catches that."""


def param_groups(model, model_parameters, client_optimizer) -> List[dict]:
    """The trainable parameter groups the ZeRO stage partitions."""
    if isinstance(client_optimizer, torch.optim.Optimizer):
        # remember each group's place: groups left without trainable parameters are dropped below
        groups = [{**g, CLIENT_GROUP_INDEX: i} for i, g in enumerate(client_optimizer.param_groups)]
    else:
        source = list(model_parameters) if model_parameters is not None else list(model.parameters())
        if source and isinstance(source[0], dict):
            groups = [dict(g) for g in source]
        else:
            groups = [{"params": source}]
    for g in groups:
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


def optimizer_builder(engine, client_optimizer):
    """``groups -> optimizer`` for the ZeRO stage: the client optimizer re-bound to the stage's
    groups, a client callable, or the config's ``optimizer`` section."""
    selected = engine.config.optimizer
    context = engine.context
    if client_optimizer is not None and selected is not None:
        _client_overrides(engine.config, "optimizer", selected)
        selected = None
    if isinstance(client_optimizer, torch.optim.Optimizer):
        def rebind(groups):
            if client_optimizer.state and engine.precision.master_weights:
                raise ValueError("the client optimizer already has state; with master weights (16-bit "
                                 "training) pass a fresh optimizer (or a callable that builds one)")
            for own in client_optimizer.param_groups:
                own["params"] = []  # a group with only frozen parameters stays empty
            for new in groups:
                client_optimizer.param_groups[new[CLIENT_GROUP_INDEX]]["params"] = list(new["params"])
            return client_optimizer
        return rebind
    if callable(client_optimizer):
        return lambda groups: client_optimizer(groups)
    if selected is not None:
        return lambda groups: selected.build(groups, selected.params, context)
    return lambda groups: None


def _client_overrides(config, section: str, selected) -> None:
    """An optimizer / lr_scheduler passed to initialize takes the place of the config's section,
    as DeepSpeed documents; the section (still checked) is dropped from the engine's config, so
    that no plugin builds from it, and the log says so."""
    argument = "optimizer" if section == "optimizer" else "lr_scheduler"
    log_rank0(f"warning: the config's '{section}' section ({selected.type!r}) is not used: initialize() was "
              f"given {argument}=, which takes its place (as in DeepSpeed)", logging.WARNING)
    setattr(config, section, None)


def build_scheduler(engine, client_scheduler, client_optimizer):
    """The LR scheduler over ``engine.basic_optimizer`` (the optimizer under DeepSpeed's wrapper, as
    DeepSpeed builds it: a torch scheduler needs a ``torch.optim.Optimizer``): a client object
    (which must drive that optimizer), a client callable, the config's ``scheduler`` section, or None."""
    selected = engine.config.scheduler
    if client_scheduler is not None and selected is not None:
        _client_overrides(engine.config, "scheduler", selected)
        selected = None
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(engine.basic_optimizer)
        bound = getattr(client_scheduler, "optimizer", None)
        if isinstance(bound, torch.optim.Optimizer) and bound is not engine.basic_optimizer \
                and bound is not client_optimizer:
            engines = ("the engine has no optimizer" if engine.basic_optimizer is None else
                       "the engine's is built by the optimizer callable" if callable(client_optimizer) else
                       "the engine's is built from the config's 'optimizer' section")
            raise SchedulerBindingError(
                f"dsplug.initialize: lr_scheduler ({type(client_scheduler).__name__}) was built on another "
                f"optimizer ({type(bound).__name__}; {engines}): stepping it would change nothing the engine "
                "trains. Pass the optimizer it was built on as optimizer=, or lr_scheduler as a callable "
                "optimizer -> scheduler")
        return client_scheduler
    if selected is not None:
        if engine.basic_optimizer is None:
            raise ValueError("the config has a 'scheduler' section but no optimizer was given")
        return selected.build(engine.basic_optimizer, selected.params, engine.context)
    return None
