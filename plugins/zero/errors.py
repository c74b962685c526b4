"""Errors of the ZeRO stages under DeepSpeed's names (``deepspeed.runtime.zero.utils``)."""


class ZeRORuntimeException(ValueError):
    """A ZeRO setup the stages refuse at run time, e.g. a client optimizer that is not one of
    DeepSpeed's CPU optimizers under optimizer offload while ``zero_force_ds_cpu_optimizer`` is
    true. A ``ValueError`` (the value given is what is wrong), as dsplug's other config errors."""


__all__ = ["ZeRORuntimeException"]
