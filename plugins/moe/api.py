"""What ``dsplug.moe`` (``deepspeed.moe``) holds: the layer and its parts by name, and the submodules."""
from . import experts, layer, sharded_moe, utils  # noqa: F401  (deepspeed.moe.layer, ...)
from .experts import Experts  # noqa: F401
from .layer import MoE  # noqa: F401
from .sharded_moe import MOELayer, TopKGate, top1gating, top2gating, topkgating  # noqa: F401
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer  # noqa: F401
