"""Point-to-point transfer of activations and their gradients between neighbouring stages,
through :mod:`dsplug.comm` (the comms logger and byte counters see every message as ``send`` /
``recv``).

An activation is a tensor or a tuple of tensors. The receiver must allocate buffers of the
right shapes and dtypes, so the first transfer on a link is preceded by a meta message: one
``int64`` tensor of its length, then an ``int64`` tensor describing the activation::

    [is_tuple, count, (dtype code, ndim, *shape) per tensor]

Later transfers reuse the described shapes (DeepSpeed's convention: micro-batch shapes do not
change). With ``dynamic_shape`` every transfer is preceded by its meta message. The sender checks
each activation against what it described, and an activation whose shape or dtype changed is an
error naming both (pass ``dynamic_shape=True`` to ``PipelineModule``, or call
``engine.reset_activation_shape()`` on every rank).

Floating-point tensors arrive with ``requires_grad=True``; their gradients go back the same way
(same shapes, no meta message), integer tensors (masks, ids) get none.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]
_CODE = {dt: i for i, dt in enumerate(DTYPES)}

#: ``(is_tuple, [(shape, dtype), ...])``
Meta = Tuple[bool, List[Tuple[Tuple[int, ...], torch.dtype]]]


def as_tensors(value) -> Tuple[bool, List[torch.Tensor]]:
    """``(is_tuple, tensors)`` of an activation; anything but a tensor or a tuple / list of tensors
    is an error naming what was found."""
    if torch.is_tensor(value):
        return False, [value]
    if isinstance(value, (tuple, list)) and all(torch.is_tensor(t) for t in value):
        return True, list(value)
    kinds = [type(v).__name__ for v in value] if isinstance(value, (tuple, list)) else type(value).__name__
    raise TypeError(f"a pipeline stage's output must be a tensor or a tuple of tensors to be sent to the next "
                    f"stage, got {kinds}")


def meta_of(value) -> Meta:
    is_tuple, tensors = as_tensors(value)
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"a pipeline activation has dtype {t.dtype}, which cannot be sent between stages "
                            f"(supported: {', '.join(str(d) for d in DTYPES)})")
    return is_tuple, [(tuple(t.shape), t.dtype) for t in tensors]


def encode(meta: Meta) -> torch.Tensor:
    is_tuple, specs = meta
    values = [int(is_tuple), len(specs)]
    for shape, dtype in specs:
        values += [_CODE[dtype], len(shape), *shape]
    return torch.tensor(values, dtype=torch.int64)


def decode(message: torch.Tensor) -> Meta:
    values = [int(v) for v in message.tolist()]
    is_tuple, count, i, specs = bool(values[0]), values[1], 2, []
    for _ in range(count):
        code, ndim = values[i], values[i + 1]
        specs.append((tuple(values[i + 2:i + 2 + ndim]), DTYPES[code]))
        i += 2 + ndim
    return is_tuple, specs


def describe(meta: Meta) -> str:
    is_tuple, specs = meta
    inner = ", ".join(f"{str(dtype).replace('torch.', '')}{list(shape)}" for shape, dtype in specs)
    return f"({inner})" if is_tuple else inner


class Link:
    """This stage's side of the link to one neighbour (global rank ``peer``): activations one way,
    gradients the other. ``device``: where received buffers live."""

    def __init__(self, comm, peer: int, device, dynamic_shape: bool = False):
        self.comm = comm
        self.peer = peer
        self.device = device
        self.dynamic_shape = dynamic_shape
        self.sent_meta: Optional[Meta] = None      # what we described to the peer
        self.recv_meta: Optional[Meta] = None      # what the peer described to us
        self.pending: List[object] = []            # async sends not yet waited for
        self.bytes_sent = 0

    def reset(self) -> None:
        """Forget the shapes (both sides must do it together): the next transfer sends meta again."""
        self.sent_meta = self.recv_meta = None

    # ------------------------------------------------------------------ sending side
    def _isend(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self.pending.append((self.comm.isend(tensor, dst=self.peer), tensor))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def send_activation(self, value) -> None:
        meta = meta_of(value)
        if self.sent_meta is None or self.dynamic_shape:
            message = encode(meta).to(self.device)
            self._isend(torch.tensor([message.numel()], dtype=torch.int64, device=self.device))
            self._isend(message)
            self.sent_meta = meta
        elif meta != self.sent_meta:
            from .module import PipelineError

            raise PipelineError(f"the activation sent to rank {self.peer} changed from {describe(self.sent_meta)} to "
                                f"{describe(meta)}; micro-batch shapes must stay the same (pass dynamic_shape=True "
                                "to PipelineModule, or call engine.reset_activation_shape() on every rank)")
        for t in as_tensors(value)[1]:
            self._isend(t)

    def send_grads(self, grads: Sequence[torch.Tensor]) -> None:
        for g in grads:
            self._isend(g)

    def wait(self) -> None:
        """Finish every pending send."""
        pending, self.pending = self.pending, []
        for work, _tensor in pending:
            work.wait()

    # ------------------------------------------------------------------ receiving side
    def recv_activation(self):
        """The next activation from the peer (floating tensors require grad)."""
        if self.recv_meta is None or self.dynamic_shape:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.comm.recv(length, src=self.peer)
            message = torch.zeros(int(length.item()), dtype=torch.int64, device=self.device)
            self.comm.recv(message, src=self.peer)
            self.recv_meta = decode(message.cpu())
        is_tuple, specs = self.recv_meta
        tensors = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.recv(t, src=self.peer)
            if t.is_floating_point():
                t.requires_grad_(True)
            tensors.append(t)
        return tuple(tensors) if is_tuple else tensors[0]

    def recv_grads(self, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Gradients for the floating tensors of ``like`` (this stage's sent activation), in order."""
        grads = []
        for t in like:
            if t.is_floating_point():
                g = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                self.comm.recv(g, src=self.peer)
                grads.append(g)
        return grads
