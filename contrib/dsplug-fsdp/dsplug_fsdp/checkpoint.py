"""The ``fsdp2`` stage's per-rank checkpoint state, and re-slicing it for another number of ranks.

``stage.state_dict()`` (saved under ``"stage"`` in each rank's file; the full module state dict
is in the shared file)::

    {
      "format": "dsplug-fsdp2-rows", "version": 1,
      "world_size": N, "rank": r,
      "params": {name: {"shape": [full shape], "rows": [start, length]}},   # every sharded parameter
      "master": {name: this rank's fp32 rows},          # bf16 / fp16 training only (fp32 masters)
      "groups": [{"names": [parameter names], "hyper": {lr, betas, ...}}],   # the optimizer's groups
      "state": {name: {key: value}},                    # the optimizer's state of each parameter
    }

An optimizer state value is *row-wise* when it is a tensor shaped like the rank's rows of the
parameter (Adam's ``exp_avg`` / ``exp_avg_sq``); anything else (``step``) is the same on every
rank. Rows follow :func:`dsplug_fsdp.rows.rows_of`, so N ranks' files can be concatenated per
parameter and cut again for M ranks (:func:`reslice`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from .rows import rows_of

FORMAT = "dsplug-fsdp2-rows"
VERSION = 1


class Fsdp2CheckpointError(RuntimeError):
    """A checkpoint this stage cannot load (another stage's, or state it cannot re-slice)."""


def check_format(state: Dict[str, Any], where: str = "this rank's checkpoint state") -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format", state.get("zero_stage")) if isinstance(state, dict) else type(state).__name__
        raise Fsdp2CheckpointError(f"{where} was not written by the ZeRO stage 'fsdp2' (found {found!r}); a "
                                   "checkpoint loads at the stage that saved it, or with load_module_only=True "
                                   "(the full module weights are in the shared file)")
    if state.get("version", 0) > VERSION:
        raise Fsdp2CheckpointError(f"{where} has format version {state['version']}; this dsplug-fsdp reads up to "
                                   f"{VERSION}: upgrade dsplug-fsdp")


def is_row_wise(value, rows_length: int, shape) -> bool:
    return torch.is_tensor(value) and value.dim() == len(shape) and value.dim() > 0 \
        and value.shape[0] == rows_length and tuple(value.shape[1:]) == tuple(shape[1:])


def reslice(read_rank: Callable[[int], Dict[str, Any]], saved_world_size: int, world_size: int,
            rank: int) -> Dict[str, Any]:
    """This rank's state for ``world_size`` ranks, from the ``saved_world_size`` ranks' states
    ``read_rank(r)`` returns: row-wise values concatenated over the saved ranks and cut again."""
    saved = [read_rank(r) for r in range(saved_world_size)]
    for r, state in enumerate(saved):
        check_format(state, f"rank {r}'s checkpoint state")
        if state["world_size"] != saved_world_size or state["rank"] != r:
            raise Fsdp2CheckpointError(f"rank {r}'s checkpoint state says it is rank {state['rank']} of "
                                       f"{state['world_size']}, the checkpoint was saved by {saved_world_size} ranks")
    first = saved[0]
    params = {}
    for name, info in first["params"].items():
        shape = list(info["shape"])
        params[name] = {"shape": shape, "rows": list(rows_of(shape[0], world_size, rank))}

    def cut(name: str, pieces: List[Any], key: str):
        shape = first["params"][name]["shape"]
        lengths = [s["params"][name]["rows"][1] for s in saved]
        if not all(is_row_wise(p, n, shape) for p, n in zip(pieces, lengths)):
            raise Fsdp2CheckpointError(
                f"cannot re-slice {key} of parameter {name!r} from {saved_world_size} to {world_size} ranks: it is "
                f"not shaped like the parameter's rows ({[tuple(p.shape) if torch.is_tensor(p) else p for p in pieces]}"
                f"); load it with {saved_world_size} ranks, or pass load_optimizer_states=False")
        start, length = params[name]["rows"]
        return torch.cat(pieces, dim=0).narrow(0, start, length).clone()

    out: Dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": world_size, "rank": rank,
                           "params": params, "groups": first["groups"]}
    if "master" in first:
        out["master"] = {name: cut(name, [s["master"][name] for s in saved], "the fp32 master")
                         for name in first["master"]}
    state: Dict[str, Dict[str, Any]] = {}
    for name, entries in first["state"].items():
        shape = first["params"][name]["shape"]
        mine = {}
        for key, value in entries.items():
            pieces = [s["state"][name][key] for s in saved]
            if is_row_wise(value, first["params"][name]["rows"][1], shape) or (
                    torch.is_tensor(value) and any(is_row_wise(p, s["params"][name]["rows"][1], shape)
                                                   for p, s in zip(pieces, saved))):
                mine[key] = cut(name, pieces, f"the optimizer state {key!r}")
            else:
                mine[key] = value
        state[name] = mine
    out["state"] = state
    return out
