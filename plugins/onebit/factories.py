"""The 1-bit optimizers' factories (torch imported inside them) and their stage-0 spec rule."""
from __future__ import annotations

from dsplug.config.params import options_of, partitions_optimizer_states, selected_optimizer_type, zero_stage


def _kwargs(config, type_name: str, context, keep) -> dict:
    options = options_of(config, type_name)
    if options.get("amsgrad"):
        raise ValueError(f"optimizer.type = {type_name!r}: amsgrad is not supported (must be false)")
    kwargs = {k: v for k, v in options.items() if k in keep}
    if context is not None:
        kwargs.update(comm=context.comm, rank=int(context.rank), world_size=int(context.world_size))
    return kwargs


_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def onebit_adam_factory(params, config, context=None):
    from .adam import OnebitAdam

    return OnebitAdam(params, **_kwargs(config, "OneBitAdam", context, _ADAM_KEYS + ("freeze_step",)))


def zero_one_adam_factory(params, config, context=None):
    from .zoadam import ZeroOneAdam

    keep = _ADAM_KEYS + ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    return ZeroOneAdam(params, **_kwargs(config, "ZeroOneAdam", context, keep))


def onebit_lamb_factory(params, config, context=None):
    from .lamb import OnebitLamb

    keep = _ADAM_KEYS + ("freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                         "factor_threshold")
    return OnebitLamb(params, **_kwargs(config, "OneBitLamb", context, keep))


#: lower-case optimizer.type -> (name, why it needs whole parameters)
_WHOLE_TENSORS = {
    "onebitadam": ("OneBitAdam", "compresses whole momentum tensors"),
    "zerooneadam": ("ZeroOneAdam", "compresses whole momentum tensors and takes local steps on whole parameters"),
    "onebitlamb": ("OneBitLamb", "compresses whole momentum tensors and computes per-parameter trust ratios"),
}


def stage0_only(type_name: str):
    """A spec rule: ``type_name`` needs ZeRO stage 0 (``zero_allow_untested_optimizer`` does not
    change that) and gradients averaged, not summed. It acts only when ``optimizer.type`` selects
    ``type_name``."""
    key = type_name.lower()

    def rule(config, report) -> None:
        chosen = selected_optimizer_type(config)
        if chosen is None or chosen.strip().lower() != key:
            return
        stage = zero_stage(config)
        if partitions_optimizer_states(config):
            name, why = _WHOLE_TENSORS[key]
            report.error("optimizer.type", f"{name} {why}; use zero_optimization.stage 0 (it is {stage}: at stages "
                                           "1-3 each rank steps a flat slice of the parameters)")
        if config.kernel.gradient_allreduce_op == "sum":
            report.error("gradient_allreduce_op", f"'sum' is not supported with {_WHOLE_TENSORS[key][0]}: it "
                         "averages its compressed momentum over the ranks; leave gradient_allreduce_op at 'mean'")

    rule.__name__ = f"stage0_only[{type_name}]"
    return rule
