"""Point-to-point and all-to-all in dsplug.comm: send/recv/isend/irecv, all_to_all_single and
all_to_all, on torch's all-to-all and on the isend/irecv fallback, in real processes over gloo.

One spawned run of 3 processes does every distributed check (on the world and on a 2-rank
subgroup of global ranks 1 and 2, whose group ranks differ from the global ones)."""
from __future__ import annotations

import pytest
import torch

import dsplug.comm as comm
from dsplug import hookimpl
from dsplug.plugins.comms_logger.logger import bus_factor
from dsplug.plugins.comms_logger.config import DEEPSPEED_OPS

from tests.dist_harness import run_distributed

WORLD = 3


class _Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def dsplug_comm_op(self, op, nbytes, world_size, async_op):
        self.calls.append((op, nbytes, world_size, async_op))


def _input(rank: int, splits, cols: int = 3) -> torch.Tensor:
    """Rank ``rank``'s all-to-all input: row values say (sender, destination, row)."""
    rows = [torch.full((n, cols), 1000.0 * rank + 100.0 * dst) + torch.arange(n).unsqueeze(1) * 10 +
            torch.arange(cols) for dst, n in enumerate(splits)]
    return torch.cat(rows)


def _expected(rank: int, splits_of) -> torch.Tensor:
    """What ``rank`` receives: chunk ``rank`` of every rank's input, in rank order."""
    return torch.cat([_input(src, splits_of(src)).split(splits_of(src))[rank] for src in range(len(splits_of(0)))])


def _a2a_checks(rank: int, world: int, group, out: dict, tag: str) -> None:
    even = lambda src: [2] * world  # noqa: E731
    uneven = lambda src: [(src + dst) % 3 + (dst == 0) for dst in range(world)]  # zero-size chunks too # noqa: E731

    x = _input(rank, even(rank))
    y = torch.full_like(x, -1.0)
    comm.all_to_all_single(y, x, group=group)
    out[f"{tag}even"] = torch.equal(y, _expected(rank, even))

    ins, outs = uneven(rank), [uneven(src)[rank] for src in range(world)]
    x = _input(rank, ins)
    y = torch.full((sum(outs), 3), -1.0)
    comm.all_to_all_single(y, x, output_split_sizes=outs, input_split_sizes=ins, group=group)
    out[f"{tag}uneven"] = torch.equal(y, _expected(rank, uneven))

    x = _input(rank, even(rank))
    y = torch.full_like(x, -1.0)
    work = comm.all_to_all_single(y, x, group=group, async_op=True)
    work.wait()
    out[f"{tag}async"] = torch.equal(y, _expected(rank, even))

    # the list form, with tensors of different shapes per destination
    inputs = [torch.full((dst + 1, 2), float(10 * rank + dst)) for dst in range(world)]
    outputs = [torch.empty(rank + 1, 2) for _ in range(world)]
    comm.all_to_all(outputs, inputs, group=group)
    out[f"{tag}list"] = all(torch.equal(o, torch.full((rank + 1, 2), float(10 * src + rank)))
                            for src, o in enumerate(outputs))
    # one shape for all (what gloo's own all-to-all takes)
    outputs = [torch.empty(2) for _ in range(world)]
    comm.all_to_all(outputs, [torch.full((2,), float(10 * rank + dst)) for dst in range(world)], group=group)
    out[f"{tag}list_equal"] = all(torch.equal(o, torch.full((2,), float(10 * src + rank)))
                                  for src, o in enumerate(outputs))


def _p2p_run():
    comm.init_distributed(verbose=False)
    rank, world = comm.get_rank(), comm.get_world_size()
    recorder = _Recorder()
    comm.events.register(recorder)
    out = {}
    pair = comm.new_group([1, 2])  # every rank creates it; group rank r is global rank r + 1

    # ---- torch's all-to-all (gloo has it in this torch), then the isend/irecv fallback
    _a2a_checks(rank, world, None, out, "native_")
    out["native_calls"] = list(recorder.calls)
    recorder.calls.clear()
    comm._NO_NATIVE_ALL_TO_ALL.add("gloo")
    try:
        _a2a_checks(rank, world, None, out, "p2p_")
        if rank in (1, 2):
            _a2a_checks(rank - 1, 2, pair, out, "pair_")
        # a non-contiguous output (a transposed view) is received through a copy
        x = _input(rank, [2] * world)
        y = torch.full((3, 2 * world), -1.0).t()
        comm.all_to_all_single(y, x)
        out["p2p_noncontiguous"] = torch.equal(y, _expected(rank, lambda src: [2] * world))
    finally:
        comm._NO_NATIVE_ALL_TO_ALL.discard("gloo")
    out["p2p_calls"] = list(recorder.calls)
    recorder.calls.clear()

    # ---- send / recv: a ring of isend/irecv, then a blocking round trip 0 -> 1 -> 0
    ring_in = torch.empty(4)
    recv_work = comm.irecv(ring_in, src=(rank - 1) % world)
    send_work = comm.isend(torch.full((4,), float(rank)), dst=(rank + 1) % world)
    send_work.wait()
    recv_work.wait()
    out["ring"] = torch.equal(ring_in, torch.full((4,), float((rank - 1) % world)))
    if rank == 0:
        comm.send(torch.arange(5.0), dst=1, tag=7)
        back = torch.empty(5)
        out["sender"] = comm.recv(back, src=None, tag=8)  # any source: returns who sent it
        out["round_trip"] = torch.equal(back, torch.arange(5.0) * 2)
    elif rank == 1:
        got = torch.empty(5)
        out["sender"] = comm.recv(got, src=0, tag=7)
        comm.send(got * 2, dst=0, tag=8)
    out["p2p_op_calls"] = list(recorder.calls)
    comm.events.unregister(recorder)
    comm.barrier()
    return out


@pytest.fixture(scope="module")
def p2p():
    return run_distributed(_p2p_run, WORLD)


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", ["even", "uneven", "async", "list", "list_equal"])
@pytest.mark.parametrize("path", ["native_", "p2p_"])
def test_all_to_all_matches_the_reference(p2p, path, check):
    assert [out[path + check] for out in p2p] == [True] * WORLD


@pytest.mark.multiprocess
def test_all_to_all_in_a_subgroup_and_into_a_noncontiguous_output(p2p):
    for rank, out in enumerate(p2p):
        assert out["p2p_noncontiguous"]
        for check in ("even", "uneven", "async", "list", "list_equal"):
            assert out.get("pair_" + check, rank == 0) is True, (rank, check)


@pytest.mark.multiprocess
def test_listener_sees_op_input_bytes_and_async(p2p):
    for rank, out in enumerate(p2p):
        uneven_bytes = sum(((rank + dst) % 3 + (dst == 0)) * 3 * 4 for dst in range(WORLD))
        list_bytes = sum((dst + 1) * 2 * 4 for dst in range(WORLD))
        want = [("all_to_all_single", 72, 3, False), ("all_to_all_single", uneven_bytes, 3, False),
                ("all_to_all_single", 72, 3, True), ("all_to_all", list_bytes, 3, False), ("all_to_all", 24, 3, False)]
        assert out["native_calls"] == want
        p2p_want = list(want)
        if rank in (1, 2):
            pr = rank - 1
            p2p_want += [("all_to_all_single", 48, 2, False),
                         ("all_to_all_single", sum(((pr + d) % 3 + (d == 0)) * 12 for d in range(2)), 2, False),
                         ("all_to_all_single", 48, 2, True), ("all_to_all", 2 * 4 + 4 * 4, 2, False),
                         ("all_to_all", 16, 2, False)]
        p2p_want.append(("all_to_all_single", 72, 3, False))
        assert out["p2p_calls"] == p2p_want


@pytest.mark.multiprocess
def test_send_recv_round_trip_and_ring(p2p):
    assert all(out["ring"] for out in p2p)
    assert p2p[0]["round_trip"] and p2p[0]["sender"] == 1 and p2p[1]["sender"] == 0
    ring = [("recv", 16, 3, True), ("send", 16, 3, True)]
    assert sorted(p2p[2]["p2p_op_calls"]) == sorted(ring)
    assert p2p[0]["p2p_op_calls"] == [("send", 16, 3, True), ("recv", 16, 3, True), ("send", 20, 3, False),
                                      ("recv", 20, 3, False)]
    assert p2p[1]["p2p_op_calls"] == [("send", 16, 3, True), ("recv", 16, 3, True), ("recv", 20, 3, False),
                                      ("send", 20, 3, False)]


# ------------------------------------------------------------------------------ single process
def test_world_of_one_copies_and_validates_splits():
    x = torch.arange(6.0).reshape(3, 2)
    y = torch.zeros(3, 2)
    comm.all_to_all_single(y, x)
    assert torch.equal(y, x)
    outs = [torch.zeros(2)]
    comm.all_to_all(outs, [torch.ones(2)])
    assert torch.equal(outs[0], torch.ones(2))
    with pytest.raises(ValueError, match="input_split_sizes \\[2\\] must be 1 non-negative sizes summing to the 3"):
        comm.all_to_all_single(y, x, input_split_sizes=[2])
    with pytest.raises(ValueError, match="expected 1 output and input tensors"):
        comm.all_to_all([], [x])


def test_fallback_only_when_the_backend_refuses(monkeypatch):
    monkeypatch.setattr(comm, "_NO_NATIVE_ALL_TO_ALL", set())
    calls = []

    def refuses():
        calls.append("native")
        raise RuntimeError("ProcessGroupGloo does not support alltoall")

    def p2p():
        calls.append("p2p")
        return "fallback"

    assert comm._native_or_p2p(refuses, p2p, None) == "fallback"
    assert comm._native_or_p2p(refuses, p2p, None) == "fallback"  # remembered: native not tried again
    assert calls == ["native", "p2p", "p2p"]

    def fails():
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(comm, "_NO_NATIVE_ALL_TO_ALL", set())
    with pytest.raises(RuntimeError, match="Connection closed"):  # a real failure is not a fallback
        comm._native_or_p2p(fails, p2p, None)


def test_comms_logger_knows_the_new_ops():
    assert bus_factor("all_to_all_single", 4) == bus_factor("all_to_all", 4) == 3 / 4
    assert bus_factor("send", 4) == bus_factor("recv", 4) == 1.0
    assert {DEEPSPEED_OPS[n] for n in ("send", "isend", "recv", "irecv", "all_to_all_single", "all_to_all")} == \
        {"send", "recv", "all_to_all_single", "all_to_all"}


# --------------------------------------------------------------------------- gloo reduce-scatter (ring)
def _reduce_scatter_run():
    comm.init_distributed()
    world, rank = comm.get_world_size(), comm.get_rank()
    seen = []

    class Seen:
        @hookimpl
        def dsplug_comm_op(self, op, nbytes):
            seen.append((op, nbytes))

    watcher = Seen()
    comm.events.register(watcher)
    out = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            full = (torch.randn(world * 5, generator=g) * 4).round().to(dtype)  # integers: exact in any order
            mine = torch.empty(5, dtype=dtype)
            sent = full.clone()
            comm.reduce_scatter_tensor(mine, sent)
            out[str(dtype)] = mine
            out[f"{dtype} input kept"] = torch.equal(sent, full)  # partial sums never land in the input
            in_place = full.clone()  # output a slice of the input (reduce_scatter_fn's in-place use)
            comm.reduce_scatter_tensor(in_place.chunk(world)[rank], in_place)
            out[f"{dtype} in place"] = in_place.chunk(world)[rank].clone()
        # two in flight at once (async_op: the first ring step left running at an even world), waited
        # oldest first: each equals the synchronous sum, and neither input was written
        full = (torch.randn(world * 5, generator=torch.Generator().manual_seed(rank)) * 4).round()
        inputs = (full.clone(), full * 2)
        outputs = (torch.empty(5), torch.empty(5))
        works = [comm.reduce_scatter_tensor(o, i, async_op=True) for o, i in zip(outputs, inputs)]
        out["async pending"] = [not w.is_completed() for w in works]
        for work in works:
            work.wait()
        out["async"] = outputs
        out["async input kept"] = torch.equal(inputs[0], full) and torch.equal(inputs[1], full * 2)
        peak = torch.full((world * 2,), float(rank))
        top = torch.empty(2)
        comm.reduce_scatter_tensor(top, peak, op=comm.ReduceOp.MAX)  # not a sum: all-reduce fallback
        out["max"] = top
    finally:
        comm.events.unregister(watcher)
    return rank, world, out, seen


@pytest.mark.parametrize("world", [2, 3, 4])  # no scratch; scratch first; scratch second
def test_gloo_reduce_scatter_is_a_ring_of_p2p_sums(world):
    # (world 1, a copy: tests/plugins/zero/test_zero3_dist.py's single-rank resume goes through it)
    for rank, size, out, seen in run_distributed(_reduce_scatter_run, world):
        for dtype in (torch.float32, torch.bfloat16):
            total = sum((torch.randn(size * 5, generator=torch.Generator().manual_seed(r)) * 4).round().to(dtype)
                        for r in range(size))
            assert torch.equal(out[str(dtype)], total[rank * 5:(rank + 1) * 5])
            assert out[f"{dtype} input kept"]
            assert torch.equal(out[f"{dtype} in place"], total[rank * 5:(rank + 1) * 5])
        total = sum((torch.randn(size * 5, generator=torch.Generator().manual_seed(r)) * 4).round()
                    for r in range(size))[rank * 5:(rank + 1) * 5]
        assert torch.equal(out["async"][0], total) and torch.equal(out["async"][1], total * 2)
        assert out["async input kept"]
        if size % 2:  # an odd world's ring finishes before returning
            assert out["async pending"] == [False, False]
        assert torch.equal(out["max"], torch.full((2,), float(size - 1)))
        # the listener sees one reduce-scatter of the input per call (not its point-to-point steps)
        assert seen == [("reduce_scatter", size * 5 * 4)] * 2 + [("reduce_scatter", size * 5 * 2)] * 2 + \
            [("reduce_scatter", size * 5 * 4)] * 2 + [("all_reduce", size * 2 * 4)]
