"""A small decoder-only transformer language model in plain ``torch.nn``.

Pre-LayerNorm blocks (causal self-attention, then a GELU MLP), learned position embeddings,
and an output projection tied to the token embedding. ``forward(tokens)`` returns logits of
shape ``(batch, time, vocab)``; :func:`generate_greedy` extends a prompt one token at a time.

``forward`` also takes the keywords DeepSpeed's engine passes (all off by default, and then the
computation is exactly the plain one):

* ``curriculum_seqlen=n`` (legacy curriculum learning): only the first ``n`` tokens of each
  sequence are used, so the logits have ``min(n, time)`` positions; score them against the
  targets' first positions (``targets[:, :logits.shape[1]]``).
* ``progressive_layer_drop=True, pld_theta=theta`` (progressive layer dropping), in training
  mode only: block ``i`` of ``L`` (counted from 1) runs with probability
  ``p_i = 1 - i / L * (1 - theta)`` (Zhang & He 2020), else it is skipped (the identity); a block
  that runs scales its residual branches by ``1 / p_i`` (inverted stochastic depth), so that
  evaluation runs every block unscaled. In eval mode the keywords change nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by the number of heads ({self.n_heads})")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # the widths come from the projections, so a head-pruned attention (fewer heads) still works
        q, k, v = self.qkv(x).chunk(3, dim=2)
        head_width = q.shape[-1] // self.n_heads
        # (batch, heads, time, head width)
        q, k, v = (t.view(batch, time, self.n_heads, head_width).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, self.n_heads * head_width))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x: torch.Tensor, keep_prob: float = 1.0) -> torch.Tensor:
        if keep_prob == 1.0:
            x = x + self.attn(self.ln_attn(x))
            return x + self.mlp(self.ln_mlp(x))
        x = x + self.attn(self.ln_attn(x)) / keep_prob
        return x + self.mlp(self.ln_mlp(x)) / keep_prob


class CharTransformer(nn.Module):
    """Decoder-only transformer over a character vocabulary."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied
        self.apply(self._init_weights)
        # GPT-2's scaling of the residual projections by depth keeps the residual stream's
        # variance from growing with the number of layers
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * config.n_layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, curriculum_seqlen: Optional[int] = None,
                progressive_layer_drop: bool = False, pld_theta: Optional[float] = None) -> torch.Tensor:
        if curriculum_seqlen is not None:
            if curriculum_seqlen < 1:
                raise ValueError(f"curriculum_seqlen must be a positive integer, got {curriculum_seqlen!r}")
            tokens = tokens[:, :int(curriculum_seqlen)]
        time = tokens.shape[1]
        if time > self.config.seq_len:
            raise ValueError(f"input of {time} tokens is longer than the model's seq_len {self.config.seq_len}")
        positions = torch.arange(time, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        drop = progressive_layer_drop and self.training and pld_theta is not None
        depth = len(self.blocks)
        for i, block in enumerate(self.blocks, start=1):
            if drop:
                keep = 1.0 - i / depth * (1.0 - float(pld_theta))
                if keep < 1.0 and float(torch.rand(())) >= keep:
                    continue  # skipped: this block is the identity for the whole batch
                x = block(x, keep)
            else:
                x = block(x)
        return self.head(self.ln_final(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``targets`` (the inputs shifted by one) from ``logits``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


@torch.no_grad()
def generate_greedy(model: CharTransformer, prompt: List[int], new_tokens: int) -> List[int]:
    """``prompt`` followed by ``new_tokens`` tokens, each the most likely next one (argmax)."""
    if not prompt:
        raise ValueError("generate_greedy needs a non-empty prompt")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokens = list(prompt)
    try:
        for _ in range(new_tokens):
            context = torch.tensor([tokens[-model.config.seq_len:]], dtype=torch.long, device=device)
            tokens.append(int(model(context)[0, -1].argmax()))
    finally:
        model.train(was_training)
    return tokens
