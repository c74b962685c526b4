"""ZeRO++ at ZeRO stage 3 (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training"), selected by DeepSpeed's keys of ``zero_optimization``.

As in DeepSpeed, ZeRO++ exists at stage 3 only; at stages 0-2 the keys are a config error
(:func:`dsplug.plugins.zero.config.zeropp_rules`).

qwZ, ``zero_quantized_weights: true`` (``zero_quantized_nontrainable_weights: true``: only the
parameters with ``requires_grad=False``)
    The forward / backward parameter all-gathers (the ones the stage-3 coordinator starts) send
    int8 codes instead of the model dtype. Each rank splits its partition of each parameter
    (``ceil(n/N)`` elements) into blocks of :data:`BLOCK_SIZE` consecutive elements (the last one
    shorter) and quantizes each block symmetrically with one fp32 scale (``scale = max|x|/127``,
    ``q = round(x/scale)``) through the compression library's ``quantize_to_int`` (the native
    quantizer op on CPU, its bit-identical torch fallback elsewhere). **On the wire**, one
    all-gather of a byte row per rank: ``[scales (fp32, 4 bytes per block) | codes (1 byte per
    element) | 0-3 bytes of padding]`` for every parameter in the coalesced gather. Every rank
    (this one included) dequantizes every rank's row (``q * scale`` in fp32, then the model dtype),
    so all ranks compute with identical working weights equal block-wise to
    ``dequantize(quantize(partition))``. The partitions and the fp32 master stay exact; only the
    gathered working copy is quantized. Gathers outside forward / backward stay exact:
    ``GatheredParameters``, module state dicts / 16-bit saves, persistent parameters
    (``stage3_param_persistence_threshold``), and a full value that came from a quantized gather is
    gathered again exactly when ``GatheredParameters`` asks for it.

qgZ, ``zero_quantized_gradients: true``
    The gradient reduce-scatter becomes an all-to-all of int8 codes. A gradient bucket is laid out
    with one row per destination rank (the rank owning that partition: its piece of every
    gradient in the bucket); each gradient's piece is quantized in its own :data:`BLOCK_SIZE`
    blocks (fp32 scale each, as for the weights: a small bias does not share a scale with a
    large weight), and **on the wire** one ``all_to_all_single`` sends row r
    (``[scales | codes | padding]`` bytes) to rank r. Each rank dequantizes the N rows
    it received (its partition's gradient from every rank) and sums them in fp32; averaging
    follows the plain reducer (``prescale_gradients`` / ``gradient_predivide_factor``).
    ``reduce_scatter: false`` has no effect then. Non-finite gradients (an fp16 overflow) travel
    as a NaN scale, so the overflow check still sees them.
    Hierarchy: the paper reduces intra-node first (all-to-all, dequantize, sum, re-quantize), then
    inter-node, with int4 codes. Here the codes are int8 and, without hpZ groups, one all-to-all
    over the whole data-parallel group is the single stage (on one node it is the whole
    hierarchy). With hpZ groups of k ranks (1 < k < N) the reduction is two-stage: an all-to-all
    inside the k-rank group leaves each member the group's partial sums for the N/k destinations
    with its local index, which are re-quantized and exchanged by an all-to-all among the N/k
    ranks with the same local index (one per group).

hpZ, ``zero_hpz_partition_size: k`` (> 1; must divide the data-parallel world size N)
    Groups of k consecutive ranks (``comm.new_group``). Besides its primary partition (``1/N`` of
    each parameter) every rank keeps a secondary shard: with ``m = N/k``, the member with local
    index j of a group holds elements ``[j*m*c, (j+1)*m*c)`` of the padded full parameter
    (``c = ceil(n/N)``), so the group together holds a whole copy. The shard is cut from the
    first forward / backward gather of the parameter after its partitions changed (an optimizer
    step, a checkpoint or state-dict load, a ``GatheredParameters`` write-back): that gather goes
    over the whole data-parallel group (quantized with qwZ); every later gather of that parameter
    until the next step (the backward re-gather, and the forwards and backwards of the other
    gradient-accumulation micro-steps) is an all-gather of the secondary shards inside the k-rank
    group. This is DeepSpeed's behaviour: the forward all-gather is global, the backward one stays
    in the group. The shard is kept in the form that arrived: with qwZ, the int8 codes and fp32
    scales of those m ranks' rows (the in-group gather then sends int8 too, and dequantizes to the
    very weights the forward used, bit for bit); without qwZ, the model-dtype values.
    Memory trade-off: each rank holds, once a parameter has been gathered, an extra
    ``m*c ~ n/k`` elements of every non-persistent parameter (model dtype, or 1 byte + 4 bytes per
    block with qwZ; reported as ``hpz_secondary`` by ``engine.model_state_memory()``) against
    ``n/N`` for the primary partition; in exchange the backward gathers move ``(k-1)/k`` of each
    parameter inside the group instead of ``(N-1)/N`` over the whole world. k = 1 turns hpZ off;
    k = N makes the group the whole world (the secondary shard is then the rank's own 1/N of the
    gathered value: no traffic is saved). The groups' gathers travel on gloo / NCCL subgroups.

Every message goes through :mod:`dsplug.comm`, so the comms logger records the real (compressed)
byte counts: ``all_gather`` of the packed int8 rows, ``all_to_all_single`` of the packed gradient rows.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from dsplug.ops.quantize import quantize_to_int

from .partitioned_param import split_rank_major, start_all_gather

#: elements per quantization block (one fp32 scale each) for qwZ and qgZ
BLOCK_SIZE = 2048
#: code width: symmetric int8, codes in [-127, 127]
BITS = 8

__all__ = ["BLOCK_SIZE", "BITS", "ZeroPP", "quantize_blocks", "dequantize_blocks", "build_zeropp"]


# ------------------------------------------------------------------------------ block quantization
def quantize_blocks(x: torch.Tensor, blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [numel], scales fp32 [blocks])`` of a 1-D ``x`` whose numel is ``blocks`` equal
    blocks (symmetric, :data:`BITS`; the compression library's quantizer). A block holding a NaN or
    an infinity gets codes 0 and a NaN scale (it dequantizes to NaN)."""
    try:
        qt = quantize_to_int(x, BITS, groups=blocks, symmetric=True)
        return qt.q.reshape(-1), qt.scale
    except ValueError as exc:
        if "NaN or infinite" not in str(exc):
            raise
    finite = torch.isfinite(x)
    qt = quantize_to_int(torch.where(finite, x, torch.zeros_like(x)), BITS, groups=blocks, symmetric=True)
    scale = qt.scale.clone()
    scale[~finite.view(blocks, -1).all(dim=1)] = float("nan")
    return qt.q.reshape(-1), scale


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``(rows, L)`` from int8 ``codes (rows, L)`` and ``scales (rows, ceil(L/BLOCK_SIZE))``:
    element e of a row is ``codes[e] * scales[e // BLOCK_SIZE]`` (one fp32 multiply)."""
    rows, length = codes.shape
    full = length // BLOCK_SIZE
    parts = []
    if full:
        head = codes[:, :full * BLOCK_SIZE].reshape(rows, full, BLOCK_SIZE).to(torch.float32)
        parts.append(head.mul_(scales[:, :full, None]).view(rows, full * BLOCK_SIZE))
    if length % BLOCK_SIZE:
        parts.append(codes[:, full * BLOCK_SIZE:].to(torch.float32).mul_(scales[:, full:full + 1]))
    if not parts:
        return torch.zeros(rows, 0, dtype=torch.float32, device=codes.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _blocks(n: int) -> int:
    return math.ceil(n / BLOCK_SIZE)


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def _pack_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 ``(rows, R)``: each row ``[scales as bytes | codes | zero padding to 4 bytes]``."""
    rows, length = codes.shape
    nscale = scales.shape[1] * 4
    out = torch.empty(rows, _align4(nscale + length), dtype=torch.uint8, device=codes.device)
    out[:, :nscale].copy_(scales.contiguous().view(torch.uint8))
    out[:, nscale:nscale + length].view(torch.int8).copy_(codes)
    out[:, nscale + length:].zero_()
    return out


def _unpack_rows(packed: torch.Tensor, blocks: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 (rows, length), scales fp32 (rows, blocks))`` of rows packed by _pack_rows."""
    nscale = blocks * 4
    scales = packed[:, :nscale].view(torch.float32)
    codes = packed[:, nscale:nscale + length].view(torch.int8)
    return codes, scales


# ------------------------------------------------------------------------------ weights (qwZ, hpZ)
class _ExactGather:
    """A plain all-gather of the model-dtype partitions over the data-parallel group."""

    quantized = False

    def __init__(self, partitioner, params):
        self.world = partitioner.world_size
        self.sizes = [p.ds_tensor.numel() for p in params]
        pieces = [partitioner.local_piece(p) for p in params]
        self.work, self.recv = start_all_gather(partitioner.comm, pieces, self.world, params[0].ds_tensor.dtype,
                                                partitioner.device)

    def finish(self) -> List[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        return split_rank_major(self.recv, self.world, self.sizes)


class _QuantizedGather:
    """qwZ: one all-gather of every rank's packed ``[scales | int8 codes]`` row, dequantized."""

    quantized = True

    def __init__(self, partitioner, params):
        self.world = partitioner.world_size
        self.dtype = params[0].ds_tensor.dtype
        device = partitioner.device
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.nblocks = [_blocks(c) for c in self.sizes]
        self.length, self.total_blocks = sum(self.sizes), sum(self.nblocks)
        padded = torch.zeros(self.total_blocks * BLOCK_SIZE, dtype=self.dtype, device=device)
        start = 0
        for p, c, g in zip(params, self.sizes, self.nblocks):
            padded[start:start + c].copy_(partitioner.local_piece(p).reshape(-1))
            start += g * BLOCK_SIZE
        q, scales = quantize_blocks(padded, self.total_blocks)
        codes = torch.empty(1, self.length, dtype=torch.int8, device=device)
        start = offset = 0
        for c, g in zip(self.sizes, self.nblocks):
            codes[0, offset:offset + c].copy_(q[start:start + c])
            offset += c
            start += g * BLOCK_SIZE
        send = _pack_rows(codes, scales.view(1, -1)).view(-1)
        self.recv = torch.empty(self.world * send.numel(), dtype=torch.uint8, device=device)
        self.work = partitioner.comm.all_gather_into_tensor(self.recv, send, async_op=True)

    def finish(self) -> List[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        codes, scales = _unpack_rows(self.recv.view(self.world, -1), self.total_blocks, self.length)
        fulls, offset, block = [], 0, 0
        self.rows = []  # per parameter: (codes (N, c), scales (N, g)) as received, for hpZ's secondary shard
        for c, g in zip(self.sizes, self.nblocks):
            rows = (codes[:, offset:offset + c], scales[:, block:block + g])
            values = dequantize_blocks(*rows)
            fulls.append(values.to(self.dtype).reshape(-1))
            self.rows.append(rows)
            offset += c
            block += g
        return fulls


class _SecondaryGather:
    """hpZ: an all-gather of the (model-dtype) secondary shards inside this rank's k-rank group."""

    quantized = False

    def __init__(self, wire, partitioner, params):
        self.k = wire.hpz
        self.sizes = [p._ds_secondary.numel() for p in params]
        pieces = [p._ds_secondary for p in params]
        self.work, self.recv = start_all_gather(partitioner.comm, pieces, self.k, pieces[0].dtype, partitioner.device,
                                                group=wire.intra_group)

    def finish(self) -> List[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        return split_rank_major(self.recv, self.k, self.sizes)


class _QuantizedSecondaryGather:
    """hpZ with qwZ: the secondary shards are the int8 codes and scales the forward gather received
    (m ranks' rows); an all-gather of those inside the k-rank group, dequantized exactly as the
    forward did (the same weights, bit for bit)."""

    quantized = True

    def __init__(self, wire, partitioner, params):
        self.k = wire.hpz
        self.dtype = params[0].ds_tensor.dtype
        self.shapes = [(p._ds_secondary[0].shape, p._ds_secondary[1].shape) for p in params]  # (m, c), (m, g)
        codes = torch.cat([p._ds_secondary[0].reshape(-1) for p in params])
        scales = torch.cat([p._ds_secondary[1].reshape(-1) for p in params])
        self.length, self.nscales = codes.numel(), scales.numel()
        send = _pack_rows(codes.view(1, -1), scales.view(1, -1)).view(-1)
        self.recv = torch.empty(self.k * send.numel(), dtype=torch.uint8, device=partitioner.device)
        self.work = partitioner.comm.all_gather_into_tensor(self.recv, send, group=wire.intra_group, async_op=True)

    def finish(self) -> List[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        codes, scales = _unpack_rows(self.recv.view(self.k, -1), self.nscales, self.length)
        fulls, offset, soffset = [], 0, 0
        for (m, c), (_, g) in self.shapes:
            rows_codes = codes[:, offset:offset + m * c].reshape(self.k * m, c)
            rows_scales = scales[:, soffset:soffset + m * g].reshape(self.k * m, g)
            fulls.append(dequantize_blocks(rows_codes, rows_scales).to(self.dtype).reshape(-1))
            offset += m * c
            soffset += m * g
        return fulls


class _WireOp:
    """The gathers one GatherHandle needs (secondary / quantized / exact subsets), finished together."""

    def __init__(self, wire, partitioner, params):
        self.wire, self.partitioner, self.params = wire, partitioner, params
        self.generation = partitioner.generation
        secondary, quantized_secondary, quantized, exact = [], [], [], []
        for p in params:
            if wire.hpz > 1 and getattr(p, "_ds_secondary_gen", None) == self.generation:
                (quantized_secondary if isinstance(p._ds_secondary, tuple) else secondary).append(p)
            elif wire.quantizes(p):
                quantized.append(p)
            else:
                exact.append(p)
        self.parts = []
        for subset, kind in ((secondary, _SecondaryGather), (quantized_secondary, _QuantizedSecondaryGather)):
            if subset:
                self.parts.append((subset, kind(wire, partitioner, subset)))
        for subset, kind in ((quantized, _QuantizedGather), (exact, _ExactGather)):
            if subset:
                self.parts.append((subset, kind(partitioner, subset)))
        wire.counts["secondary"] += len(secondary) + len(quantized_secondary)
        wire.counts["quantized"] += len(quantized)
        wire.counts["exact"] += len(exact)
        self.buffer = [op.recv for _, op in self.parts]

    def finish(self):
        """``(fulls, quantized flags)`` in the order of the params (flat padded full values)."""
        full_of, flag_of = {}, {}
        for subset, op in self.parts:
            fulls = op.finish()
            for i, (p, full) in enumerate(zip(subset, fulls)):
                full_of[id(p)], flag_of[id(p)] = full, op.quantized
                if self.wire.hpz > 1:
                    if isinstance(op, _QuantizedGather):
                        self.wire.keep_quantized_secondary(p, *op.rows[i], self.generation)
                    elif isinstance(op, _ExactGather):
                        self.wire.keep_secondary(p, full, self.generation)
        return [full_of[id(p)] for p in self.params], [flag_of[id(p)] for p in self.params]


class WeightWire:
    """What the stage-3 partitioner's forward / backward gathers send (its ``wire``)."""

    def __init__(self, rank: int, world: int, quantize_trainable: bool, quantize_frozen: bool, hpz: int,
                 intra_group=None):
        self.rank, self.world = rank, world
        self.quantize_trainable = quantize_trainable
        self.quantize_frozen = quantize_frozen or quantize_trainable
        self.hpz = hpz
        self.intra_group = intra_group
        #: parameters gathered per kind (a gather of several parameters counts each)
        self.counts = {"secondary": 0, "quantized": 0, "exact": 0}

    def quantizes(self, p) -> bool:
        return self.quantize_trainable if p.requires_grad else self.quantize_frozen

    def start(self, partitioner, params) -> _WireOp:
        return _WireOp(self, partitioner, params)

    def _span(self, rows: int):
        """The rows (ranks' partitions) this rank's secondary shard covers: ``[j*m, (j+1)*m)``."""
        m = rows // self.hpz
        j = self.rank % self.hpz
        return j * m, (j + 1) * m

    def keep_secondary(self, p, full: torch.Tensor, generation: int) -> None:
        """hpZ: keep this rank's secondary shard of ``p`` from its padded full value ``full``."""
        lo, hi = self._span(self.world)
        c = full.numel() // self.world
        p._ds_secondary = _reuse(getattr(p, "_ds_secondary", None), full[lo * c:hi * c])
        p._ds_secondary_gen = generation

    def keep_quantized_secondary(self, p, codes: torch.Tensor, scales: torch.Tensor, generation: int) -> None:
        """hpZ with qwZ: keep the received codes / scales of this rank's secondary rows."""
        lo, hi = self._span(codes.shape[0])
        kept = getattr(p, "_ds_secondary", None)
        kept = kept if isinstance(kept, tuple) else (None, None)
        p._ds_secondary = (_reuse(kept[0], codes[lo:hi]), _reuse(kept[1], scales[lo:hi]))
        p._ds_secondary_gen = generation


def _reuse(kept: Optional[torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``kept`` when it fits (same shape, dtype, device), else a new copy."""
    if (isinstance(kept, torch.Tensor) and kept.shape == value.shape and kept.dtype == value.dtype
            and kept.device == value.device):
        return kept.copy_(value)
    return value.clone(memory_format=torch.contiguous_format)


def secondary_tensors(params) -> List[torch.Tensor]:
    """The hpZ secondary shards held now (for the memory report)."""
    out = []
    for p in params:
        kept = getattr(p, "_ds_secondary", None)
        if isinstance(kept, tuple):
            out.extend(kept)
        elif kept is not None:
            out.append(kept)
    return out


# ------------------------------------------------------------------------------ gradients (qgZ)
class QuantizedGradients:
    """qgZ: the reduce-scatter of a rank-major gradient bucket as int8 all-to-all(s)."""

    def __init__(self, comm, rank: int, world: int, hpz: int = 1, intra_group=None, inter_group=None):
        self.comm = comm
        self.rank, self.world = rank, world
        self.hierarchical = 1 < hpz < world
        self.k = hpz
        self.intra_group, self.inter_group = intra_group, inter_group
        self.buckets = 0

    def start(self, bucket: torch.Tensor, sizes: List[int], async_op: bool = False):
        """``bucket``: (N, K), row r = rank r's pieces of the gradients in the bucket (``sizes``
        elements each, concatenated). Returns ``(work, buffer, finish)``; ``finish()`` gives this
        rank's summed partition, fp32 (K,)."""
        self.buckets += 1
        world, length = bucket.shape
        if not self.hierarchical:
            return self._stage(bucket, sizes, None, async_op)
        k, m = self.k, world // self.k
        # stage 1, inside the k-rank group: member j' gets the rows of destinations g'*k + j'
        rows = bucket.reshape(m, k, length).transpose(0, 1).reshape(k, m * length)
        work, _, finish = self._stage(rows, sizes * m, self.intra_group, False)
        partial = finish().view(m, length)  # the group's sums for destinations (g', j), g' = 0..m-1
        # stage 2, among the ranks with this local index (one per group): row g' goes to group g'
        return self._stage(partial, sizes, self.inter_group, async_op)

    def _stage(self, rows: torch.Tensor, sizes: List[int], group, async_op: bool):
        """One all-to-all: row r of ``rows`` to group rank r, each gradient piece (``sizes``) in its
        own blocks; returns ``(work, buffer, finish)``, ``finish()`` = the sum of the received rows."""
        count, length = rows.shape
        nblocks = [_blocks(c) for c in sizes]
        total_blocks = sum(nblocks)
        aligned = all(c % BLOCK_SIZE == 0 for c in sizes)
        if aligned:
            padded = rows.contiguous()
        else:
            padded = torch.zeros(count, total_blocks * BLOCK_SIZE, dtype=rows.dtype, device=rows.device)
            self._scatter(rows, padded, sizes, nblocks)  # each piece at the start of its own blocks
        q, scales = quantize_blocks(padded.view(-1), count * total_blocks)
        q = q.view(count, -1)
        if aligned:
            codes = q
        else:
            codes = torch.empty(count, length, dtype=torch.int8, device=rows.device)
            self._scatter(codes, q, sizes, nblocks, gather=True)  # the padding's codes are not sent
        send = _pack_rows(codes, scales.view(count, total_blocks))
        recv = torch.empty_like(send)
        work = self.comm.all_to_all_single(recv, send, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            got_codes, got_scales = _unpack_rows(recv, total_blocks, length)
            parts, offset, block = [], 0, 0
            for c, g in zip(sizes, nblocks):
                parts.append(dequantize_blocks(got_codes[:, offset:offset + c], got_scales[:, block:block + g]))
                offset += c
                block += g
            values = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            return values.sum(dim=0)

        return work, recv, finish

    @staticmethod
    def _scatter(compact: torch.Tensor, blocked: torch.Tensor, sizes, nblocks, gather: bool = False) -> None:
        """Copy each piece from its place in ``compact`` (pieces back to back) to the start of its
        blocks in ``blocked``; ``gather=True``: the other way, from ``blocked`` into ``compact``."""
        offset = start = 0
        for c, g in zip(sizes, nblocks):
            if gather:
                compact[:, offset:offset + c].copy_(blocked[:, start:start + c])
            else:
                blocked[:, start:start + c].copy_(compact[:, offset:offset + c])
            offset += c
            start += g * BLOCK_SIZE


# ------------------------------------------------------------------------------ set-up
class ZeroPP:
    """The ZeRO++ pieces one stage-3 engine uses: ``wire`` (qwZ / hpZ, None when both are off)
    and ``gradients`` (qgZ, None when off)."""

    def __init__(self, wire: Optional[WeightWire], gradients: Optional[QuantizedGradients], hpz: int):
        self.wire = wire
        self.gradients = gradients
        self.hpz = hpz


def check_hpz(hpz: int, world: int) -> None:
    if hpz < 1 or world % hpz:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={hpz} must divide the data-parallel world size "
                         f"{world} (hpZ keeps a secondary copy per group of that many consecutive ranks; 1 turns it "
                         "off)")


def _hpz_groups(comm, rank: int, world: int, k: int, inter: bool):
    """(this rank's k-rank group, its group of same-local-index ranks or None); every rank creates
    every group, in the same order, as torch requires."""
    intra_group = inter_group = None
    for g in range(world // k):
        ranks = list(range(g * k, (g + 1) * k))
        group = comm.new_group(ranks)
        if rank in ranks:
            intra_group = group
    if inter:
        for j in range(k):
            ranks = list(range(j, world, k))
            group = comm.new_group(ranks)
            if rank in ranks:
                inter_group = group
    return intra_group, inter_group


def build_zeropp(zero_config, comm, rank: int, world: int) -> Optional[ZeroPP]:
    """The ZeRO++ objects the config asks for (None: ZeRO++ is off)."""
    qw = bool(getattr(zero_config, "zero_quantized_weights", False))
    qnw = bool(getattr(zero_config, "zero_quantized_nontrainable_weights", False))
    qg = bool(getattr(zero_config, "zero_quantized_gradients", False))
    hpz = int(getattr(zero_config, "zero_hpz_partition_size", 1) or 1)
    check_hpz(hpz, world)
    if not (qw or qnw or qg or hpz > 1):
        return None
    intra_group = inter_group = None
    if hpz > 1:
        intra_group, inter_group = _hpz_groups(comm, rank, world, hpz, inter=qg and hpz < world)
    wire = WeightWire(rank, world, qw, qnw, hpz, intra_group) if (qw or qnw or hpz > 1) else None
    gradients = QuantizedGradients(comm, rank, world, hpz, intra_group, inter_group) if qg else None
    return ZeroPP(wire, gradients, hpz)
