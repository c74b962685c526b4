"""What the engine hands to plugin factories: the world a plugin may talk to."""
from __future__ import annotations

from typing import Any, Optional

import attrs


@attrs.define
class BuildContext:
    """Passed as ``context`` to every plugin factory.

    config:      the parsed :class:`dsplug.config.DsplugConfig` (None in standalone use)
    accelerator: the :class:`dsplug.accelerator.Accelerator` in use
    comm:        the :mod:`dsplug.comm` layer (all collectives go through it)
    rank / world_size / local_rank: this process's place in the data-parallel group
    model:       the user's ``torch.nn.Module`` (None when not known yet)
    registry:    the :class:`dsplug.registry.Registry` the engine was built from
    """

    config: Any = None
    accelerator: Any = None
    comm: Any = None
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    model: Optional[Any] = None
    registry: Any = None

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0
