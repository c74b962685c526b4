"""Random layerwise token dropping (random-LTD): DeepSpeed's ``data_routing`` API.

* :class:`RandomLayerTokenDrop` wraps a transformer layer. In training, once configured, each
  forward keeps ``reserved_length`` tokens of every sample (chosen uniformly without replacement,
  independently per sample and per layer, sorted so the kept tokens keep their order), runs the
  layer on them only -- with the attention mask (keyword ``model_mask_name``) gathered to the kept
  positions, rows and columns -- and scatters the outputs back: dropped tokens leave the layer
  unchanged (their gradient passes straight through; the layer's parameters see only the kept
  tokens). In eval mode, or when ``reserved_length >= seq_len``, it is the plain layer.
  ``hidden_state_order``: ``batch_seq_dim`` (``[B, S, ...]``) or ``seq_batch_dim`` (``[S, B, ...]``).
  For a causal mask the gathered mask of sorted positions is the causal mask of the kept tokens
  (DeepSpeed's decoder slice ``mask[..., :r, :r]``); for an encoder's padding mask it is DeepSpeed's
  gathered mask; ``model_type`` therefore changes nothing here.
* :func:`convert_to_random_ltd` wraps every module of a class (before ``initialize``, or on the
  engine after it, as Megatron-DeepSpeed does); the wrapped layers are numbered in module order
  and ``random_ltd_layer_id`` picks which drop tokens.
* :class:`RandomLTDScheduler`: kept tokens per step (:func:`.schedules.random_ltd_value`), updated by
  the engine after every optimizer step, checkpointed with the engine; it also counts the consumed
  layer tokens (DeepSpeed's ``consumed_layer_tokens``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .schedules import random_ltd_value


class RandomLTDScheduler:
    def __init__(self, config, global_batch_size: int = 0):
        """``config``: the parsed ``random_ltd`` section (:class:`.config.RandomLTDConfig`) or its dict."""
        if isinstance(config, dict):
            from dsplug.config.schema import parse

            from .config import RandomLTDConfig

            config = parse(RandomLTDConfig, config, "random_ltd")
        self.config = config
        sched = config.random_ltd_schedule
        self.state: Dict[str, Any] = {
            "min_value": sched.min_value, "max_value": sched.max_value, "current_value": sched.min_value,
            "schedule_type": sched.schedule_type, "require_steps": sched.schedule_config.require_steps,
            "seq_per_step": sched.schedule_config.seq_per_step, "consumed_layer_tokens": 0, "curr_step": -1,
            "global_batch_size": int(global_batch_size), "random_ltd_layer_num": config.random_ltd_layer_num,
            "total_layer_num": config.total_layer_num,
        }

    def get_value(self, global_steps: int) -> int:
        s = self.state
        return random_ltd_value(global_steps, s["min_value"], s["max_value"], s["require_steps"], s["seq_per_step"])

    def update_seq(self, global_steps: int) -> int:
        self.state["current_value"] = self.get_value(global_steps)
        self.state["curr_step"] = int(global_steps)
        return self.state["current_value"]

    def count_step(self) -> None:
        """Add one optimizer step's layer tokens (at the current value) to ``consumed_layer_tokens``."""
        s = self.state
        ltd, total = s["random_ltd_layer_num"], s["total_layer_num"] or s["random_ltd_layer_num"]
        s["consumed_layer_tokens"] += s["global_batch_size"] * (s["current_value"] * ltd +
                                                                 s["max_value"] * max(0, total - ltd))

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = int(seq_length)

    def get_random_ltd_layer_num(self) -> int:
        return self.state["random_ltd_layer_num"]

    def get_state(self) -> Dict[str, Any]:
        return self.state

    def set_state(self, state: Dict[str, Any]) -> None:
        self.state = dict(state)

    def state_dict(self) -> Dict[str, Any]:
        return {k: self.state[k] for k in ("current_value", "consumed_layer_tokens", "curr_step", "min_value",
                                           "max_value")}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in ("current_value", "consumed_layer_tokens", "curr_step"):
            if key in state:
                self.state[key] = state[key]


def sample_kept_tokens(batch: int, seq_len: int, reserved: int, device) -> torch.Tensor:
    """``[batch, reserved]`` sorted positions, each row drawn uniformly without replacement."""
    return torch.rand(batch, seq_len, device=device).argsort(dim=1)[:, :reserved].sort(dim=1).values


def _expand(index: torch.Tensor, like: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """``index`` ([B, r], batch first) shaped for gather / scatter along ``seq_dim`` of ``like``."""
    if seq_dim == 0:
        index = index.t()
    shape = list(index.shape) + [1] * (like.dim() - 2)
    return index.reshape(shape).expand(*index.shape, *like.shape[2:])


def gather_tokens(hidden: torch.Tensor, index: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return hidden.gather(seq_dim, _expand(index, hidden, seq_dim))


def scatter_tokens(hidden: torch.Tensor, index: torch.Tensor, part: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return hidden.scatter(seq_dim, _expand(index, hidden, seq_dim), part.to(hidden.dtype))


def gather_mask(mask: torch.Tensor, index: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The mask restricted to the kept positions: its last dim (keys) and, for a ``[B, ..., S, S]``
    mask, its second-last (queries). A batch dim of 1 is expanded to the batch."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        return mask
    batch, kept = index.shape
    if mask.shape[0] != batch:
        mask = mask.expand(batch, *mask.shape[1:])
    lead = [1] * (mask.dim() - 2)
    if mask.shape[-1] == seq_len:
        mask = mask.gather(-1, index.reshape(batch, *lead, kept).expand(*mask.shape[:-1], kept))
    if mask.dim() >= 3 and mask.shape[-2] == seq_len:
        rows = index.reshape(batch, *lead[:-1], kept, 1).expand(*mask.shape[:-2], kept, mask.shape[-1])
        mask = mask.gather(-2, rows)
    return mask


class RandomLayerTokenDrop(nn.Module):
    """A layer that, in training, runs on ``reserved_length`` random tokens of each sample."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: Optional[RandomLTDScheduler] = None
        self.random_ltd_layer_id: Optional[int] = None
        self.random_ltd_initialized = False
        self.mask_name: Optional[str] = None
        self.model_type = "decoder"
        self.batch_first = True
        self.reserved_length: Optional[int] = None  # kept tokens in the last training forward

    def init_config(self, config, scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        """``config``: the parsed ``random_ltd`` section (or its dict)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.mask_name = get("model_mask_name", None)
        self.model_type = get("model_type", "decoder")
        order = get("hidden_state_order", "batch_seq_dim")
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"random_ltd hidden_state_order {order!r}: expected batch_seq_dim or seq_batch_dim")
        self.batch_first = order == "batch_seq_dim"
        self.random_ltd_initialized = True

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if not (self.training and self.random_ltd_initialized):
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        seq_dim = 1 if self.batch_first else 0
        seq_len, batch = hidden_states.shape[seq_dim], hidden_states.shape[1 - seq_dim]
        reserved = max(1, min(seq_len, int(self.random_ltd_scheduler.get_current_seq())))
        self.reserved_length = reserved
        if reserved >= seq_len:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        index = sample_kept_tokens(batch, seq_len, reserved, hidden_states.device)
        part = gather_tokens(hidden_states, index, seq_dim)
        if self.mask_name and kwargs.get(self.mask_name) is not None:
            kwargs[self.mask_name] = gather_mask(kwargs[self.mask_name], index, seq_len)
        outputs = self.random_ltd_layer(part, *args, **kwargs)
        if isinstance(outputs, tuple):
            return (scatter_tokens(hidden_states, index, outputs[0], seq_dim),) + tuple(outputs[1:])
        return scatter_tokens(hidden_states, index, outputs, seq_dim)


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def convert_to_random_ltd(model, convert_type):
    """Wrap every ``convert_type`` module of ``model`` (a module, or an engine: its ``module``) in
    :class:`RandomLayerTokenDrop`; on an engine the wrapped layers are configured at once."""
    root = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    names = [n for n, m in root.named_modules() if isinstance(m, convert_type) and n]
    if isinstance(root, convert_type) and not names:
        raise ValueError("convert_to_random_ltd: the model itself is the layer class; wrap its layers instead")
    for name in names:
        _set_submodule(root, name, RandomLayerTokenDrop(root.get_submodule(name)))
    init = getattr(model, "random_ltd_initialize", None)
    if callable(init) and root is not model:
        init()
    return model


def random_ltd_layers(module: nn.Module) -> List[RandomLayerTokenDrop]:
    return [m for m in module.modules() if isinstance(m, RandomLayerTokenDrop)]


def initialize_layers(module: nn.Module, config, scheduler: RandomLTDScheduler) -> List[RandomLayerTokenDrop]:
    """Configure the wrapped layers whose index (module order) is in ``random_ltd_layer_id``."""
    layers = random_ltd_layers(module)
    ids = list(config.random_ltd_layer_id)
    missing = [i for i in ids if i >= len(layers)]
    if missing:
        raise ValueError(f"data_efficiency.data_routing.random_ltd.random_ltd_layer_id names layer(s) {missing}, "
                         f"but the model has {len(layers)} RandomLayerTokenDrop layer(s) (numbered 0.. in module "
                         f"order)")
    chosen = []
    for i, layer in enumerate(layers):
        if i in ids:
            layer.init_config(config, scheduler, i)
            chosen.append(layer)
    return chosen


def remove_random_ltd_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """The state dict with the wrappers' ``.random_ltd_layer`` removed from the keys."""
    return {("".join(k.split(".random_ltd_layer")) if ".random_ltd_layer" in k else k): v
            for k, v in state_dict.items()}


def save_without_random_ltd(model) -> Dict[str, Any]:
    root = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    return remove_random_ltd_state_dict(root.state_dict())
