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
                 :class:`dsplug.comm.bound.GroupComm` whose ranks are data-parallel ranks
    rank / world_size / local_rank: this process's place in the data-parallel group
    mp_rank / mp_world_size: its model-parallel slice (``initialize(mpu=...)``; 0 / 1 without)
    model:       the user's ``torch.nn.Module`` (None when not known yet)
    registry:    the :class:`dsplug.registry.Registry` the engine was built from
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
