"""``deepspeed.ops.lion`` names: ``DeepSpeedCPULion``."""
from .cpu_lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
