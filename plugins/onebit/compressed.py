"""The compressed all-reduce with error feedback of 1-bit Adam (Tang et al. 2021), with the
semantics of DeepSpeed's ``compressed_allreduce``.

Every rank compresses its (error-compensated) buffer to one sign bit per element and one scale;
rank r acts as the "server" of the r-th chunk: it averages every rank's compressed chunk r,
compresses that average again (with its own error feedback) and every rank gathers the server
chunks. Only packed sign bits (uint8, 8 per byte) and float32 scales travel, so a float32
buffer costs about 1/32 of an all-reduce on the wire.

Both compressions keep what they lost in an error buffer that is added back on the next call
(error feedback), so that over many calls the compression errors cancel: the running sum of the
results differs from the running sum of the exact averages by only the current error buffers.
The caller owns the error buffers (the optimizer checkpoints them).

**Scale granularity.** By default a rank's whole buffer shares one worker scale and each server
chunk one server scale. With ``segments`` (the lengths of the tensors laid end to end in the
buffer) every tensor gets its own worker scale and every (tensor, server chunk) piece its own
server scale -- DeepSpeed's per-tensor granularity for 1-bit Adam / 0/1 Adam -- for the price
of one float32 per tensor (and per piece) instead of one per rank in the two scale gathers. One
scale shared by tensors of very different magnitudes turns the small ones into noise of the size
of the large ones; per-tensor scales keep each tensor's compression relative to its own size.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["pack_signs", "unpack_signs", "padded_numel", "CompressedAllReduce"]

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The sign bits of ``x`` (1 for x >= 0, 0 for x < 0 or NaN), 8 per uint8 byte, little-endian
    within a byte: element 8k + j is bit j of byte k. ``x.numel()`` must be a multiple of 8."""
    n = x.numel()
    if n % 8:
        raise ValueError(f"pack_signs: numel {n} is not a multiple of 8")
    bits = (x.reshape(-1, 8) >= 0).view(torch.uint8)
    packed = bits[:, 0].clone()
    for j in range(1, 8):  # 8 strided shift-ors: about twice as fast as a shift and a sum over the bytes
        packed.bitwise_or_(bits[:, j] << j)
    return packed


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of :func:`pack_signs`: the first ``numel`` signs as float32 +1 / -1."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs: expected a uint8 tensor, got {packed.dtype}")
    if not 0 <= numel <= packed.numel() * 8:
        raise ValueError(f"unpack_signs: numel {numel} does not fit in {packed.numel()} packed bytes")
    shifts = _SHIFTS.to(packed.device)
    bits = torch.bitwise_right_shift(packed.reshape(-1, 1), shifts).bitwise_and_(1)
    return bits.reshape(-1)[:numel].to(torch.float32).mul_(2).sub_(1)


def padded_numel(n: int, world_size: int) -> int:
    """The smallest multiple of ``8 * world_size`` that holds ``n`` elements: the size of the
    buffer :class:`CompressedAllReduce` takes (each rank's chunk a whole number of bytes)."""
    unit = 8 * max(1, world_size)
    return -(-n // unit) * unit


def _compress(x: torch.Tensor, error: torch.Tensor):
    """(scale, packed signs) of ``x`` = scale * sign(x) with scale = ||x||_2 / sqrt(numel) and
    sign(0) = +1; ``error`` becomes x - scale * sign(x)."""
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    packed = pack_signs(x)
    error.copy_(x).sub_(unpack_signs(packed, x.numel()).mul_(scale))
    return scale.reshape(1), packed


class CompressedAllReduce:
    """``reduce(buffer, worker_error, server_error)`` averages ``buffer`` over the ranks of
    ``group`` through 1-bit compression with error feedback, in place.

    comm:         the comm layer (``dsplug.comm``): its ``all_to_all_single`` and
                  ``all_gather_into_tensor`` carry the packed signs and scales, so a comms logger
                  sees the real wire sizes
    world_size, rank: of ``group``

    ``buffer`` is a flat float32 tensor of :func:`padded_numel` elements; ``worker_error`` is a
    float32 tensor of the same size and ``server_error`` one of ``numel / world_size`` (this rank's
    chunk), both zeros at first and kept by the caller between calls.

    Steps (every rank): x = buffer + worker_error is compressed to scale * sign(x) (worker_error
    keeps the difference); chunk r of every rank's packed signs goes to rank r (all-to-all) and the
    scales are gathered; rank r averages the decompressed chunks, adds server_error, compresses
    the result again (server_error keeps the difference); the server chunks' signs and scales are
    gathered and decompressed into ``buffer``, identical on every rank.

    With world_size 1 nothing is communicated, but the same two compressions with their error
    feedback are applied (the exchanges are identities), so ``buffer`` becomes the twice-compressed
    x exactly as a one-rank group would give.
    """

    def __init__(self, comm, world_size: int, rank: int, group=None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"CompressedAllReduce: rank {rank} is not in a world of {world_size}")
        self.comm = comm
        self.world_size = world_size
        self.rank = rank
        self.group = group
        self._plans: Dict[Tuple, "_SegmentPlan"] = {}

    def _check(self, buffer, worker_error, server_error):
        n = buffer.numel()
        unit = 8 * self.world_size
        if n % unit:
            raise ValueError(f"CompressedAllReduce: buffer numel {n} is not a multiple of 8 * world_size = {unit} "
                             f"(pad it to padded_numel({n}, {self.world_size}) = {padded_numel(n, self.world_size)})")
        for name, t, want in (("buffer", buffer, n), ("worker_error", worker_error, n),
                              ("server_error", server_error, n // self.world_size)):
            if t.dtype != torch.float32:
                raise TypeError(f"CompressedAllReduce: {name} must be float32, got {t.dtype}")
            if t.numel() != want:
                raise ValueError(f"CompressedAllReduce: {name} has {t.numel()} elements, expected {want}")
            if not t.is_contiguous():
                raise ValueError(f"CompressedAllReduce: {name} must be contiguous")

    def __call__(self, buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                 segments: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Average ``buffer`` in place (see the class docstring). ``segments``: None for one scale
        per rank buffer / server chunk, or the positive lengths of consecutive segments from the
        start of the buffer (what they leave at the end is one more segment) for a scale per
        segment / per (segment, chunk) piece (see the module docstring)."""
        self._check(buffer, worker_error, server_error)
        if segments is not None:
            return self._segmented(buffer, worker_error, server_error, self._plan(buffer, segments))
        world = self.world_size
        flat, worker_err, server_err = buffer.view(-1), worker_error.view(-1), server_error.view(-1)
        n = flat.numel()
        chunk = n // world

        # 1. worker compression with error feedback
        x = flat + worker_err
        worker_scale, worker_signs = _compress(x, worker_err)
        del x

        # 2. chunk r of every rank's signs to rank r; every rank's scale to all
        if world == 1:
            received, worker_scales = worker_signs, worker_scale
        else:
            received = torch.empty_like(worker_signs)
            self.comm.all_to_all_single(received, worker_signs, group=self.group)
            worker_scales = torch.empty(world, dtype=torch.float32, device=flat.device)
            self.comm.all_gather_into_tensor(worker_scales, worker_scale, group=self.group)

        # 3. server: average the ranks' compressed chunk, compress it again with error feedback
        y = unpack_signs(received, n).view(world, chunk).mul_(worker_scales.view(world, 1)).sum(dim=0)
        y.div_(world).add_(server_err)
        server_scale, server_signs = _compress(y, server_err)
        del y

        # 4. every rank gathers the server chunks and decompresses them into the buffer
        if world == 1:
            gathered, server_scales = server_signs, server_scale
        else:
            gathered = torch.empty(n // 8, dtype=torch.uint8, device=flat.device)
            self.comm.all_gather_into_tensor(gathered, server_signs, group=self.group)
            server_scales = torch.empty(world, dtype=torch.float32, device=flat.device)
            self.comm.all_gather_into_tensor(server_scales, server_scale, group=self.group)
        flat.view(world, chunk).copy_(unpack_signs(gathered, n).view(world, chunk).mul_(server_scales.view(world, 1)))
        return buffer

    # ------------------------------------------------------------------ per-segment scales
    def _plan(self, buffer: torch.Tensor, segments: Sequence[int]) -> "_SegmentPlan":
        n = buffer.numel()
        key = (n, tuple(int(k) for k in segments), buffer.device)
        plan = self._plans.get(key)
        if plan is None:
            lengths = list(key[1])
            if any(k < 1 for k in lengths):
                raise ValueError(f"CompressedAllReduce: segments must be positive lengths, got {lengths}")
            if sum(lengths) > n:
                raise ValueError(f"CompressedAllReduce: segments cover {sum(lengths)} elements, more than the "
                                 f"buffer's {n}")
            if sum(lengths) < n:
                lengths.append(n - sum(lengths))
            plan = _SegmentPlan(lengths, n, self.world_size, buffer.device)
            self._plans[key] = plan  # one per param group layout
        return plan

    def _segmented(self, buffer, worker_error, server_error, plan: "_SegmentPlan") -> torch.Tensor:
        world, rank = self.world_size, self.rank
        flat, worker_err, server_err = buffer.view(-1), worker_error.view(-1), server_error.view(-1)
        n = flat.numel()
        chunk = n // world

        # 1. worker compression, one scale per segment
        x = flat + worker_err
        worker_scale = plan.scales(x, plan.segment_ids, plan.segment_lengths)
        worker_signs = pack_signs(x)
        worker_err.copy_(x).sub_(unpack_signs(worker_signs, n).mul_(worker_scale[plan.segment_ids]))
        del x

        # 2. chunk r of every rank's signs to rank r; every rank's segment scales to all
        if world == 1:
            received, worker_scales = worker_signs, worker_scale.view(1, -1)
        else:
            received = torch.empty_like(worker_signs)
            self.comm.all_to_all_single(received, worker_signs, group=self.group)
            worker_scales = torch.empty(world * plan.num_segments, dtype=torch.float32, device=flat.device)
            self.comm.all_gather_into_tensor(worker_scales, worker_scale, group=self.group)
            worker_scales = worker_scales.view(world, plan.num_segments)

        # 3. server: average the ranks' compressed chunk, compress it with a scale per piece
        mine = plan.segment_ids[rank * chunk:(rank + 1) * chunk]
        y = unpack_signs(received, n).view(world, chunk).mul_(worker_scales[:, mine]).sum(dim=0)
        y.div_(world).add_(server_err)
        server_scale = plan.scales(y, plan.piece_ids[rank], plan.piece_lengths[rank])
        server_signs = pack_signs(y)
        server_err.copy_(y).sub_(unpack_signs(server_signs, chunk).mul_(server_scale[plan.piece_ids[rank]]))
        del y

        # 4. every rank gathers the server chunks and their piece scales, and decompresses
        if world == 1:
            gathered, server_scales = server_signs, server_scale.view(1, -1)
        else:
            gathered = torch.empty(n // 8, dtype=torch.uint8, device=flat.device)
            self.comm.all_gather_into_tensor(gathered, server_signs, group=self.group)
            server_scales = torch.empty(world * plan.max_pieces, dtype=torch.float32, device=flat.device)
            self.comm.all_gather_into_tensor(server_scales, server_scale, group=self.group)
            server_scales = server_scales.view(world, plan.max_pieces)
        per_element = torch.gather(server_scales, 1, plan.piece_ids_all)
        flat.view(world, chunk).copy_(unpack_signs(gathered, n).view(world, chunk).mul_(per_element))
        return buffer


class _SegmentPlan:
    """Index tensors of one buffer layout: each element's segment, and its piece (segment ∩
    server chunk) numbered from 0 within its chunk. Segments are contiguous, so the pieces of a
    chunk are its segments from the first one it touches."""

    def __init__(self, lengths, n: int, world: int, device):
        chunk = n // world
        self.num_segments = len(lengths)
        self.segment_lengths = torch.tensor(lengths, dtype=torch.float32, device=device)
        self.segment_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                                   torch.tensor(lengths, device=device))
        by_chunk = self.segment_ids.view(world, chunk)
        self.piece_ids_all = by_chunk - by_chunk[:, :1]  # (world, chunk)
        counts = (self.piece_ids_all[:, -1] + 1).tolist()
        self.max_pieces = int(max(counts))
        self.piece_ids = [self.piece_ids_all[r] for r in range(world)]
        self.piece_lengths = []
        for r in range(world):
            lens = torch.zeros(self.max_pieces, dtype=torch.float32, device=device)
            lens.index_add_(0, self.piece_ids[r], torch.ones(chunk, dtype=torch.float32, device=device))
            self.piece_lengths.append(lens.clamp_min_(1.0))  # unused slots: 0 / 1 = 0

    @staticmethod
    def scales(x: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """sqrt(mean of x² over each id) (= ||x_id|| / sqrt(numel_id)); float32 of len(lengths)."""
        sums = torch.zeros(lengths.numel(), dtype=torch.float32, device=x.device)
        sums.index_add_(0, ids, x * x)
        return sums.div_(lengths).sqrt_()
