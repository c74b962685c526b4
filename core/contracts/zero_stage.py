"""The ZeRO stage contract: the path from gradients to updated weights, and its state.

**Who implements it**: a ``zero_stage`` plugin. Its hook ``dsplug_zero_stages`` returns
``PluginSpec(category="zero_stage", name=..., factory=..., traits=ZeroStageTraits(...))``; the
name is what ``zero_optimization.stage`` selects (DeepSpeed's 0-3 are the built-ins' names, any
other string selects a third-party stage). ``factory(module, param_groups, build_optimizer,
precision, section, context)`` returns a :class:`ZeroStage`.

**Who calls it**: the engine (each micro-step, each optimizer step, checkpoints, teardown) and,
through :class:`ZeroStageTraits`, everything that asks what the selected stage does (config rules
of other plugins, ``engine.zero_optimization_stage()`` that Hugging Face reads).

``dsplug.testing.ZeroStageContract`` is the suite a stage runs against itself.
"""
from __future__ import annotations

import abc
import weakref
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

import attrs

from ..hookspecs import hookimpl


class ZeroStageError(RuntimeError):
    """A stage was asked for something it does not provide."""


def _capabilities(value):
    return None if value is None else frozenset(value)


@attrs.frozen
class ZeroStageTraits:
    """What a stage does, declared without building it (``PluginSpec.traits``, read by config
    checks) and by the built stage (:attr:`ZeroStage.traits`, read by the engine). Give both the
    same object.

    ``deepspeed_stage``: DeepSpeed's number (0-3) when the stage behaves as that stage does for
    callers that branch on it (Hugging Face's ``zero_optimization_stage() == 3`` gathers with
    ``dsplug.zero.GatheredParameters``); None for a stage of its own kind, which then answers
    :meth:`zero_optimization_stage` from what it partitions.

    ``partitions_optimizer_states`` / ``partitions_gradients`` / ``partitions_parameters``: each
    rank keeps only its slice of these. A stage that partitions optimizer states steps flat
    slices, which an optimizer that looks at whole tensors (LAMB's trust ratio, 1-bit Adam's
    compression) cannot use; a stage that partitions parameters does not hold full weights
    between forwards.

    ``offload_optimizer`` / ``offload_param``: None when the stage ignores that offload section
    (a config that sets its device is refused); else the device capabilities
    (:data:`dsplug.contracts.offload.BYTE_ADDRESSABLE` ...) it needs, empty for any device.
    ``offload_ratio``: it honours ``offload_optimizer.ratio`` < 1 (part of the step on the
    accelerator).

    ``gradient_sum``: it honours ``gradient_allreduce_op: "sum"``: it divides each reduced gradient
    by its reduction's ``divisor`` (:meth:`dsplug.context.BuildContext.reduction_of`), which is 1
    under ``"sum"``. A config asking for ``"sum"`` with a stage that does not declare it is refused.
    """

    deepspeed_stage: Optional[int] = None
    partitions_optimizer_states: bool = False
    partitions_gradients: bool = False
    partitions_parameters: bool = False
    offload_optimizer: Optional[FrozenSet[str]] = attrs.field(default=None, converter=_capabilities)
    offload_param: Optional[FrozenSet[str]] = attrs.field(default=None, converter=_capabilities)
    offload_ratio: bool = False
    gradient_sum: bool = False

    def zero_optimization_stage(self) -> int:
        """DeepSpeed's number: ``deepspeed_stage``, else 3 / 2 / 1 / 0 by what is partitioned."""
        if self.deepspeed_stage is not None:
            return int(self.deepspeed_stage)
        return 3 if self.partitions_parameters else 2 if self.partitions_gradients else \
            1 if self.partitions_optimizer_states else 0

    @property
    def partitions_anything(self) -> bool:
        return self.partitions_optimizer_states or self.partitions_gradients or self.partitions_parameters


#: what a stage that declares nothing is taken to be: plain data parallel, no offload
NO_TRAITS = ZeroStageTraits()


def traits_of_spec(provided) -> ZeroStageTraits:
    """The traits a registered ``zero_stage`` declares: its spec's ``traits``, else its factory's
    when that is a :class:`ZeroStage` class, else :data:`NO_TRAITS`."""
    traits = getattr(provided.spec, "traits", None)
    if traits is None and isinstance(provided.spec.factory, type):
        traits = getattr(provided.spec.factory, "traits", None)
    return traits if isinstance(traits, ZeroStageTraits) else NO_TRAITS


def selected_traits(config) -> Optional[ZeroStageTraits]:
    """The traits of the stage ``config`` (a :class:`dsplug.config.DsplugConfig`) selects; None
    when the selected stage is not installed (the ``zero_optimization`` rules report that)."""
    from ..registry import PluginNotFoundError

    try:
        provided, _ = config.selection("zero_stage")
    except PluginNotFoundError:
        return None
    return traits_of_spec(provided)


def traits_of(stage) -> ZeroStageTraits:
    """A built stage's traits (:data:`NO_TRAITS` for an object that declares none)."""
    traits = getattr(stage, "traits", None)
    return traits if isinstance(traits, ZeroStageTraits) else NO_TRAITS


class ZeroStage(abc.ABC):
    """What a ``zero_stage`` factory returns; it owns gradients -> update -> weights.

    The engine calls, for each micro-step: :meth:`before_backward` (``is_boundary``: this
    micro-step ends an accumulation window and gradients must be reduced), autograd's backward
    of ``precision.scale_loss(loss)``, :meth:`after_backward`; at each boundary :meth:`step`
    (returns False when an overflow skipped the update). Between them the stage may run
    collectives (through ``context.comm``, never ``torch.distributed`` directly, so the comms
    logger sees them) and must leave the model's parameters holding the updated weights (or,
    when partitioned, able to gather them for the next forward).

    Attributes the engine reads: ``traits`` (a :class:`ZeroStageTraits`, class attribute: what it
    partitions and offloads; ``engine.zero_optimization_stage()`` answers from it), ``stage``
    (its name or number, for messages), ``module``, ``optimizer`` (``engine.basic_optimizer``,
    the ``.optimizer`` of what ``engine.optimizer`` returns where DeepSpeed wraps it; schedulers set
    ``lr`` on its groups), ``last_grad_norm`` (global norm before clipping
    of the last step, or None when nothing needed it), and optionally ``wrapper_internals`` (an
    object whose attributes answer DeepSpeed's wrapper-optimizer internals read through
    ``engine.optimizer``, such as stage 3's ``get_fp32_grad_partitions()``; see
    :mod:`dsplug.optimizer_view`).

    Clipping uses ``context.config.kernel.gradient_clipping`` (coefficient ``clip/(norm+1e-6)``
    when ``norm > clip``) after ``precision.unscale_``; overflow is ``not isfinite(norm)`` when
    ``precision.checks_overflow``; tell ``precision.update_scale(overflow)`` either way.

    Checkpoint: the stage saves the module in the shared file under ``"module"`` (the full state
    dict, gathered if partitioned) and its optimizer / master-weight state in every rank's file
    under ``"stage"``. ``docs/zero-stages.md`` documents the partitioned layout.

    Parameters: the factory may replace the module's ``Parameter`` objects with its own (FSDP2
    turns each into a DTensor parameter; a tensor subclass, a new Parameter over other storage).
    The engine records the module's parameters after the factory returns (:func:`attach_stage`),
    so :func:`stage_of`, ``dsplug.utils.safe_get_full_*`` and :meth:`gathered` answer for the
    stage's parameters; it keeps no reference (strong or weak) to any parameter, so
    ``module.to()`` can swap them (torch swaps tensor subclasses in place, which a weak
    reference forbids). A parameter the stage replaces later is not recorded: replace them in
    the factory.
    """

    traits: ZeroStageTraits = NO_TRAITS
    stage: Any = -1
    module: Any = None
    optimizer: Any = None
    last_grad_norm: Optional[float] = None

    def before_backward(self, is_boundary: bool) -> None:
        """Called by ``engine.backward(loss)`` just before autograd's backward, every micro-step.
        ``is_boundary``: this micro-step ends the accumulation window (and the caller did not
        pass ``allreduce_gradients=False``), so its gradients are the ones to reduce over ranks."""

    def after_backward(self) -> None:
        """Called by ``engine.backward(loss)`` right after autograd's backward returned, every
        micro-step: finish (or start) the reductions of this micro-step's gradients."""

    @abc.abstractmethod
    def step(self) -> bool:
        """Called by ``engine.step()`` at each accumulation boundary: reduce what is left,
        ``precision.unscale_``, take the global norm (set ``last_grad_norm``), check overflow
        and tell ``precision.update_scale``, clip, run the optimizer, write the weights back,
        drop the gradients. Returns False when an overflow skipped the update."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Called by ``engine.zero_grad()`` (and after skipped steps): drop accumulated gradients."""

    @abc.abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        """Called on every rank by ``save_checkpoint``: this rank's optimizer and master-weight
        state, saved under ``"stage"`` in this rank's file (tensors, dicts, lists, numbers)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Dict[str, Any], load_optimizer_states: bool = True,
                        saved_world_size: Optional[int] = None,
                        read_rank: Optional[Callable[[int], Dict[str, Any]]] = None) -> None:
        """Called on every rank by ``load_checkpoint`` (after the module) with this rank's saved
        :meth:`state_dict`. ``load_optimizer_states``: False restores master weights only;
        ``saved_world_size``: the data-parallel size that saved it; ``read_rank(r)`` returns rank
        ``r``'s saved :meth:`state_dict`, so state saved with N ranks can be re-sliced for M."""

    @abc.abstractmethod
    def module_state_dict(self) -> Dict[str, Any]:
        """The FULL module state dict (``save_checkpoint``'s shared file, ``save_16bit_model``,
        Hugging Face's consolidated weights). A collective when partitioned: every rank calls it."""

    @abc.abstractmethod
    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Called by ``load_checkpoint`` with the shared file's ``"module"``: load a full module
        state dict (each rank keeps its part when partitioned); ``strict`` as torch's."""

    def refresh_master_from_model(self) -> None:
        """After a module-only load: master weights := the module's weights."""

    def sixteen_bit_state_dict(self) -> Optional[Dict[str, Any]]:
        """The module weights in the training dtype for ``save_16bit_model``, or None when this
        stage's config does not allow gathering them (the stage logs why)."""
        return self.module_state_dict()

    # -- full values of one parameter (DeepSpeed's ``deepspeed.utils.safe_get_full_*`` answer from
    #    these; every rank must call them together when the stage partitions what is asked for:
    #    they may run a collective). ``param`` is one of ``module``'s parameters; one the stage does
    #    not train (frozen, or left out of the optimizer) answers None.
    def full_fp32_param(self, param) -> Optional[Any]:
        """The full fp32 master value of ``param`` (shape of the parameter; a new tensor), gathered
        from the partitions where the stage partitions it. Without master weights (fp32 training)
        the parameter's own value."""
        raise ZeroStageError(f"{type(self).__name__} (ZeRO stage {self.stage}) does not provide full fp32 values "
                             "of parameters")

    def set_full_fp32_param(self, param, value) -> None:
        """Make ``value`` (the full value; the same on every rank) ``param``'s fp32 master and its
        weight in the training dtype: each rank keeps its part, the next forward sees it."""
        raise ZeroStageError(f"{type(self).__name__} (ZeRO stage {self.stage}) does not set full fp32 values "
                             "of parameters")

    def full_grad(self, param) -> Optional[Any]:
        """``param``'s full gradient as the stage holds it for the coming step (fp32, shape of the
        parameter): after the backward pass that ends an accumulation window it is reduced over
        ranks and accumulated over its micro-steps, still multiplied by the loss scale of fp16
        training (the step unscales it). None when the stage holds no gradient for ``param``
        (no backward since the last step). Call it between that backward and ``step``."""
        raise ZeroStageError(f"{type(self).__name__} (ZeRO stage {self.stage}) does not provide full gradients")

    def full_optimizer_state(self, param, key: str) -> Optional[Any]:
        """The optimizer's state ``key`` (``"exp_avg"``, ``"exp_avg_sq"``, ...) for ``param``: an
        element-wise state gathered to the parameter's shape, a scalar as it is; None before the
        optimizer created it."""
        raise ZeroStageError(f"{type(self).__name__} (ZeRO stage {self.stage}) does not provide optimizer states "
                             "per parameter")

    def set_full_optimizer_state(self, param, key: str, value) -> None:
        """Overwrite the optimizer's element-wise state ``key`` of ``param`` with the full ``value``
        (the same on every rank; each rank keeps its part)."""
        raise ZeroStageError(f"{type(self).__name__} (ZeRO stage {self.stage}) does not set optimizer states "
                             "per parameter")

    def memory_breakdown(self) -> Dict[str, int]:
        """Bytes this rank holds: ``parameters``, ``gradients``, ``optimizer_states``, ``total``,
        ``buffers``. Stages that cannot account for their memory leave this as is."""
        raise ZeroStageError(f"{type(self).__name__} (ZeRO stage {self.stage}) does not report its memory")

    def gathered(self, params, modifier_rank: Optional[int] = None):
        """A context manager in which each parameter of ``params`` has its full value, or None
        when they all have it already (the default: a stage that does not partition parameters).

        Called by the kernel's :func:`gathered_parameters` (which ``dsplug.zero.GatheredParameters``
        -- DeepSpeed's ``deepspeed.zero.GatheredParameters`` -- and the compression methods use)
        with the parameters of its argument that this stage trains (:func:`stage_of` is this
        stage), in the caller's order, without duplicates. ``modifier_rank``: None to read only
        (changes made inside are dropped on exit); else the data-parallel rank (of
        ``context.comm``) whose full values every rank keeps on exit (each rank its part; master
        weights follow). Entering and leaving are collectives: every rank of the data-parallel
        group enters with the same parameters. Building the context manager must communicate
        nothing. Inside, ``param.data`` (or the module's attribute of that name) is the full
        tensor in the training dtype, readable and, with a ``modifier_rank``, writable in place."""
        return None

    def release_gathered(self) -> None:
        """Drop the full values of partitioned parameters that are gathered now and that nothing
        holds (``engine.empty_partition_cache()``, called between steps). The default does nothing:
        a stage that keeps no gathered values has none to drop."""

    def close(self) -> None:
        """Called by ``engine.destroy()`` (or when another engine wraps the same model): remove
        hooks, close the offload devices the stage opened; the stage is not used afterwards."""

    # -- checkpoint participation (see dsplug.hookspecs)
    @hookimpl
    def dsplug_checkpoint_state(self, scope, options):
        if scope == "rank":
            return {"stage": self.state_dict()}
        state = self.module_state_dict()  # every rank calls it: a collective when partitioned
        if options.exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {"module": state}

    def load_module_part(self, module_state, options) -> bool:
        """Load the module weights of a checkpoint as ``options`` say (``custom_load_fn``, strict);
        True when the load is module-only (master weights refreshed, nothing else to load)."""
        if module_state is not None:
            if options.custom_load_fn is not None:
                options.custom_load_fn(src=module_state, dst=self.module)
            else:
                self.load_module_state_dict(module_state, strict=options.load_module_strict)
        if options.load_module_only:
            self.refresh_master_from_model()
            return True
        return False

    @hookimpl(tryfirst=True)
    def dsplug_load_checkpoint_state(self, checkpoint):
        options = checkpoint.options
        if self.load_module_part(checkpoint.model.get("module"), options):
            return
        if "stage" not in checkpoint.rank:
            from ..checkpoint import CheckpointError

            raise CheckpointError(f"{checkpoint.path}: this rank's file holds no ZeRO stage state (keys: "
                                  f"{sorted(checkpoint.rank)}); pass load_module_only=True to load the weights only")
        self.load_state_dict(checkpoint.rank["stage"], load_optimizer_states=options.load_optimizer_states,
                             saved_world_size=checkpoint.saved_world_size,
                             read_rank=lambda r: checkpoint.read_rank(r)["stage"])


# ------------------------------------------------------------------ which stage trains a parameter
STAGE_ATTR = "_dsplug_stage"

#: id(parameter) -> (weak reference to its stage, weak reference to the module, the parameter's
#: name there). No reference to the parameter itself: a weak reference to a tensor forbids
#: ``torch.utils.swap_tensors`` (``module.to()`` of DTensor / tensor-subclass parameters), a
#: strong one would keep it alive. :func:`stage_of` checks that the name still resolves to the
#: very object asked about, so a reused id never answers for another tensor.
_OWNERS: Dict[int, Tuple[Any, Any, str]] = {}


def attach_stage(module, stage: ZeroStage) -> None:
    """Record that ``stage`` trains ``module`` and its parameters (the engine calls this after the
    stage's factory returned, so parameters the factory put in the module are the ones
    recorded), so that :func:`stage_of` finds the stage from a parameter or the module alone.
    The entries go away with the stage (or :func:`detach_stage`)."""
    object.__setattr__(module, STAGE_ATTR, stage)
    keys = []

    def forget(_ref, keys=keys):
        for key in keys:
            entry = _OWNERS.get(key)
            if entry is not None and entry[0] is _ref:
                del _OWNERS[key]

    ref = weakref.ref(stage, forget)
    module_ref = weakref.ref(module)
    for name, p in module.named_parameters():
        _OWNERS[id(p)] = (ref, module_ref, name)
        keys.append(id(p))


def detach_stage(module, stage: ZeroStage) -> None:
    """Undo :func:`attach_stage` (only where ``stage`` is still the one recorded)."""
    if getattr(module, STAGE_ATTR, None) is stage:
        object.__delattr__(module, STAGE_ATTR)
    for key in [k for k, (st, _, _) in _OWNERS.items() if st() is stage or st() is None]:
        del _OWNERS[key]


def stage_of(obj) -> Optional[ZeroStage]:
    """The ZeRO stage of the engine that trains ``obj`` (a parameter or module), or None."""
    if isinstance(obj, torch_module_types()):
        return getattr(obj, STAGE_ATTR, None)
    entry = _OWNERS.get(id(obj))
    if entry is None:
        return None
    stage, module = entry[0](), entry[1]()
    if stage is None or module is None or _parameter(module, entry[2]) is not obj:
        return None
    return stage


def _parameter(module, name: str):
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, "_modules", {}).get(part)
        if module is None:
            return None
    return getattr(module, "_parameters", {}).get(leaf)


def gathered_parameters(params, modifier_rank: Optional[int] = None):
    """The kernel's service behind ``dsplug.zero.GatheredParameters``: a context manager in which
    every parameter of ``params`` (one tensor or an iterable; None entries skipped) has its full
    value, or None when nothing needs gathering.

    Each parameter goes to the stage that trains it (:func:`stage_of`), whose
    :meth:`ZeroStage.gathered` is asked for its parameters (stages in the order their first
    parameter comes); parameters no engine trains go to the ``dsplug_gathered_parameters`` hook
    (stage 3 answers for those partitioned by ``dsplug.zero.Init`` before ``initialize``).
    ``modifier_rank`` as in :meth:`ZeroStage.gathered`. Entering is a collective on every rank.
    """
    import contextlib

    if params is None:
        return None
    if isinstance(params, torch_tensor_type()):
        params = [params]
    seen, by_stage, unowned = set(), {}, []
    for p in params:
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        stage = stage_of(p)
        if stage is None:
            unowned.append(p)
        else:
            by_stage.setdefault(id(stage), (stage, []))[1].append(p)
    contexts = [stage.gathered(ps, modifier_rank) for stage, ps in by_stage.values()]
    if unowned:
        from ..registry import get_registry

        contexts.append(get_registry().pm.hook.dsplug_gathered_parameters(params=unowned, modifier_rank=modifier_rank))
    contexts = [c for c in contexts if c is not None]
    if not contexts:
        return None
    if len(contexts) == 1:
        return contexts[0]

    @contextlib.contextmanager
    def all_of():
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            yield

    return all_of()


def torch_tensor_type():
    import torch

    return torch.Tensor


def torch_module_types():
    import torch

    return (torch.nn.Module,)
