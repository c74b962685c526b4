"""``dsplug.zero.Init``: build modules already partitioned (ZeRO stage 3).

::

    with dsplug.zero.Init(config_dict_or_path=ds_config):
        model = MyBigModel()          # each rank holds 1/N of every parameter

Inside the context every ``torch.nn.Module`` subclass's ``__init__`` is wrapped: when the
outermost ``__init__`` of an object returns (so a subclass may still initialise the weights its
parent created), the object's not-yet-partitioned parameters are made equal to rank 0's values
(one broadcast per module and dtype) and partitioned. ``Module.apply`` is wrapped too: a parent
whose ``__init__`` initialises its children's weights with ``self.apply(init_fn)`` (Hugging Face's
``post_init`` does) has ``init_fn`` see each already-partitioned module's parameters whole, and rank
0's result is what is kept, as in DeepSpeed. Peak memory is therefore the partitions
built so far plus the full parameters of one module, which is what lets a model larger than one
rank's memory be built. Usable as a decorator too. ``Init(module=m)`` partitions an existing
module at once. ``enabled=False`` makes it a no-op.

After construction, read or change full values with :class:`dsplug.zero.GatheredParameters`.
``dsplug.initialize`` at ``zero_optimization.stage`` 3 takes such a model over as it is.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, List, Optional

import torch

from .partitioned_param import ParamPartitioner, is_partitioned

_DTYPES = {torch.float16: torch.float16, torch.bfloat16: torch.bfloat16, torch.float32: torch.float32}


class _Patcher:
    """Wraps ``__init__`` of every nn.Module subclass while at least one Init context is active."""

    def __init__(self):
        self.active: List["Init"] = []
        self.originals: Dict[type, object] = {}
        self.constructing: set = set()
        self.had_init_subclass = False
        self.saved_init_subclass = None
        self.suspended = False  # shutdown_init_context(): patches removed while contexts are active

    def enter(self, ctx: "Init") -> None:
        if not self.active and not self.suspended:
            self._patch()
        self.active.append(ctx)

    def exit(self, ctx: "Init") -> None:
        self.active.remove(ctx)
        if not self.active:
            if self.suspended:
                self.suspended = False
            else:
                self._unpatch()

    def suspend(self) -> None:
        """Modules built from now on are not partitioned, until :meth:`resume`."""
        if self.active and not self.suspended:
            self._unpatch()
            self.suspended = True

    def resume(self) -> None:
        if self.suspended:
            self.suspended = False
            if self.active:
                self._patch()

    def _patch(self) -> None:
        stack = list(torch.nn.Module.__subclasses__())
        while stack:
            cls = stack.pop()
            self._wrap(cls)
            stack.extend(cls.__subclasses__())
        self.had_init_subclass = "__init_subclass__" in torch.nn.Module.__dict__
        self.saved_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        patcher = self

        def __init_subclass__(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            patcher._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        self.saved_apply = torch.nn.Module.__dict__["apply"]
        torch.nn.Module.apply = _apply_gathered

    def _unpatch(self) -> None:
        for cls, original in self.originals.items():
            cls.__init__ = original
        self.originals.clear()
        torch.nn.Module.apply = self.saved_apply
        if self.had_init_subclass:
            torch.nn.Module.__init_subclass__ = self.saved_init_subclass
        else:
            del torch.nn.Module.__init_subclass__

    def _wrap(self, cls) -> None:
        if cls in self.originals or "__init__" not in cls.__dict__:
            return
        original = cls.__dict__["__init__"]
        patcher = self

        @functools.wraps(original)
        def __init__(module, *args, **kwargs):
            outermost = id(module) not in patcher.constructing
            if outermost:
                patcher.constructing.add(id(module))
            try:
                original(module, *args, **kwargs)
            finally:
                if outermost:
                    patcher.constructing.discard(id(module))
            if outermost and patcher.active:
                patcher.active[-1].partition_module(module)

        self.originals[cls] = original
        cls.__init__ = __init__


def _apply_gathered(module: torch.nn.Module, fn):
    """``Module.apply`` inside Init: ``fn`` on every submodule, children first (as torch's), with
    the module's own partitioned parameters gathered around the call; rank 0's values are kept
    (every rank calls it: model code runs alike on all ranks)."""
    from .gathered import PartitionedGathered

    for child in module.children():
        _apply_gathered(child, fn)
    own = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
    if not own:
        fn(module)
        return module
    with PartitionedGathered(own, modifier_rank=0):
        fn(module)
    return module


_patcher = _Patcher()


def _unsupported(name: str, value, what: str) -> None:
    raise NotImplementedError(f"dsplug.zero.Init: {name}={value!r} is not available in dsplug yet ({what})")


class Init(contextlib.ContextDecorator):
    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path=None, config=None, enabled: bool = True, dtype: Optional[torch.dtype] = None,
                 mpu=None, zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None):
        """Arguments are DeepSpeed's. ``mem_efficient_linear`` is accepted and has no effect: the
        stage-3 hooks already re-gather a weight before the backward that reads it. ``pin_memory``
        only matters for partitions kept on the host (``remote_device="cpu"`` with an accelerator).
        ``zero_quantized_weights`` / ``zero_quantized_nontrainable_weights`` are accepted and have no
        effect here: Init only partitions; the engine's ``zero_optimization`` keys of the same names
        decide how its forward / backward gathers travel (ZeRO++, :mod:`dsplug.plugins.zero.stage3.zeropp`)."""
        self.enabled = bool(enabled)
        if not self.enabled:
            return
        if config is not None and config_dict_or_path is not None:
            raise ValueError("dsplug.zero.Init: give the config once (config_dict_or_path= or its alias config=)")
        raw = _raw_config(config_dict_or_path if config_dict_or_path is not None else config)
        for name, value, what in (("mpu", mpu, "model parallelism"),
                                  ("data_parallel_group", data_parallel_group, "only the default world group"),
                                  ("zero_param_parallel_group", zero_param_parallel_group,
                                   "ZeRO++ hpZ groups come from zero_optimization.zero_hpz_partition_size"),
                                  ("sequence_data_parallel_group", sequence_data_parallel_group, "sequence parallelism"),
                                  ("param_swapper", param_swapper, "NVMe parameter swapping")):
            if value is not None:
                _unsupported(name, value, what)
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dsplug.zero.Init: dtype={dtype} is not valid; use torch.float16, torch.bfloat16 or "
                             "torch.float32")
        offload = ((raw.get("zero_optimization") or {}).get("offload_param") or {}).get("device", "none")
        device_name = remote_device if remote_device is not None else offload
        from dsplug import comm
        from dsplug.accelerator import get_accelerator

        accelerator = get_accelerator()
        # "cpu" / "nvme" (the offload_param devices): partitions are made in host memory; the engine's
        # offload plugin then keeps them there or moves them into its swap files
        host = device_name in ("cpu", "nvme")
        if not host and device_name not in (None, "none", accelerator.name, str(accelerator.device())):
            _unsupported("remote_device", device_name, "valid: none, cpu, nvme or the accelerator's device")
        comm.init_distributed(verbose=False)
        self.dtype = dtype or _dtype_from_config(raw)
        self.mem_efficient_linear = mem_efficient_linear
        self.pin_memory = pin_memory
        device = accelerator.device(comm.get_local_rank() if accelerator.name != "cpu" else None)
        self.partitioner = ParamPartitioner(comm, comm.get_rank(), comm.get_world_size(), device,
                                            partition_device="cpu" if host else None)
        if module is not None:
            self.partition_module(module)

    def partition_module(self, module: torch.nn.Module) -> None:
        """Partition every parameter of ``module`` (and its children) that is still whole. A
        parameter on the ``meta`` device has no values yet (``torch.nn.utils.skip_init`` builds on
        meta, then ``to_empty`` gives it memory after ``__init__``): it waits for the enclosing
        module's partitioning."""
        params = [p for p in module.parameters() if not is_partitioned(p) and p.device.type != "meta"]
        if params:
            self.partitioner.partition(params, broadcast_from=0, dtype=self.dtype)

    def __enter__(self):
        if self.enabled:
            _patcher.enter(self)
        return self

    def __exit__(self, *exc_info):
        if self.enabled:
            _patcher.exit(self)
        return False


def _raw_config(source) -> dict:
    if source is None:
        return {}
    if hasattr(source, "to_dict"):
        return source.to_dict()
    from dsplug.config.loader import load_raw

    return load_raw(source)[0]


def _dtype_from_config(raw: dict) -> Optional[torch.dtype]:
    if (raw.get("fp16") or {}).get("enabled") is True:
        return torch.float16
    if (raw.get("bf16") or raw.get("bfloat16") or {}).get("enabled") is True:
        return torch.bfloat16
    return None
