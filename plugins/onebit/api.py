"""What ``dsplug.runtime.fp16.onebit`` (DeepSpeed's ``deepspeed.runtime.fp16.onebit``) holds: the
three 1-bit optimizer classes under DeepSpeed's names. The submodules ``adam`` / ``zoadam`` /
``lamb`` of that path are this package's modules of the same names."""
from .adam import OnebitAdam
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "ZeroOneAdam", "OnebitLamb"]
