"""``deepspeed.ops.adagrad`` names: ``DeepSpeedCPUAdagrad``."""
from .cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
