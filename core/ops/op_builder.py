"""``deepspeed.ops.op_builder`` names: ``from dsplug.ops.op_builder import AsyncIOBuilder``."""
from dsplug.op_builder import (  # noqa: F401
    ALL_OPS,
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    OpBuilder,
    all_op_status,
    op_status,
)

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder", "OpBuilder",
           "all_op_status", "op_status"]
