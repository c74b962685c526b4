"""The MLP the step-time benchmarks share: ``layers`` square Linear layers with ReLU between."""
from __future__ import annotations

import torch


def make_mlp(width: int, layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules[:-1])
