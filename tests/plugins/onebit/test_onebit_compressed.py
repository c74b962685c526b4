"""The 1-bit compressed all-reduce with error feedback (plugins/onebit/compressed.py): the sign
packing, and in 2 real processes over gloo convergence of the error feedback, identical results
on every rank, the bytes on the wire, and equality with a single-process reference."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsplug import hookimpl
from dsplug.plugins.comms_logger.logger import bus_factor
from dsplug.plugins.onebit.compressed import CompressedAllReduce, pack_signs, padded_numel, unpack_signs

from tests.dist_harness import run_distributed

WORLD = 2
N = 4096  # a multiple of 8 * WORLD
ROUNDS = 300
CHECKPOINTS = (10, 30, 100, 300)
BIG = 2 ** 20


# ------------------------------------------------------------------------------ packing
def test_bit_order_is_little_endian_within_a_byte():
    x = -torch.ones(24)
    x[0] = 1.0  # element 0 -> bit 0 of byte 0
    x[15] = 0.0  # zero counts as positive: element 15 -> bit 7 of byte 1
    x[16:] = torch.tensor([2.0, -1, 3, -1, -0.0, -1, -1, float("nan")])  # -0.0 is >= 0; NaN is not
    assert pack_signs(x).tolist() == [0b00000001, 0b10000000, 0b00010101]
    assert pack_signs(x).dtype == torch.uint8
    assert unpack_signs(pack_signs(x), 24).tolist() == [1.0] + [-1.0] * 14 + [1.0, 1, -1, 1, -1, 1, -1, -1, -1]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2 ** 31 - 1))
def test_pack_unpack_round_trip(bytes_, seed):
    x = torch.randn(8 * bytes_, generator=torch.Generator().manual_seed(seed))
    x[:: 7] = 0.0
    signs = unpack_signs(pack_signs(x), x.numel())
    assert signs.dtype == torch.float32
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))
    assert torch.equal(unpack_signs(pack_signs(x), 5), signs[:5])  # a prefix


def test_pack_rejects_sizes_not_a_multiple_of_8_and_padding_fixes_them():
    with pytest.raises(ValueError, match="numel 12 is not a multiple of 8"):
        pack_signs(torch.ones(12))
    assert [padded_numel(n, 4) for n in (0, 1, 32, 33)] == [0, 32, 32, 64]
    with pytest.raises(ValueError, match="multiple of 8 \\* world_size = 16.*padded_numel\\(40, 2\\) = 48"):
        CompressedAllReduce(None, 2, 0)(torch.zeros(40), torch.zeros(40), torch.zeros(20))


# ------------------------------------------------------------------------------ reference
def _sign(x):
    return torch.where(x >= 0, 1.0, -1.0)


def _compressed(x):
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    return scale * _sign(x)


def _reference(inputs, rounds):
    """The algorithm for len(inputs) simulated ranks in one process, written out plainly: the
    final buffers, the sum of the outputs and the error buffers after ``rounds`` calls."""
    world, n = len(inputs), inputs[0].numel()
    chunk = n // world
    worker_err = [torch.zeros(n) for _ in inputs]
    server_err = [torch.zeros(chunk) for _ in inputs]
    total = torch.zeros(n)
    for _ in range(rounds):
        compressed = []
        for r in range(world):
            x = inputs[r] + worker_err[r]
            compressed.append(_compressed(x))
            worker_err[r] = x - compressed[r]
        out = []
        for s in range(world):  # rank s serves chunk s
            y = sum(compressed[r][s * chunk:(s + 1) * chunk] for r in range(world)) / world + server_err[s]
            c = _compressed(y)
            server_err[s] = y - c
            out.append(c)
        result = torch.cat(out)
        total += result
    return result, total, worker_err, server_err


def _segment_scales(x, bounds):
    """Per piece [a, b) of ``bounds``: ||x[a:b]|| / sqrt(b - a) repeated over the piece."""
    return torch.cat([torch.full((b - a,), float(torch.linalg.vector_norm(x[a:b]) / math.sqrt(b - a)))
                      for a, b in bounds])


def _segmented_reference(inputs, rounds, lengths):
    """The per-segment algorithm for len(inputs) simulated ranks: a worker scale per segment
    (``lengths``, the rest of the buffer one more), a server scale per (segment, chunk) piece."""
    world, n = len(inputs), inputs[0].numel()
    chunk = n // world
    ends = list(itertools.accumulate(lengths))
    ends = ends + [n] if ends[-1] < n else ends
    segs = list(zip([0] + ends[:-1], ends))
    worker_err = [torch.zeros(n) for _ in inputs]
    server_err = [torch.zeros(chunk) for _ in inputs]
    for _ in range(rounds):
        compressed = []
        for r in range(world):
            x = inputs[r] + worker_err[r]
            compressed.append(_segment_scales(x, segs) * _sign(x))
            worker_err[r] = x - compressed[r]
        out = []
        for s in range(world):
            lo, hi = s * chunk, (s + 1) * chunk
            pieces = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in segs if a < hi and b > lo]
            y = sum(compressed[r][lo:hi] for r in range(world)) / world + server_err[s]
            c = _segment_scales(y, pieces) * _sign(y)
            server_err[s] = y - c
            out.append(c)
        result = torch.cat(out)
    return result, worker_err, server_err


def test_segmented_world_of_one_is_the_reference():
    x = torch.randn(64, generator=torch.Generator().manual_seed(5))
    x[:16] *= 1000.0
    buf, we, se = x.clone(), torch.zeros(64), torch.zeros(64)
    reduce = CompressedAllReduce(None, 1, 0)
    for _ in range(3):
        buf.copy_(x)
        reduce(buf, we, se, segments=[16, 30])  # three segments: 16, 30 and the last 18
    result, (want_we,), (want_se,) = _segmented_reference([x], 3, [16, 30])
    assert torch.allclose(buf, result, rtol=1e-5) and torch.allclose(we, want_we, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="positive lengths"):
        reduce(buf, we, se, segments=[16, 0])
    with pytest.raises(ValueError, match="cover 70 elements, more than the buffer's 64"):
        reduce(buf, we, se, segments=[16, 54])


def test_world_of_one_is_the_reference_for_one_rank():
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    buf, we, se = x.clone(), torch.zeros(64), torch.zeros(64)
    reduce = CompressedAllReduce(None, 1, 0)
    total = torch.zeros(64)
    for _ in range(3):
        buf.copy_(x)
        assert reduce(buf, we, se) is buf
        total += buf
    result, want_total, (want_we,), (want_se,) = _reference([x], 3)
    assert torch.equal(buf, result) and torch.equal(total, want_total)
    assert torch.equal(we, want_we) and torch.equal(se, want_se)


# ------------------------------------------------------------------------------ 2 processes
def _inputs():
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(N, generator=g) * (1 + r) + r for r in range(WORLD)]


#: three tensors laid end to end (the rest of the N elements is a fourth): magnitudes 1e3, 1e-3, 1
SEGMENTS = (1000, 1500, 600)
SEGMENT_ROUNDS = 5


def _mixed_inputs():
    g = torch.Generator().manual_seed(99)
    out = []
    for r in range(WORLD):
        x = torch.randn(N, generator=g)
        x[:1000] *= 1e3
        x[1000:2500] *= 1e-3
        out.append(x)
    return out


class _Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def dsplug_comm_op(self, op, nbytes):
        self.calls.append((op, nbytes))


def _compressed_run():
    import dsplug.comm as comm

    comm.init_distributed(verbose=False)
    rank, world = comm.get_rank(), comm.get_world_size()
    reduce = CompressedAllReduce(comm, world, rank)
    g = _inputs()[rank]
    buf, worker_err, server_err = torch.empty(N), torch.zeros(N), torch.zeros(N // world)
    total = torch.zeros(N)
    out = {"mean_error": {}, "worker_norms": [], "server_norms": []}
    for t in range(1, ROUNDS + 1):
        buf.copy_(g)
        reduce(buf, worker_err, server_err)
        total += buf
        out["worker_norms"].append(float(worker_err.norm()))
        out["server_norms"].append(float(server_err.norm()))
        if t in CHECKPOINTS:
            out["mean_error"][t] = total / t
    out.update(buf=buf.clone(), total=total, worker_err=worker_err, server_err=server_err)

    # per-segment scales: a few rounds of the mixed-magnitude input, with and without segments
    mixed = _mixed_inputs()[rank]
    for key, segments in (("segmented", list(SEGMENTS)), ("shared", None)):
        buf, worker_err, server_err = torch.empty(N), torch.zeros(N), torch.zeros(N // world)
        first = None
        for _ in range(SEGMENT_ROUNDS):
            buf.copy_(mixed)
            reduce(buf, worker_err, server_err, segments=segments)
            first = buf.clone() if first is None else first
        out[key] = {"first": first, "buf": buf.clone(), "worker_err": worker_err.clone(),
                    "server_err": server_err.clone()}

    # the bytes of one call on a 1M-element buffer, and of an all-reduce of the same buffer
    recorder = _Recorder()
    comm.events.register(recorder)
    big = torch.randn(BIG, generator=torch.Generator().manual_seed(rank))
    reduce(big, torch.zeros(BIG), torch.zeros(BIG // world))
    out["compressed_calls"] = list(recorder.calls)
    recorder.calls.clear()
    reduce(big, torch.zeros(BIG), torch.zeros(BIG // world), segments=[BIG // 2 - 8, 16])
    out["segmented_calls"] = list(recorder.calls)
    recorder.calls.clear()
    comm.all_reduce(torch.randn(BIG))
    out["all_reduce_calls"] = list(recorder.calls)
    comm.events.unregister(recorder)
    return out


@pytest.fixture(scope="module")
def compressed():
    return run_distributed(_compressed_run, WORLD)


@pytest.mark.multiprocess
def test_running_mean_converges_to_the_true_mean_like_1_over_t(compressed):
    true_mean = sum(_inputs()) / WORLD
    errors = {t: float((m - true_mean).norm() / true_mean.norm()) for t, m in compressed[0]["mean_error"].items()}
    # error feedback: the sum of T outputs is T * mean minus the current error buffers (all ranks'
    # worker errors averaged, plus the server errors), which stay bounded, so the error is ~ 1/T
    for t in CHECKPOINTS:
        assert errors[t] * t < 6.0, errors
    assert errors[300] < 0.02 and errors[300] < errors[30] / 5 and errors[30] < errors[10] / 2, errors
    left = ROUNDS * true_mean - compressed[0]["total"]
    in_buffers = sum(out["worker_err"] for out in compressed) / WORLD + \
        torch.cat([out["server_err"] for out in compressed])
    assert torch.allclose(left, in_buffers, rtol=1e-4, atol=1e-2)


@pytest.mark.multiprocess
def test_error_buffers_stay_bounded(compressed):
    for out in compressed:
        for key in ("worker_norms", "server_norms"):
            norms = out[key]
            early, late = max(norms[:ROUNDS // 3]), max(norms[ROUNDS // 3:])
            assert late <= 1.5 * early, (key, early, late)


@pytest.mark.multiprocess
def test_every_rank_ends_with_the_same_buffer(compressed):
    rank0, rank1 = compressed
    assert torch.equal(rank0["buf"], rank1["buf"]) and torch.equal(rank0["total"], rank1["total"])


@pytest.mark.multiprocess
def test_distributed_result_equals_the_single_process_reference(compressed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks: the same reduction order in the norms
    try:
        result, total, worker_err, server_err = _reference(_inputs(), ROUNDS)
    finally:
        torch.set_num_threads(threads)
    for rank, out in enumerate(compressed):
        assert torch.equal(out["buf"], result)
        assert torch.equal(out["total"], total)
        assert torch.equal(out["worker_err"], worker_err[rank])
        assert torch.equal(out["server_err"], server_err[rank])


@pytest.mark.multiprocess
def test_only_packed_signs_and_scales_travel(compressed):
    for out in compressed:
        # signs: the all-to-all of this rank's packed signs and the gather of the server chunks'
        # (each a message of numel / 8 bytes); scales: one float32 per rank, gathered twice
        assert out["compressed_calls"] == [("all_to_all_single", BIG // 8), ("all_gather", 4 * WORLD),
                                           ("all_gather", BIG // 8), ("all_gather", 4 * WORLD)]
        assert out["all_reduce_calls"] == [("all_reduce", 4 * BIG)]
        sent = sum(nbytes for _, nbytes in out["compressed_calls"])
        assert sent == BIG // 4 + 8 * WORLD  # 16x smaller messages than the all-reduce's
        # on the wire (message size x bus factor, nccl-tests' definition): 32x fewer bytes
        wire = sum(n * bus_factor(op, WORLD) for op, n in out["compressed_calls"])
        all_reduce_wire = 4 * BIG * bus_factor("all_reduce", WORLD)
        assert all_reduce_wire / wire == pytest.approx(32, rel=1e-3)


@pytest.mark.multiprocess
def test_segmented_result_equals_the_single_process_reference(compressed):
    want, worker_err, server_err = _segmented_reference(_mixed_inputs(), SEGMENT_ROUNDS, list(SEGMENTS))

    def close(got, ref, offset=0):
        # the scales are sums in another order: equal to float32 rounding of each segment's size
        for a, b in ((0, 1000), (1000, 2500), (2500, 3100), (3100, N)):
            a, b = max(a - offset, 0), min(b - offset, got.numel())
            if a < b:
                size = float(ref[a:b].abs().max())
                assert torch.allclose(got[a:b], ref[a:b], rtol=1e-4, atol=1e-5 * size), (a, b)

    for rank, out in enumerate(compressed):
        got = out["segmented"]
        assert torch.equal(got["buf"], compressed[0]["segmented"]["buf"])  # identical on every rank
        close(got["buf"], want)
        close(got["worker_err"], worker_err[rank])
        close(got["server_err"], server_err[rank], offset=rank * (N // WORLD))


@pytest.mark.multiprocess
def test_a_scale_per_segment_keeps_each_tensors_error_relative_to_its_own_size(compressed):
    """One shared scale turns the 1e-3 tensor into noise the size of the 1e3 one; a scale per
    segment bounds every tensor's error by its own magnitude (1-bit error <= the input's norm)."""
    exact = sum(_mixed_inputs()) / WORLD
    bounds = [(0, 1000), (1000, 2500), (2500, 3100), (3100, N)]

    def relative_errors(result):
        return [float((result[a:b] - exact[a:b]).norm() / exact[a:b].norm()) for a, b in bounds]

    segmented = relative_errors(compressed[0]["segmented"]["first"])
    shared = relative_errors(compressed[0]["shared"]["first"])
    assert max(segmented) < 1.5, segmented
    assert shared[1] > 1e4 and shared[1] > 1e4 * segmented[1], shared


@pytest.mark.multiprocess
def test_segmented_scales_cost_one_float_per_segment_and_piece(compressed):
    for out in compressed:
        # segments: 524280, 16 and the rest (524280); server chunks of 524288: pieces 2 and 2
        assert out["segmented_calls"] == [("all_to_all_single", BIG // 8), ("all_gather", 4 * 3 * WORLD),
                                          ("all_gather", BIG // 8), ("all_gather", 4 * 2 * WORLD)]
