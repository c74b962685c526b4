"""Text -> character tokens -> training windows, and resuming the data order at a given step.

The shipped corpus is ``data/corpus.txt`` (see ``data/PROVENANCE.txt``). A text is split into
a training part and a held-out tail (:data:`HELD_OUT_FRACTION`); every position of the
training part starts a window (stride 1), and the engine's loader shuffles and shards the
windows by rank (``DistributedSampler`` seeded by the config's ``seed``), so the order of a
run is a pure function of the seed, the epoch and the world size. :func:`batches_from`
replays that order from any point, which is how ``--resume`` continues where it stopped.
"""
from __future__ import annotations

import itertools
import os
from importlib import resources
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset

HELD_OUT_FRACTION = 0.05
BUILTIN_CORPUS = "built-in corpus (plugins/train/data/corpus.txt)"


def read_builtin_corpus() -> str:
    return resources.files("dsplug.plugins.train").joinpath("data", "corpus.txt").read_text(encoding="utf-8")


def read_text(path: Optional[str]) -> Tuple[str, str]:
    """(text, description) of ``path``, or of the built-in corpus when ``path`` is None."""
    if path is None:
        return read_builtin_corpus(), BUILTIN_CORPUS
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), os.path.abspath(path)
    except FileNotFoundError:
        raise ValueError(f"--text {path!r}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


class CharVocab:
    """Characters <-> token ids; the ids are the positions in the sorted alphabet."""

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars):
            raise ValueError(f"a vocabulary needs distinct characters, got {chars!r}")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def of_text(cls, text: str) -> "CharVocab":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> List[int]:
        unknown = sorted(set(text) - self._ids.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r} "
                             f"(the vocabulary has {len(self.chars)} characters: {self.chars!r})")
        return [self._ids[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharWindows(Dataset):
    """Item ``i``: ``(tokens[i : i+seq_len], tokens[i+1 : i+seq_len+1])``, inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int = 1):
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for windows of seq_len {seq_len} "
                             f"(need at least {seq_len + 1}); use a longer text or a smaller --seq-len")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range 0..{len(self) - 1}")
        start = index * self.stride
        chunk = self.tokens[start:start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def split_tokens(tokens: torch.Tensor, seq_len: int,
                 held_out_fraction: float = HELD_OUT_FRACTION) -> Tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tail); the tail holds at least one window."""
    held = max(int(len(tokens) * held_out_fraction), seq_len + 1)
    if len(tokens) - held < seq_len + 1:
        raise ValueError(f"the text has {len(tokens)} characters: too short to train and hold out windows of "
                         f"seq_len {seq_len} (need at least {2 * (seq_len + 1)}); use a longer text or a "
                         f"smaller --seq-len")
    return tokens[:-held], tokens[-held:]


def batches_from(loader, consumed: int) -> Iterator:
    """The loader's micro-batches forever, starting after the first ``consumed`` of this rank.

    Epoch ``e`` is the loader's order with ``sampler.set_epoch(e)``; ``consumed`` micro-batches
    are ``consumed // len(loader)`` whole epochs plus a part of the next, whose first batches
    are skipped (they are cheap slices of one tensor).
    """
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError("the training loader is empty: fewer windows than ranks x micro-batch with drop_last")
    epoch, offset = divmod(consumed, per_epoch)
    sampler = getattr(loader, "sampler", None)
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from itertools.islice(iter(loader), offset, None)
        epoch, offset = epoch + 1, 0


@torch.no_grad()
def held_out_loss(model, tokens: torch.Tensor, seq_len: int, batch_size: int, max_batches: int = 8) -> float:
    """Mean next-character loss on non-overlapping windows of ``tokens`` (up to ``max_batches``)."""
    from .model import next_token_loss

    windows = CharWindows(tokens, seq_len, stride=seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for first in range(0, min(len(windows), batch_size * max_batches), batch_size):
            items = [windows[i] for i in range(first, min(first + batch_size, len(windows)))]
            x = torch.stack([a for a, _ in items]).to(device)
            y = torch.stack([b for _, b in items]).to(device)
            total += float(next_token_loss(model(x), y)) * len(items)
            count += len(items)
    finally:
        model.train(was_training)
    return total / count
