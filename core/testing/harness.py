"""Public helpers to build a real engine on a tiny model and drive it for a few steps.

Everything here is deterministic and runs on CPU in one process in well under a second per
engine: a small MLP, synthetic data that depends only on the step number (so a run resumed from a
checkpoint sees exactly the batches an uninterrupted run would), and a client SGD optimizer when
the config names none (so the helpers depend on no optimizer plugin).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 16, 4

#: the engine config every helper starts from; ``tiny_engine(config)`` merges ``config`` into it
BASE_CONFIG: Dict[str, Any] = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1_000_000,
}

#: the lr of the client optimizer used when a config has no ``optimizer`` section
DEFAULT_LR = 0.05


# ------------------------------------------------------------------------------ model and data
def tiny_model(seed: int = 0):
    """``Linear(8, 16) -> Tanh -> Linear(16, 4)`` with weights drawn from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, OUT_FEATURES))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def tiny_batch(step: int, micro: int = 0, size: int = 2, seed: int = 0):
    """``(x, y)`` of micro-step ``micro`` of optimizer step ``step`` (0-based), ``size`` rows."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro)
    return torch.randn(size, IN_FEATURES, generator=g), torch.randn(size, OUT_FEATURES, generator=g)


def tiny_loss(output, target):
    """Mean squared error, computed in fp32."""
    return ((output.float() - target.float()) ** 2).mean()


def default_optimizer(param_groups):
    """The client optimizer :func:`tiny_engine` passes when the config has no ``optimizer``."""
    import torch

    return torch.optim.SGD(param_groups, lr=DEFAULT_LR)


# ------------------------------------------------------------------------------ config
def merge(base: Mapping[str, Any], override: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``base`` deep-updated with ``override`` (dicts merged key by key; copies, never aliases)."""
    out = copy.deepcopy(dict(base))
    for key, value in (override or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def tiny_config(config: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """:data:`BASE_CONFIG` with ``config`` merged in."""
    return merge(BASE_CONFIG, config)


# ------------------------------------------------------------------------------ registry and engine
def make_registry(*plugins, distribution: str = "<test>", version: str = "0", blocked: Optional[Iterable[str]] = None):
    """A registry of the installed plugins plus ``plugins`` (modules or objects with ``@hookimpl``
    functions) registered at runtime, as if an entry point of ``distribution`` named them.

    Without ``plugins`` and ``blocked`` this is the process-wide registry. A plugin already
    installed through an entry point is not registered twice.
    """
    from ..registry import Registry, get_registry

    if not plugins and blocked is None:
        return get_registry()
    registry = Registry(blocked=blocked)
    for plugin in plugins:
        if not registry.pm.is_registered(plugin):
            registry.register(plugin, distribution=distribution, version=version)
    return registry


def tiny_engine(config: Optional[Mapping[str, Any]] = None, *, registry=None, plugins=(), model=None,
                seed: int = 0, optimizer=None, lr_scheduler=None, **kwargs):
    """A :class:`dsplug.engine.Engine` over :func:`tiny_model` built from ``tiny_config(config)``.

    ``registry``: the registry to build from (default: :func:`make_registry` of ``plugins``).
    ``optimizer``: a client optimizer (or a callable of the param groups); when neither it nor
    the config gives one, :func:`default_optimizer` (plain SGD) is used. Other keyword arguments
    go to the engine (``training_data``, ``model_parameters``...).
    """
    from ..engine import Engine

    full = tiny_config(config)
    if optimizer is None and "optimizer" not in full:
        optimizer = default_optimizer
    if registry is None:
        registry = make_registry(*plugins)
    return Engine(model=model if model is not None else tiny_model(seed), config=full, optimizer=optimizer,
                  lr_scheduler=lr_scheduler, registry=registry, **kwargs)


def train_steps(engine, n: int, *, seed: int = 0, on_step: Optional[Callable[[Any], None]] = None) -> List[float]:
    """Run ``n`` optimizer steps (each of ``gradient_accumulation_steps`` micro-steps) on
    :func:`tiny_batch` data chosen by ``engine.global_steps``; returns each step's mean loss.
    ``on_step(engine)`` runs after each optimizer step."""
    import torch

    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    dtype = engine.precision.model_dtype or torch.float32
    losses = []
    for _ in range(n):
        step = int(engine.global_steps)
        total = 0.0
        for m in range(gas):
            x, y = tiny_batch(step, m, micro, seed=seed * 7919 + engine.global_rank)
            loss = tiny_loss(engine(x.to(engine.device, dtype)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / gas)
        if on_step is not None:
            on_step(engine)
    return losses


def save_and_load(engine, save_dir, make_engine: Callable[[], Any], tag: str = "contract"):
    """Save ``engine`` to ``save_dir/tag``, build a fresh engine with ``make_engine()`` and load
    the checkpoint into it; returns the fresh engine."""
    engine.save_checkpoint(str(save_dir), tag=tag)
    fresh = make_engine()
    path, _ = fresh.load_checkpoint(str(save_dir), tag=tag)
    if path is None:
        raise AssertionError(f"load_checkpoint({save_dir!s}, tag={tag!r}) loaded nothing")
    return fresh


# ------------------------------------------------------------------------------ plugin state
def plugin_state(engine, part) -> Dict[str, Dict[str, Any]]:
    """What ``part`` (an object on ``engine.events``) contributes to a checkpoint:
    ``{"model": {key: state}, "rank": {key: state}}``, from its own ``dsplug_checkpoint_state``
    implementation(s), called the way a save calls them."""
    from ..contracts.checkpoint import SaveOptions
    from ..events import call_each

    out: Dict[str, Dict[str, Any]] = {"model": {}, "rank": {}}
    if part is None:
        return out
    options = SaveOptions(tag="probe", save_dir="")
    for scope in out:
        kwargs = {"engine": engine, "scope": scope, "options": options}
        for _impl, got in call_each(engine.events.hook.dsplug_checkpoint_state, kwargs, plugin=part):
            if got:
                out[scope].update(got)
    return out


def has_state(state) -> bool:
    """True when ``state`` (e.g. :func:`plugin_state`'s result) holds anything."""
    if isinstance(state, Mapping):
        return any(has_state(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_state(v) for v in state)
    return state is not None


def assert_state_equal(got, want, path: str = "state", rtol: float = 0.0, atol: float = 0.0) -> None:
    """``got == want`` through dicts, lists and tensors (exactly, unless ``rtol``/``atol``); the
    error names the first differing path."""
    import torch

    if isinstance(want, Mapping):
        if not isinstance(got, Mapping):
            raise AssertionError(f"{path}: expected a dict, got {type(got).__name__}")
        if set(got) != set(want):
            raise AssertionError(f"{path}: keys differ: missing {sorted(map(str, set(want) - set(got)))}, "
                                 f"unexpected {sorted(map(str, set(got) - set(want)))}")
        for key in want:
            assert_state_equal(got[key], want[key], f"{path}[{key!r}]", rtol, atol)
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise AssertionError(f"{path}: expected a sequence of {len(want)}, got {got!r}")
        for i, (a, b) in enumerate(zip(got, want)):
            assert_state_equal(a, b, f"{path}[{i}]", rtol, atol)
    elif isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{path}: expected a tensor, got {type(got).__name__}")
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as exc:
            raise AssertionError(f"{path}: {exc}") from None
    elif isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if not (math.isnan(want) and math.isnan(got)) and not math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            raise AssertionError(f"{path}: {got!r} != {want!r}")
    elif got != want:
        raise AssertionError(f"{path}: {got!r} != {want!r}")


# ------------------------------------------------------------------------------ contracts
def lifecycle_hooks_of(obj) -> List[str]:
    """The lifecycle hooks ``obj`` implements, validated against :mod:`dsplug.hookspecs` the way
    the engine's event bus validates them (a misspelled argument raises here)."""
    import pluggy

    from ..hookspecs import PROJECT, LifecycleSpecs

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(LifecycleSpecs)
    pm.register(obj, name="probe")
    pm.check_pending()  # a dsplug_* method matching no lifecycle hook
    return sorted(caller.name for caller in (pm.get_hookcallers(obj) or []))


def contract_problems(category: str, obj) -> List[str]:
    """Why ``obj`` does not satisfy ``category``'s contract (:mod:`dsplug.contracts`); empty
    when it does."""
    from .. import contracts

    problems: List[str] = []
    name = type(obj).__qualname__
    if category == "optimizer":
        import torch

        if not isinstance(obj, torch.optim.Optimizer):
            problems.append(f"{name} is not a torch.optim.Optimizer")
        if not isinstance(obj, contracts.Optimizer):
            problems.append(f"{name} lacks part of dsplug.contracts.Optimizer (param_groups, step, zero_grad, "
                            "state_dict, load_state_dict)")
    elif category == "scheduler":
        if not isinstance(obj, contracts.LRScheduler):
            problems.append(f"{name} lacks part of dsplug.contracts.LRScheduler (step, get_last_lr, state_dict, "
                            "load_state_dict)")
    elif category == "monitor":
        if not isinstance(obj, contracts.Monitor):
            # duck-typed monitors are accepted: DeepSpeed's write_events plus the step hook
            if not callable(getattr(obj, "write_events", None)):
                problems.append(f"{name} is not a dsplug.contracts.Monitor and has no write_events")
            if "dsplug_step_end" not in lifecycle_hooks_of(obj):
                problems.append(f"{name} is not a dsplug.contracts.Monitor and implements no dsplug_step_end")
    elif category == "observer":
        if not lifecycle_hooks_of(obj):
            problems.append(f"{name} implements no lifecycle hook (@dsplug.hookimpl def dsplug_step_end(...)...)")
    elif category == "compression":
        if not isinstance(obj, contracts.CompressionMethod):
            problems.append(f"{name} is not a dsplug.contracts.CompressionMethod")
    else:
        cls = {"precision": contracts.Precision, "zero_stage": contracts.ZeroStage,
               "offload_device": contracts.OffloadDevice, "accelerator": contracts.Accelerator}.get(category)
        if cls is not None and not isinstance(obj, cls):
            problems.append(f"{name} is not a dsplug.contracts.{cls.__name__}")
    if category in ("monitor", "observer", "compression", "precision"):
        try:
            lifecycle_hooks_of(obj)
        except Exception as exc:  # noqa: BLE001 - reported as a contract problem
            problems.append(f"{name}'s hook implementations do not match dsplug.hookspecs: {exc}")
    return problems
