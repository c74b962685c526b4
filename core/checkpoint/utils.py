"""DeepSpeed's ``deepspeed.checkpoint.utils``: checkpoint file names and
:func:`clone_tensors_for_torch_save`.
"""
from __future__ import annotations

import os

import torch

from .constants import MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """``base_folder/mp_rank_<mp_rank_str>_model_states.pt``."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """``base_folder/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank:02d>_optim_states.pt``."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """``base_folder/<layer_id>-model_<tp_rank:02d>_model_states.pt``."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``item`` with every tensor in it (nested in lists, tuples and dicts, whose types are kept)
    replaced by a detached copy on ``device`` that owns its storage.

    ``torch.save`` of a view writes the view's whole storage (a slice of a flat buffer saves the
    buffer); saving these copies writes only their own elements, and changing the originals
    afterwards does not change them. Anything that is not a tensor or container is returned as is.
    """
    if torch.is_tensor(item):
        out = item.detach().to(device)
        if out.untyped_storage().data_ptr() == item.untyped_storage().data_ptr() or \
                out.untyped_storage().nbytes() != out.numel() * out.element_size():
            out = out.clone(memory_format=torch.contiguous_format)
        return out
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        values = [clone_tensors_for_torch_save(v, device) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    if isinstance(item, dict):
        cloned = {k: clone_tensors_for_torch_save(v, device) for k, v in item.items()}
        try:
            return type(item)(cloned)
        except TypeError:  # a dict subclass whose constructor takes something else
            return cloned
    return item


__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]
