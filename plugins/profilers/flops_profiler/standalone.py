"""``get_model_profile``: profile one forward pass of a model outside any training engine."""
from __future__ import annotations

from .formatting import macs_to_string, number_to_string, params_to_string
from .profiler import FlopsProfiler
from .report import check_print_options

MODES = ("forward", "generate")


def _dummy_input(model, input_shape):
    import torch

    if not isinstance(input_shape, (tuple, list)) or not input_shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input_shape):
        raise ValueError(f"input_shape must be a non-empty tuple of positive integers, got {input_shape!r}")
    first = next(model.parameters(), None)
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.get_default_dtype()
    device = first.device if first is not None else None
    return torch.ones(tuple(input_shape), dtype=dtype, device=device)


def _run(model, mode, args, kwargs):
    if mode == "generate":
        return model.generate(*args, **kwargs)
    return model(*args, **kwargs)


def get_model_profile(model, input_shape=None, args=None, kwargs=None, print_profile=True, detailed=True,
                      module_depth=-1, top_modules=1, warm_up=1, as_string=True, output_file=None,
                      ignore_modules=None, mode="forward"):
    """Profile ``model`` on one call and return ``(flops, macs, params)``.

    The model is called ``warm_up`` times unprofiled, then once profiled, with either a tensor
    of ones of ``input_shape`` (in the dtype / device of the model's first parameter) or
    ``*args, **kwargs``. ``mode="generate"`` calls ``model.generate`` instead of ``model``.
    With ``print_profile`` the profile is printed (to ``output_file`` if given; see
    :meth:`FlopsProfiler.print_model_profile` for ``detailed`` / ``module_depth`` /
    ``top_modules``). ``ignore_modules``: module classes left out of the counts.
    Returns strings such as ``("1.23 G", "615 MMACs", "1.2 M")`` with ``as_string``, else ints.
    The torch functions replaced for counting are restored even if the model raises.
    """
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile needs a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if mode == "generate" and not callable(getattr(model, "generate", None)):
        raise ValueError(f"mode='generate' needs a model with a generate() method; {type(model).__name__} has none")
    if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"warm_up must be an integer >= 0, got {warm_up!r}")
    if print_profile:
        check_print_options(module_depth, top_modules)
    args = list(args) if args is not None else []
    kwargs = dict(kwargs) if kwargs is not None else {}
    if input_shape is not None:
        if args:
            raise ValueError("give either input_shape (the model then gets one tensor of that shape) or args, not both")
        args = [_dummy_input(model, input_shape)]
    if not args and not kwargs:
        raise ValueError("nothing to call the model with: give input_shape, args or kwargs")

    for _ in range(warm_up):
        _run(model, mode, args, kwargs)

    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        _run(model, mode, args, kwargs)
        prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
