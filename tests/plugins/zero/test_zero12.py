"""ZeRO stages 1 and 2: same training as stage 0 / plain PyTorch, and every knob's documented effect.

Distributed runs are expensive here (spawn + torch import per process), so each 2-process run
(module-scoped fixture) trains many configurations and records what the checks need; the tests
then assert on those records.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

import dsplug
from dsplug.config import ConfigError
from dsplug.plugins.zero.memory import model_state_bytes

from tests.dist_harness import run_distributed
from tests.engine_common import IN, assert_close_runs, dsplug_run, make_model, reference_run


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


#: gradient_allreduce_op "sum" at 2 ranks with these knobs: the gradient is 2x the mean, so SGD at lr
#: steps as plain PyTorch at 2 * lr on the global batch's mean loss
SUM_RUNS = [(0, {}, {}), (1, {}, {}), (2, {}, {}), (2, {}, {"prescale_gradients": True}),
            (1, {}, {"gradient_predivide_factor": 4.0}), (2, {"overlap_comm": True, "reduce_bucket_size": 100}, {})]
SUM_LR = 0.05


CASES = {
    # name: (config extras, reference_run kwargs)
    "fp32": ({}, {}),
    "fp32-accum-clip": ({"gradient_accumulation_steps": 2, "gradient_clipping": 0.3}, {"gas": 2, "clip": 0.3}),
    "bf16": ({"bf16": {"enabled": True}}, {"precision": "bf16"}),
    "bf16-accum-clip": ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3},
                        {"precision": "bf16", "gas": 2, "clip": 0.3}),
    "fp16": ({"fp16": {"enabled": True, "initial_scale_power": 6}}, {"precision": "fp16", "scale": 64.0}),
}
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "fp16": dict(rtol=2e-3, atol=2e-3),
             "bf16": dict(rtol=2e-2, atol=2e-2)}
STEPS, MICRO = 4, 4


def _config(name, stage, **zero):
    extra, _ = CASES[name]
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, **zero}, **extra}


def _reference(name, world):
    _, ref = CASES[name]
    return reference_run(STEPS, world, MICRO, ref.get("gas", 1), adamw, clip=ref.get("clip", 0.0),
                         precision=ref.get("precision", "fp32"), scale=ref.get("scale", 1.0))


def _tol(name):
    return TOLERANCE[name.split("-")[0]]


# =========================================================================== one process
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_single_process_equals_reference(stage, name):
    got = dsplug_run(_config(name, stage), STEPS, optimizer=adamw)
    assert_close_runs(got, _reference(name, 1), **_tol(name))


# =========================================================================== two processes
def _inject_overflow(engine, step):
    """Make steps 1 and 2 overflow; at stages 1/2 only rank 0's gradient partition gets the inf,
    so skipping on every rank shows the overflow check is global."""
    from dsplug import comm

    if step not in (1, 2):
        return
    if engine.zero_optimization_stage() == 0:
        next(engine.module.parameters()).grad.fill_(float("inf"))
    elif comm.get_rank() == 0:
        engine.stage.partition_grads[0].fill_(float("inf"))


FP16_OVERFLOW = {"fp16": {"enabled": True, "initial_scale_power": 6, "hysteresis": 2, "loss_scale_window": 1000}}


def _equivalence_runs():
    out = {}
    for stage in (0, 1, 2):
        for name in CASES:
            out[(stage, name)] = dsplug_run(_config(name, stage), STEPS, optimizer=adamw)
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
                  "zero_optimization": {"stage": stage}, **FP16_OVERFLOW}
        out[(stage, "fp16-overflow")] = dsplug_run(config, STEPS, optimizer=adamw, inject=_inject_overflow)
    # the knobs that change only how (not what) is communicated, at both stages
    for stage, zero in [(1, {"reduce_scatter": False, "contiguous_gradients": False, "reduce_bucket_size": 100,
                             "round_robin_gradients": True, "allgather_bucket_size": 64}),
                        (1, {"grad_hooks": False, "overlap_comm": True, "reduce_bucket_size": 30}),
                        (2, {"overlap_comm": True, "reduce_bucket_size": 300, "allgather_partitions": False}),
                        (2, {"overlap_comm": True, "contiguous_gradients": False, "reduce_bucket_size": 50,
                             "round_robin_gradients": True}),
                        (2, {"prescale_gradients": True}), (2, {"gradient_predivide_factor": 4.0})]:
        kernel = {k: zero.pop(k) for k in ("prescale_gradients", "gradient_predivide_factor") if k in zero}
        config = {**_config("fp32-accum-clip", stage, **zero), **kernel}
        out[(stage, "knobs", repr(sorted({**zero, **kernel}.items())))] = dsplug_run(config, STEPS, optimizer=adamw)
    for stage, zero, kernel in SUM_RUNS:
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, "gradient_allreduce_op": "sum",
                  "zero_optimization": {"stage": stage, **zero}, **kernel}
        out[("sum", stage, repr(sorted({**zero, **kernel}.items())))] = dsplug_run(config, STEPS, optimizer=sgd(SUM_LR))
    return out


@pytest.fixture(scope="module")
def two_rank_runs():
    return run_distributed(_equivalence_runs, 2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_equal_stage0_and_reference(two_rank_runs, stage, name):
    want = _reference(name, 2)
    for rank_runs in two_rank_runs:
        got = rank_runs[(stage, name)]
        assert_close_runs(got, want, **_tol(name))
        assert_close_runs(got, rank_runs[(0, name)], **_tol(name))
    for a, b in zip(two_rank_runs[0][(stage, name)]["params"], two_rank_runs[1][(stage, name)]["params"]):
        assert torch.equal(a, b), "ranks diverged"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skips_the_step_on_every_rank_like_stage0(two_rank_runs, stage):
    for rank_runs in two_rank_runs:
        got, base = rank_runs[(stage, "fp16-overflow")], rank_runs[(0, "fp16-overflow")]
        assert got["skipped"] == base["skipped"] == 2
        assert got["scale"] == base["scale"] == 32.0  # 64 -> (hysteresis) 64 -> 32
        assert_close_runs(got, base, **TOLERANCE["fp16"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_communication_knobs_do_not_change_results(two_rank_runs):
    want = _reference("fp32-accum-clip", 2)
    keys = [k for k in two_rank_runs[0] if len(k) == 3 and k[1] == "knobs"]
    assert len(keys) == 6
    for key in keys:
        for rank_runs in two_rank_runs:
            assert_close_runs(rank_runs[key], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gradient_allreduce_op_sum_adds_the_ranks_gradients(two_rank_runs):
    """``gradient_allreduce_op: "sum"``: no division by the data-parallel size, at stages 0-2 and
    with every averaging knob; SGD on the summed gradient (2x the mean at 2 ranks) at lr equals
    plain PyTorch on the global batch at 2 * lr (and not at lr: the check can fail)."""
    want = reference_run(STEPS, 2, MICRO, 1, sgd(2 * SUM_LR))
    mean_step = reference_run(STEPS, 2, MICRO, 1, sgd(SUM_LR))
    keys = [k for k in two_rank_runs[0] if k[0] == "sum"]
    assert len(keys) == len(SUM_RUNS)
    for key in keys:
        for rank_runs in two_rank_runs:
            assert_close_runs(rank_runs[key], want, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(rank_runs[key]["params"][0], mean_step["params"][0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 3}}, "'sum' is not supported with ZeRO stage 3"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "'sum' is not supported with OneBitAdam"),
])
def test_gradient_allreduce_op_sum_is_refused_where_gradients_are_averaged(config, message):
    with pytest.raises(ConfigError, match=message) as error:
        dsplug.config.DsplugConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", **config})
    assert "gradient_allreduce_op" in str(error.value)


def test_gradient_allreduce_op_is_mean_or_sum_in_any_case():
    from dsplug.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({"train_batch_size": 1}).gradient_allreduce_op == "mean"
    assert DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    with pytest.raises(ConfigError, match="gradient_allreduce_op: 'max' is not valid: must be one of 'mean', 'sum'"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "max"})


# =========================================================================== knobs, counted
IN_K, LAYERS = 16, 4  # 4 bias-free 16x16 layers: 1024 elements, 512 per rank at N=2


def knob_model():
    g = torch.Generator().manual_seed(3)
    layers = []
    for i in range(LAYERS):
        layers += [torch.nn.Linear(IN_K, IN_K, bias=False)] + ([torch.nn.Tanh()] if i < LAYERS - 1 else [])
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


class EventLog:
    """Collectives (via the ``dsplug_comm_op`` hook) and gradient-hook events, on one clock."""

    def __init__(self):
        self.events = []

    @dsplug.hookimpl
    def dsplug_comm_op(self, op, nbytes, latency_s):
        now = time.perf_counter()
        self.events.append(("comm", op, nbytes, now - latency_s, now, None))

    def mark(self, kind, info=None):
        self.events.append((kind, info, time.perf_counter()))


def _knob_run(zero, gas=1, steps=2, precision=None, kernel=None):
    """Train the knob model; return the event log, reduce destinations, memory snapshots and params."""
    from dsplug import comm

    log = EventLog()
    destinations = []
    original_reduce = comm.reduce

    def reduce(tensor, dst, *args, **kwargs):
        destinations.append(dst)
        return original_reduce(tensor, dst, *args, **kwargs)

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
              "zero_optimization": zero, **(kernel or {})}
    if precision:
        config[precision] = {"enabled": True}
    engine = dsplug.initialize(model=knob_model(), optimizer=adamw, config=config)[0]
    names = {p: n for n, p in engine.module.named_parameters()}
    for p in engine.module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: log.mark("grad", (names[p], p.grad is None)))
    memory = []
    comm.events.register(log)
    comm.reduce = reduce
    try:
        for step in range(steps):
            for m in range(gas):
                g = torch.Generator().manual_seed(100 * step + 10 * m + comm.get_rank())
                x = torch.randn(4, IN_K, generator=g).to(engine.precision.model_dtype)
                log.mark("backward_begin", (step, m))
                engine.backward(engine(x).float().pow(2).mean())
                log.mark("backward_end", (step, m))
                memory.append(engine.model_state_memory())
                engine.step()
                log.mark("step_end", (step, m))
            memory.append(engine.model_state_memory())
    finally:
        comm.events.unregister(log)
        comm.reduce = original_reduce
    state = engine.stage.state_dict()
    return {"events": log.events, "dst": destinations, "memory": memory,
            "optimizer_tensor_bytes": _optimizer_bytes(engine), "param_storage_bytes": _param_storage_bytes(engine),
            "names": state["groups"][0]["names"], "params": [p.detach().float().clone() for p in engine.module.parameters()]}


def _optimizer_bytes(engine):
    """Independent count: the optimizer's own tensors (its params unless they alias the module's)."""
    module_storages = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    total = 0
    for group in engine.optimizer.param_groups:
        for t in group["params"]:
            if t.untyped_storage().data_ptr() not in module_storages:
                total += t.numel() * t.element_size()
            total += sum(v.numel() * v.element_size() for v in engine.optimizer.state[t].values()
                         if isinstance(v, torch.Tensor))
    return total


def _param_storage_bytes(engine):
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in engine.module.parameters()}
    return sum(storages.values())


KNOB_RUNS = {
    "s2-allreduce-b600-ag300": dict(zero={"stage": 2, "reduce_scatter": False, "reduce_bucket_size": 600,
                                          "allgather_bucket_size": 300}),
    "s2-reduce-b800": dict(zero={"stage": 2, "reduce_bucket_size": 800}),
    "s1-allreduce-b600-comm-bf16": dict(zero={"stage": 1, "reduce_scatter": False, "reduce_bucket_size": 600},
                                        kernel={"communication_data_type": "bf16"}),
    "s2-rr-b256": dict(zero={"stage": 2, "reduce_bucket_size": 256, "round_robin_gradients": True}),
    "s2-b256": dict(zero={"stage": 2, "reduce_bucket_size": 256}),
    "s2-broadcast": dict(zero={"stage": 2, "allgather_bucket_size": 300}, kernel={"disable_allgather": True}),
    "s1-no-allgather-partitions": dict(zero={"stage": 1, "allgather_partitions": False}),
    "s2-overlap": dict(zero={"stage": 2, "overlap_comm": True, "reduce_bucket_size": 256}),
    "s2-no-contiguous": dict(zero={"stage": 2, "contiguous_gradients": False, "reduce_scatter": False,
                                   "reduce_bucket_size": 600}),
    "s1-hooks-gas2": dict(zero={"stage": 1, "reduce_bucket_size": 256}, gas=2),
    "s1-no-hooks-gas2": dict(zero={"stage": 1, "reduce_bucket_size": 256, "grad_hooks": False}, gas=2),
    "s2-gas2": dict(zero={"stage": 2, "reduce_bucket_size": 256}, gas=2),
    # bf16 gradients (the formula's 2-byte gradients); by default bf16 accumulates them in fp32
    "s1-bf16-gas2": dict(zero={"stage": 1}, gas=2, precision="bf16", kernel={"data_types": {"grad_accum_dtype": "bf16"}}),
    "s2-bf16-gas2": dict(zero={"stage": 2}, gas=2, precision="bf16", kernel={"data_types": {"grad_accum_dtype": "bf16"}}),
    "s2-bf16-overlap-gas2": dict(zero={"stage": 2, "overlap_comm": True, "reduce_bucket_size": 300}, gas=2,
                                 precision="bf16", kernel={"data_types": {"grad_accum_dtype": "fp32"}}),
}


def _all_knob_runs():
    return {name: _knob_run(**spec) for name, spec in KNOB_RUNS.items()}


@pytest.fixture(scope="module")
def knob_runs():
    return run_distributed(_all_knob_runs, 2)


def _comms(run, op=None, within="backward", micro=None):
    """Collectives started inside a window of the event log: "backward" or "step"."""
    events = run["events"]
    out, inside, index = [], False, -1
    for e in events:
        if e[0] == "backward_begin":
            inside, index = within == "backward", index + 1
        elif e[0] == "backward_end":
            inside = within == "step"
        elif e[0] == "step_end":
            inside = False
        elif e[0] == "comm" and inside and (op is None or e[1] == op) and (micro is None or index == micro):
            out.append(e)
    return out


def _backward_gradient_buckets(bucket_elements):
    """Expected buckets: greedy over the layers in backward order (an independent re-statement)."""
    sizes = [IN_K * IN_K] * LAYERS
    buckets, current = [], []
    for index in reversed(range(LAYERS)):
        if current and (len(current) + 1) * sizes[index] > bucket_elements:
            buckets.append(current)
            current = []
        current.append(index)
    buckets.append(current)
    return buckets


def _owner_elements(layers, world=2):
    """{owner: elements} of a bucket of layers under the contiguous layout (layer i at i*256)."""
    per_rank = LAYERS * IN_K * IN_K // world
    owned = {}
    for i in layers:
        for e in range(i * IN_K * IN_K, (i + 1) * IN_K * IN_K):
            owned[e // per_rank] = owned.get(e // per_rank, 0) + 1
    return owned


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reduce_bucket_size_and_all_reduce(knob_runs):
    run = knob_runs[0]["s2-allreduce-b600-ag300"]
    expected = [len(b) * IN_K * IN_K * 4 for b in _backward_gradient_buckets(600)]
    assert expected == [512 * 4, 512 * 4]
    for micro in range(2):
        ops = _comms(run, micro=micro)
        assert [e[1] for e in ops] == ["all_reduce"] * len(expected)
        assert [e[2] for e in ops] == expected
    # communication_data_type: the same buckets, reduced in bf16 (half the bytes), same training
    bf16 = knob_runs[0]["s1-allreduce-b600-comm-bf16"]
    assert [e[2] for e in _comms(bf16, micro=0)] == [n // 2 for n in expected]
    for a, b in zip(bf16["params"], run["params"]):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reduce_scatter_reduces_each_owner_piece_to_its_owner(knob_runs):
    for rank, by_rank in enumerate(knob_runs):
        run = by_rank["s2-reduce-b800"]
        buckets = _backward_gradient_buckets(800)
        assert buckets == [[3, 2, 1], [0]]
        expected_sizes, expected_dst = [], []
        for b in buckets:
            for owner, n in sorted(_owner_elements(b).items()):
                expected_sizes.append(n * 4)
                expected_dst.append(owner)
        ops = _comms(run, micro=0)
        assert [e[1] for e in ops] == ["reduce"] * len(expected_sizes)
        assert [e[2] for e in ops] == expected_sizes == [256 * 4, 512 * 4, 256 * 4]
        assert run["dst"][:len(expected_dst)] == expected_dst == [0, 1, 0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_round_robin_gradients_alternates_owners_in_backward(knob_runs):
    plain, rr = knob_runs[0]["s2-b256"], knob_runs[0]["s2-rr-b256"]
    # one layer per bucket; backward visits layers 3, 2, 1, 0
    assert plain["dst"][:4] == [1, 1, 0, 0]
    assert rr["dst"][:4] == [1, 0, 1, 0]
    assert plain["names"] == ["0.weight", "2.weight", "4.weight", "6.weight"]
    assert rr["names"] == ["0.weight", "4.weight", "2.weight", "6.weight"]  # flattening order in the checkpoint
    for a, b in zip(plain["params"], rr["params"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_allgather_bucket_size_and_broadcast_variants(knob_runs):
    run = knob_runs[0]["s2-allreduce-b600-ag300"]
    partition = LAYERS * IN_K * IN_K // 2
    per_rank = 300 // 2
    chunks = [min(per_rank, partition - a) for a in range(0, partition, per_rank)]
    gathers = _comms(run, "all_gather", within="step")
    assert [e[2] for e in gathers] == [2 * c * 4 for c in chunks] * 2  # two steps
    broadcast = knob_runs[0]["s2-broadcast"]
    assert not _comms(broadcast, "all_gather", within="step")
    assert [e[2] for e in _comms(broadcast, "broadcast", within="step")] == [c * 4 for c in chunks for _ in (0, 1)] * 2
    no_partitions = knob_runs[0]["s1-no-allgather-partitions"]
    assert not _comms(no_partitions, "all_gather", within="step")
    assert [e[2] for e in _comms(no_partitions, "broadcast", within="step")] == [partition * 4] * 2 * 2
    for name in ("s2-broadcast", "s1-no-allgather-partitions"):
        for a, b in zip(knob_runs[0][name]["params"], knob_runs[1][name]["params"]):
            assert torch.equal(a, b)


def _grad_times(run, micro):
    events, index, times = run["events"], -1, []
    for e in events:
        if e[0] == "backward_begin":
            index += 1
        elif e[0] == "grad" and index == micro:
            times.append(e[2])
    return times


@pytest.mark.slow
@pytest.mark.multiprocess
def test_overlap_comm_keeps_reductions_in_flight_while_backward_continues(knob_runs):
    for name, overlapped in (("s2-overlap", True), ("s2-b256", False)):
        run = knob_runs[0][name]
        grads = _grad_times(run, 0)
        reductions = _comms(run, micro=0)
        assert len(reductions) == 4
        assert reductions[0][3] < grads[-1], "the first reduction starts while backward is still running"
        spans = [any(start < t < end for t in grads) for _, _, _, start, end, _ in reductions]
        if overlapped:
            assert any(spans), "with overlap_comm a reduction is in flight while later gradients are produced"
        else:
            assert not any(spans), "without overlap_comm each reduction completes before backward goes on"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_contiguous_gradients_releases_each_gradient_into_one_preallocated_buffer(knob_runs):
    # same buckets (two layers each), with and without contiguous_gradients
    contiguous, separate = knob_runs[0]["s2-allreduce-b600-ag300"], knob_runs[0]["s2-no-contiguous"]
    released = lambda run: [e[1][1] for e in run["events"] if e[0] == "grad"]  # noqa: E731
    # the test's hooks run right after the engine's: with contiguous_gradients the gradient has been
    # copied into the bucket buffer and released; without, the first gradient of each two-layer
    # bucket is kept until the bucket is complete
    assert released(contiguous) == [True] * 4 * 2  # 4 layers, 2 steps
    assert released(separate) == [False, True, False, True] * 2
    # one preallocated buffer of the largest bucket (512 fp32 elements), kept; none held otherwise
    assert {m["buffers"] for m in contiguous["memory"]} == {512 * 4}
    assert {m["buffers"] for m in separate["memory"]} == {0}
    assert {m["buffers"] for m in knob_runs[0]["s2-overlap"]["memory"]} == {2 * 256 * 4}  # double buffered
    assert [e[2] for e in _comms(separate, micro=0)] == [512 * 4, 512 * 4]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_stage1_reduces_once_per_step_stage2_every_micro_step(knob_runs):
    model_bytes = LAYERS * IN_K * IN_K * 4
    hooks, no_hooks, stage2 = (knob_runs[0][n] for n in ("s1-hooks-gas2", "s1-no-hooks-gas2", "s2-gas2"))
    for run in (hooks, no_hooks):
        assert _comms(run, micro=0) == []  # the first micro-step accumulates locally
        assert sum(e[2] for e in _comms(run, micro=1)) == model_bytes
    assert sum(e[2] for e in _comms(stage2, micro=0)) == sum(e[2] for e in _comms(stage2, micro=1)) == model_bytes
    # grad_hooks: reductions start from the hooks, during backward; without: after the last gradient
    assert _comms(hooks, micro=1)[0][3] < _grad_times(hooks, 1)[-1]
    assert all(e[3] > _grad_times(no_hooks, 1)[-1] for e in _comms(no_hooks, micro=1))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name,stage,half,fp32_grads", [
    ("s1-bf16-gas2", 1, True, False), ("s2-bf16-gas2", 2, True, False), ("s2-bf16-overlap-gas2", 2, True, True),
    ("s1-hooks-gas2", 1, False, True), ("s2-gas2", 2, False, True)])
def test_memory_per_rank_matches_the_zero_formula(knob_runs, name, stage, half, fp32_grads):
    psi, world = LAYERS * IN_K * IN_K, 2
    formula = dict(model_state_bytes(psi, world, stage, half_precision=half, optimizer_states=2)["device"])
    if fp32_grads:  # gradients accumulated in fp32 (data_types.grad_accum_dtype fp32): 4 bytes each
        formula["gradients"] = model_state_bytes(psi, world, stage, half_precision=False)["device"]["gradients"]
    width = 2 if half else 4
    for by_rank in knob_runs:
        run = by_rank[name]
        after_first_micro, after_step = run["memory"][0], run["memory"][2]
        # parameters: the whole model in its dtype (no padding: 1024 elements split evenly)
        assert after_first_micro["parameters"] == run["param_storage_bytes"] == formula["parameters"] == psi * width
        # gradients held between micro-steps: all of them at stage 1, this rank's partition at stage 2
        assert after_first_micro["gradients"] == formula["gradients"]
        # optimizer: (fp32 master +) exp_avg + exp_avg_sq of this rank's partition, plus AdamW's 4-byte step
        assert after_step["optimizer_states"] == run["optimizer_tensor_bytes"] == formula["optimizer_states"] + 4
        # after the step stage 1 holds no gradients; stage 2 keeps its (zeroed) partition for the next step
        assert after_step["gradients"] == (formula["gradients"] if stage == 2 else 0)
    stage0 = model_state_bytes(psi, world, 0, half_precision=half)["device"]["optimizer_states"]
    assert formula["optimizer_states"] * world == stage0


# =========================================================================== refusals and errors
def test_lamb_is_refused_with_the_reason():
    from dsplug.plugins.optimizers.lamb_optimizer import FusedLamb

    for stage in (1, 2):
        with pytest.raises(ValueError, match=r"trust ratio \|\|w\|\| / \|\|update\|\| is computed per parameter"):
            dsplug.initialize(model=make_model(), optimizer=lambda g: FusedLamb(g, lr=1e-3),
                              config={"train_batch_size": 4, "zero_optimization": {"stage": stage}})
    with pytest.raises(ValueError, match="ZeRO stage 1 cannot use the optimizer .*FusedLamb.*stage 0"):
        dsplug.initialize(model=make_model(), config={
            "train_batch_size": 4, "zero_optimization": {"stage": 1}, "optimizer": {"type": "Lamb"}})
    # stage 0 keeps whole parameters: fine
    dsplug.initialize(model=make_model(), optimizer=lambda g: FusedLamb(g, lr=1e-3), config={"train_batch_size": 4})


class _CustomSGD(torch.optim.SGD):
    pass


def test_unknown_optimizer_needs_zero_allow_untested_optimizer():
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match="not known to be element-wise.*zero_allow_untested_optimizer"):
        dsplug.initialize(model=make_model(), optimizer=lambda g: _CustomSGD(g, lr=0.1), config=config)
    engine = dsplug.initialize(model=make_model(), optimizer=lambda g: _CustomSGD(g, lr=0.1),
                               config={**config, "zero_allow_untested_optimizer": True})[0]
    assert engine.zero_optimization_stage() == 2


def test_unimplemented_keys_are_config_errors():
    from dsplug.config import DsplugConfig

    with pytest.raises(ConfigError, match=r"zero_optimization\.legacy_stage1: DeepSpeed's legacy stage 1"):
        DsplugConfig({"train_batch_size": 2, "zero_optimization": {"stage": 1, "legacy_stage1": True}}, world_size=1)
    with pytest.raises(ConfigError, match=r"offload_optimizer.device: 'nvme' needs ZeRO stage 3"):
        DsplugConfig({"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
                     world_size=1)


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("stage", [1, 2])
def test_ignore_unused_parameters(stage):
    x = torch.randn(4, 4)
    engine = dsplug.initialize(model=_WithUnused(), optimizer=adamw,
                               config={"train_batch_size": 4, "zero_optimization": {"stage": stage}})[0]
    before = engine.module.unused.weight.detach().clone()
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    # a zero gradient: AdamW only decays the weight
    torch.testing.assert_close(engine.module.unused.weight.detach(), before * (1 - 1e-2 * 0.01))
    strict = dsplug.initialize(model=_WithUnused(), optimizer=adamw, config={
        "train_batch_size": 4, "zero_optimization": {"stage": stage, "ignore_unused_parameters": False}})[0]
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) received no gradient.*unused\.weight, unused\.bias"):
        strict.backward(strict(x).pow(2).mean())


def test_stage0_reports_its_memory():
    model = make_model()
    engine = dsplug.initialize(model=model, optimizer=adamw, config={"train_batch_size": 4})[0]
    assert engine.model_state_memory()["parameters"] == sum(4 * p.numel() for p in model.parameters())


def test_param_groups_keep_their_hyperparameters():
    model = make_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    got = dsplug.initialize(model=model, model_parameters=groups, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2),
                            config={"train_batch_size": 4, "zero_optimization": {"stage": 2}})[0]
    ref = make_model()
    ref_groups = [{"params": [p for n, p in ref.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
                  {"params": [p for n, p in ref.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(ref_groups, lr=1e-2)
    assert [g["weight_decay"] for g in got.optimizer.param_groups] == [0.1, 0.0]
    for step in range(3):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step))
        got.backward(got(x).pow(2).mean())
        got.step()
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(got.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert math.isfinite(got.get_global_grad_norm())


def test_partition_stepped_in_chunks_equals_reference_and_round_trips(monkeypatch, tmp_path):
    """The optimizer sees a partition as views of at most OPTIMIZER_CHUNK elements (here 100 of 988)."""
    from dsplug.plugins.zero.stage12 import stage as partitioned

    monkeypatch.setattr(partitioned, "OPTIMIZER_CHUNK", 100)
    config = _config("bf16-accum-clip", 2)
    got = dsplug_run(config, STEPS, optimizer=adamw)
    assert_close_runs(got, _reference("bf16-accum-clip", 1), **TOLERANCE["bf16"])
    engine = dsplug.initialize(model=make_model(), optimizer=adamw, config=config)[0]
    assert [p.numel() for p in engine.optimizer.param_groups[0]["params"]] == [100] * 9 + [88]
    for _ in range(2):
        engine.backward(engine(torch.randn(8, 12).bfloat16()).float().pow(2).mean())
        engine.step()
    saved = engine.stage.state_dict()["groups"][0]
    assert saved["state"]["exp_avg"].shape == (988,) and float(saved["state"]["step"]) == 1.0
    engine.save_checkpoint(tmp_path)
    monkeypatch.setattr(partitioned, "OPTIMIZER_CHUNK", 2 ** 22)  # reload unchunked
    fresh = dsplug.initialize(model=make_model(seed=2), optimizer=adamw, config=config)[0]
    fresh.load_checkpoint(tmp_path)
    (whole,) = fresh.optimizer.param_groups[0]["params"]
    assert torch.equal(fresh.optimizer.state[whole]["exp_avg_sq"], saved["state"]["exp_avg_sq"])
    assert torch.equal(whole, saved["fp32"])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_breakdown_counts_what_one_rank_holds(stage):
    """fp32 AdamW on one rank, measured after backward: 4 B per parameter each for the weights
    and the gradients, 8 B of optimizer state (exp_avg, exp_avg_sq) after a first step -- the
    formula of docs/zero-stages.md at world size 1 (nothing to partition)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = dsplug.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).sum())
        memory = engine.stage.memory_breakdown()
        engine.step()
    assert memory["parameters"] == 4 * numel and memory["gradients"] == 4 * numel
    assert 8 * numel <= memory["optimizer_states"] <= 8 * numel + 64  # + per-tensor step counters
    assert memory["total"] == memory["parameters"] + memory["gradients"] + memory["optimizer_states"]


# =========================================================================== stage 0's bucket views
def _stage0_bucket_view_run():
    dsplug.init_distributed()
    rank = dsplug.comm.get_rank()
    torch.manual_seed(0)
    model, plain = make_model(), make_model()
    engine = dsplug.initialize(model=model, optimizer=adamw, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 100}})[0]

    def batch(window, r, m):
        return torch.randn(4, IN, generator=torch.Generator().manual_seed(100 * window + 10 * r + m))

    windows = []
    for window in range(3):
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        for r in range(2):  # both ranks' micro-batches: the global mean the engine's gradients must equal
            for m in range(2):
                (plain(batch(window, r, m)).pow(2).mean() / 4).backward()
        for m in range(2):  # (DeepSpeed's loop: engine.step() after every micro-batch)
            engine.backward(engine(batch(window, rank, m)).pow(2).mean())
            if m == 1:  # the boundary: reduced, before the step drops the gradients
                (buckets,) = engine.stage.buckets.sets
                windows.append({
                    "sizes": [len(b) for b in buckets.buckets],
                    "kept": [buf is not None for buf in buckets.buffers],
                    "views": all(p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                                 for b, buf in zip(buckets.buckets, buckets.buffers) if buf is not None for p in b),
                    "grads": [p.grad.clone() for p in model.parameters()],
                    "want": [p.grad.clone() for p in plain.parameters()]})
            engine.step()
    return windows


@pytest.mark.multiprocess
def test_stage0_gradients_become_views_of_the_reduced_buckets():
    """After the reduction each fp32 gradient is its piece of the bucket buffer (no copy back; a
    bucket of one gradient reduces it in place, keeping no buffer), and with accumulation over 2
    micro-steps and three windows it is still the global mean gradient: the next window
    accumulates into fresh gradients and the bucket is only rewritten at its end."""
    for windows in run_distributed(_stage0_bucket_view_run, 2):
        for w in windows:
            # buckets of 100 elements over (3, 72, 24 | 576 | 24 | 288): one of three gradients, whose
            # gradients are views of its buffer, and three of one, reduced where they are (no buffer)
            assert w["sizes"] == [3, 1, 1, 1]
            assert w["kept"] == [True, False, False, False] and w["views"]
            for got, want in zip(w["grads"], w["want"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
