"""The offload-device contract (``offload_optimizer.device`` / ``offload_param.device``)."""
from __future__ import annotations

from typing import Any, Optional


class OffloadDevice:
    """What an ``offload_device`` factory returns: where a ZeRO stage keeps state off the
    accelerator, and how it moves it.

    ``factory(section, context)`` gets the parsed ``offload_param`` / ``offload_optimizer``
    section. A device may own further config sections through its spec (``nvme`` owns ``aio``)
    and reads them from ``context.config``.

    Storage the kernel defines:

    * :meth:`host_tensor` — an empty tensor where this device keeps data in host memory
      (pinned when the section asks for it and the accelerator supports it);
    * :meth:`swap_dir` — the directory of this device's swap files, or None when it keeps
      everything in memory.

    Which structures a stage builds on the device (partition stores, swappers) is between the
    device and the stages that use it: the built-in ZeRO stages call the ``zero3_*`` / ``zero12_*``
    methods documented in ``docs/offload.md``. :meth:`close` releases files and buffers.
    """

    name: str = "abstract"

    def __init__(self, config: Any, context: Any):
        self.config = config
        self.context = context

    @property
    def accelerator(self):
        return getattr(self.context, "accelerator", None)

    @property
    def pin_memory(self) -> bool:
        return bool(getattr(self.config, "pin_memory", False))

    def host_tensor(self, numel: int, dtype):
        """An uninitialised 1-D host tensor (pinned when ``pin_memory`` and supported)."""
        import torch

        tensor = torch.empty(int(numel), dtype=dtype, device="cpu")
        accelerator = self.accelerator
        if self.pin_memory and accelerator is not None and hasattr(accelerator, "pin_memory"):
            tensor = accelerator.pin_memory(tensor)
        return tensor

    def swap_dir(self) -> Optional[str]:
        return None

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<offload device {self.name!r}>"
