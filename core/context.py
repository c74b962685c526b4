"""What the engine hands to plugin factories: the world a plugin may talk to."""
from __future__ import annotations

from typing import Any, Optional

import attrs


@attrs.define
class BuildContext:
    """Passed as ``context`` to every plugin factory.

    config:      the parsed :class:`dsplug.config.DsplugConfig` (None in standalone use)
    accelerator: the :class:`dsplug.accelerator.Accelerator` in use
    comm:        the :mod:`dsplug.comm` layer bound to the data-parallel group (all collectives go
                 through it): the module itself without model parallelism, else a
                 :class:`dsplug.comm.bound.GroupComm` whose ranks are data-parallel ranks.
                 ``comm.group`` is the ``torch.distributed`` process group its collectives
                 default to: None when that is the default group (the world: ``comm`` is the
                 module), else the data-parallel ``ProcessGroup``; pass
                 ``comm.group or torch.distributed.group.WORLD`` to torch APIs that need a group
                 (a ``DeviceMesh.from_group``). ``comm.get_rank()`` / ``get_world_size()``
                 answer inside it (they equal ``rank`` / ``world_size``)
    rank / world_size / local_rank: this process's place in the data-parallel group
    mp_rank / mp_world_size: its model-parallel slice (``initialize(mpu=...)``; 0 / 1 without)
    model:       the user's ``torch.nn.Module`` (None when not known yet)
    registry:    the :class:`dsplug.registry.Registry` the engine was built from

    :meth:`reduction_of` tells where a parameter's gradient is averaged (the data-parallel group
    unless a plugin says otherwise, as the MoE plugin does for experts).
    """

    config: Any = None
    accelerator: Any = None
    comm: Any = None
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mp_rank: int = 0
    mp_world_size: int = 1
    model: Optional[Any] = None
    registry: Any = None

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def reduction_of(self, param):
        """Where ``param``'s gradient is averaged: a :class:`dsplug.descriptors.Reduction`.

        The first answer of the ``dsplug_param_reduction`` hook (plugins of :attr:`registry`),
        else the default: the data-parallel group (``comm``), divided by ``world_size``; the
        divisor is 1 under ``gradient_allreduce_op: "sum"``. ZeRO stages ask once per parameter
        when they are built."""
        from .descriptors import Reduction
        from .events import call_each

        if self.registry is not None:
            arguments = {"param": param, "context": self}
            for impl, answer in call_each(self.registry.pm.hook.dsplug_param_reduction, arguments):
                if answer is None:
                    continue
                if not isinstance(answer, Reduction) or answer.key is None:
                    raise TypeError(f"plugin {impl.plugin_name!r} returned {answer!r} from dsplug_param_reduction for "
                                    f"a parameter of shape {tuple(getattr(param, 'shape', ()))}; expected None or a "
                                    "dsplug.descriptors.Reduction with a key")
                return self._combined(answer)  # the first answer wins (firstresult)
        return self._combined(Reduction(None, self.comm, self.world_size))

    def _combined(self, reduction):
        """``gradient_allreduce_op: "sum"``: the reduced gradient is the sum over the ranks, so
        every reduction's divisor becomes 1 (stages dividing by ``Reduction.divisor`` honour it)."""
        kernel = getattr(self.config, "kernel", None)  # no config in standalone use
        if getattr(kernel, "gradient_allreduce_op", "mean") == "sum":
            return attrs.evolve(reduction, divisor=1)
        return reduction
