"""Each rank's own 1-bit state in its checkpoint file (error feedback; 0/1 Adam's diverged ranks).

At stage 0 the shared file holds rank 0's ``state_dict()``; :func:`rank_state` adds each rank's own
error-feedback buffers (and, in the middle of a 0/1 Adam local-step window, its own parameters and
momentum) to that rank's file, so a resumed run continues exactly. Torch is imported lazily.
"""
from __future__ import annotations

#: the checkpoint key of each rank's own 1-bit state (in that rank's file)
RANK_KEY = "onebit"


def onebit_optimizer(engine):
    """The engine's 1-bit optimizer when it communicates across ranks, else None."""
    optimizer = getattr(engine, "basic_optimizer", None)  # under DeepSpeed's wrapper shape
    if optimizer is None or not type(optimizer).__module__.startswith(__package__):
        return None
    from .common import OneBitOptimizer

    return optimizer if isinstance(optimizer, OneBitOptimizer) and optimizer.distributed else None


def rank_state(engine, scope):
    """Each rank's own error-feedback buffers (and, while 0/1 Adam's ranks diverge, its own
    parameters and local state) go into that rank's file."""
    optimizer = onebit_optimizer(engine) if scope == "rank" else None
    if optimizer is None:
        return None
    state = {"optimizer": optimizer.rank_state_dict()}
    if optimizer.ranks_diverge():
        state["params"] = [engine.stage.full_fp32_param(p) for p in engine.module.parameters()]
    return {RANK_KEY: state}


def load_rank_state(engine, checkpoint):
    """After the stage loaded rank 0's optimizer state: this rank's own part."""
    optimizer = onebit_optimizer(engine)
    options = checkpoint.options
    if optimizer is None or options.load_module_only or not options.load_optimizer_states:
        return
    saved = checkpoint.rank.get(RANK_KEY)
    if not isinstance(saved, dict) or int(checkpoint.saved_world_size) != optimizer.world_size:
        optimizer.load_rank_state_dict(None)  # another world size: error feedback restarts from zero
        return
    optimizer.load_rank_state_dict(saved.get("optimizer"))
    params = saved.get("params")
    if params is not None:
        for p, value in zip(engine.module.parameters(), params):
            if value is not None:
                engine.stage.set_full_fp32_param(p, value)
