"""ZeRO stage 3 in one process: training equals plain PyTorch, each stage-3 knob changes what is
gathered and released the way its documentation says, zero.Init / GatheredParameters / external
parameters, and the partitioned checkpoint format helpers.

Gathers and reductions are counted through the comm layer (a ``dsplug_comm_op`` hook on ``dsplug.comm.events``); one
process still runs every collective (a world of one), so fetch / release behaviour is the same
as with more ranks. Multi-process runs are in test_zero3_dist.py.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch

import dsplug
from dsplug import comm
from dsplug import hookimpl
from dsplug.zero import GatheredParameters, ZeroParamStatus

from tests.engine_common import HIDDEN, IN, OUT, batch, loss_fn, reference_run

GLOBAL_BATCH = 8  # samples per micro-step over all ranks (two reference ranks of 4)


# --------------------------------------------------------------------------- shared helpers
class SeededMLP(torch.nn.Sequential):
    """engine_common.make_model's network and values, initialised the zero.Init way."""

    def __init__(self, seed: int = 0):
        super().__init__(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                         torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
        g = torch.Generator().manual_seed(seed)
        with GatheredParameters(list(self.parameters()), modifier_rank=0), torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def config(world: int = 1, gas: int = 1, clip: float = 0.0, precision=None, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": gas,
           "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    if clip:
        cfg["gradient_clipping"] = clip
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 6}
    elif precision:
        cfg[precision] = {"enabled": True}
    return cfg


def local_batch(step: int, micro: int, rank: int, world: int):
    """This rank's share of the global batch that reference_run(world=2, micro=4) trains on."""
    xs, ys = zip(*(batch(step, micro, r, GLOBAL_BATCH // 2) for r in range(2)))
    x, y = torch.cat(xs), torch.cat(ys)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def train(engine, steps: int, start: int = 0):
    """Train ``steps`` optimizer steps; per-step losses averaged over ranks."""
    rank, world, gas = comm.get_rank(), comm.get_world_size(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for m in range(gas):
            x, y = local_batch(step, m, rank, world)
            loss = loss_fn(engine(x.to(engine.precision.model_dtype)), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        t = torch.tensor([total / gas])
        comm.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def gathered(model):
    params = list(model.parameters())
    with GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def build(cfg, model=None, optimizer=adamw):
    engine, *_ = dsplug.initialize(model=model if model is not None else SeededMLP(), optimizer=optimizer,
                                   config=cfg)
    return engine


class Collectives:
    """Counts collectives by kind through the comm layer (a window opened with ``with``)."""

    def __init__(self):
        self.ops = []

    @hookimpl
    def dsplug_comm_op(self, op, nbytes):
        self.ops.append((op, nbytes))

    def count(self, op):
        return sum(1 for o, _ in self.ops if o == op)

    def __enter__(self):
        self.ops = []
        comm.events.register(self)
        return self

    def __exit__(self, *exc):
        comm.events.unregister(self)
        return False


def forward_backward(engine, step=0):
    """One micro-step, split so that the test can look between the phases."""
    x, y = local_batch(step, 0, 0, 1)
    loss = loss_fn(engine(x), y)
    return loss


def status(p):
    return p.ds_status


TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=2e-2, atol=2e-2),
             "fp16": dict(rtol=2e-3, atol=2e-3)}


# --------------------------------------------------------------------------- training equals reference
@pytest.mark.parametrize("precision,gas,clip", [("fp32", 2, 0.3), ("bf16", 2, 0.3), ("fp16", 1, 0.0)])
def test_single_process_equals_plain_pytorch(precision, gas, clip):
    engine = build(config(gas=gas, clip=clip, precision=None if precision == "fp32" else precision))
    losses = train(engine, 4)
    want = reference_run(4, 2, 4, gas, adamw, clip=clip, precision=precision,
                         scale=64.0 if precision == "fp16" else 1.0)
    tol = TOLERANCE[precision]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), **tol)
    for got, ref in zip(gathered(engine.module), want["params"]):
        torch.testing.assert_close(got, ref, **tol)
    # outside forward / backward every parameter is released again
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in engine.module.parameters())


def test_no_grad_forward_gathers_and_releases_and_matches_plain_module():
    engine = build(config())
    plain = SeededMLP()
    x, _ = local_batch(0, 0, 0, 1)
    with torch.no_grad():
        out = engine(x)
    torch.testing.assert_close(out, plain(x))
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())


def test_empty_partition_cache_frees_what_a_forward_left_gathered_and_training_goes_on_alike():
    """DeepSpeed's ``engine.empty_partition_cache()``: a forward without its backward (an
    evaluation with autograd on) leaves the parameters gathered for the backward; the call frees
    them, and the next steps train as without it."""
    kept, emptied = build(config()), build(config())
    x, _ = local_batch(0, 0, 0, 1)
    for engine in (kept, emptied):
        train(engine, 1)  # (the recorded trace keeps what the backward reuses soon)
        engine(x)  # no backward follows
    assert any(p.ds_status is ZeroParamStatus.AVAILABLE for p in emptied.module.parameters())
    assert emptied.stage.memory_breakdown()["gathered_parameters"] > 0
    emptied.empty_partition_cache()
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in emptied.module.parameters())
    assert emptied.stage.memory_breakdown()["gathered_parameters"] == 0
    assert train(emptied, 3, start=1) == train(kept, 3, start=1)
    for a, b in zip(gathered(emptied.module), gathered(kept.module)):
        assert torch.equal(a, b)


def test_empty_partition_cache_releases_persistent_parameters_until_the_next_forward():
    """As DeepSpeed's: after the call no parameter holds its full value, the persistent ones
    included (its TestZeroPartitionCache); the next forward gathers those again, once, and
    training goes on exactly as without the call."""
    knobs = dict(stage3_param_persistence_threshold=10 ** 6, stage3_prefetch_bucket_size=0)
    kept, emptied = build(config(**knobs)), build(config(**knobs))
    train(kept, 1)
    train(emptied, 1)
    emptied.empty_partition_cache()
    assert all(p.ds_persist and p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0
               for p in emptied.module.parameters())
    with Collectives() as fb:
        emptied.backward(forward_backward(emptied))
    assert fb.count("all_gather") == 1
    emptied.step()
    kept.backward(forward_backward(kept))
    kept.step()
    assert train(emptied, 2, start=2) == train(kept, 2, start=2)
    for a, b in zip(gathered(emptied.module), gathered(kept.module)):
        assert torch.equal(a, b)


def test_persistent_parameters_released_by_empty_partition_cache_are_whole_after_a_step_or_a_load(tmp_path):
    """DeepSpeed's checkpoint tests empty the cache, save, build a second engine, empty its cache,
    load, and read the persistent parameters directly: a step or a load gathers them again."""
    knobs = dict(stage3_param_persistence_threshold=10 ** 6)
    trained = build(config(**knobs))
    trained.empty_partition_cache()
    train(trained, 2)  # the forward gathers them, the step keeps them whole
    assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in trained.module.parameters())
    trained.empty_partition_cache()
    trained.save_checkpoint(str(tmp_path), tag="t")
    loaded = build(config(**knobs))
    loaded.empty_partition_cache()
    loaded.load_checkpoint(str(tmp_path), tag="t")
    assert all(p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE for p in loaded.module.parameters())
    for a, b in zip(loaded.module.parameters(), gathered(trained.module)):
        assert torch.equal(a.detach().float(), b)
    module_only = build(config(**knobs))
    module_only.empty_partition_cache()
    module_only.load_checkpoint(str(tmp_path), tag="t", load_module_only=True)
    for a, b in zip(module_only.module.parameters(), gathered(trained.module)):
        assert a.ds_status is ZeroParamStatus.AVAILABLE and torch.equal(a.detach().float(), b)


# --------------------------------------------------------------------------- knobs
def test_persistence_threshold_keeps_small_parameters_whole_and_never_gathers_them():
    engine = build(config(stage3_param_persistence_threshold=10 ** 6, stage3_prefetch_bucket_size=0))
    train(engine, 1)
    assert all(p.ds_persist and p.ds_status is ZeroParamStatus.AVAILABLE for p in engine.module.parameters())
    with Collectives() as fb:
        loss = forward_backward(engine)
        engine.backward(loss)
    with Collectives() as st:
        engine.step()
    assert fb.count("all_gather") == 0
    assert st.count("all_gather") == 1  # the updated persistent parameters, gathered once after the step

    partitioned = build(config(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                               stage3_max_reuse_distance=0))
    train(partitioned, 1)
    with Collectives() as fb:
        partitioned.backward(forward_backward(partitioned))
    assert fb.count("all_gather") == 6  # 3 linear layers, gathered before forward and again before backward


def test_model_persistence_threshold_caps_the_total_kept_whole():
    engine = build(config(stage3_param_persistence_threshold=10 ** 6, stage3_model_persistence_threshold=400))
    names = {n for n, p in engine.module.named_parameters() if p.ds_persist}
    # in order: 0.weight 288 (288), 0.bias 24 (312), 2.weight 576 (too many), 2.bias 24 (336), 4.weight 72 (too
    # many), 4.bias 3 (339)
    assert names == {"0.weight", "0.bias", "2.bias", "4.bias"}


def _status_of_next_layers(prefetch):
    engine = build(config(stage3_prefetch_bucket_size=prefetch, stage3_max_reuse_distance=0))
    train(engine, 1)  # records the trace
    model = engine.module
    seen = {}
    model[0].register_forward_hook(lambda *a: seen.update(second=status(model[2].weight),
                                                          third=status(model[4].weight)))
    with Collectives() as c:
        engine.backward(forward_backward(engine))
        engine.step()
    return seen, c.count("all_gather")


def test_prefetch_bucket_size_issues_gathers_ahead_of_use():
    none, gathers_without = _status_of_next_layers(0)
    assert none == {"second": ZeroParamStatus.NOT_AVAILABLE, "third": ZeroParamStatus.NOT_AVAILABLE}
    one, _ = _status_of_next_layers(1)  # any positive size prefetches at least the next module
    assert one == {"second": ZeroParamStatus.INFLIGHT, "third": ZeroParamStatus.NOT_AVAILABLE}
    wide, gathers_with = _status_of_next_layers(10 ** 6)
    assert wide == {"second": ZeroParamStatus.INFLIGHT, "third": ZeroParamStatus.INFLIGHT}
    # the wide bucket gathers the upcoming modules in one collective
    assert gathers_without == 6 and gathers_with < gathers_without


def test_max_reuse_distance_keeps_parameters_used_again_soon():
    counts = {}
    for reuse in (0, 10 ** 9):
        engine = build(config(stage3_max_reuse_distance=reuse, stage3_prefetch_bucket_size=0))
        train(engine, 1)
        loss = forward_backward(engine)
        after_forward = [status(p) for p in engine.module.parameters()]
        with Collectives() as c:
            engine.backward(loss)
        counts[reuse] = c.count("all_gather")
        engine.step()
        if reuse == 0:
            assert set(after_forward) == {ZeroParamStatus.NOT_AVAILABLE}
        else:
            assert set(after_forward) == {ZeroParamStatus.AVAILABLE}
    assert counts == {0: 3, 10 ** 9: 0}  # backward re-gathers the 3 layers only when they were released


def test_max_live_parameters_releases_when_exceeded():
    def after_forward(max_live):
        engine = build(config(stage3_max_live_parameters=max_live, stage3_max_reuse_distance=10 ** 9,
                              stage3_prefetch_bucket_size=0))
        train(engine, 1)
        forward_backward(engine)
        layers = [engine.module[i].weight.ds_status for i in (0, 2, 4)]
        live = engine.stage.partitioner.live_numel
        engine.stage.coordinator.end_pass()
        return layers, live

    layers, live = after_forward(10 ** 9)
    assert layers == [ZeroParamStatus.AVAILABLE] * 3 and live == 987
    # layers of 288+24, 576+24, 72+3 elements: fetching the second would exceed 700, so the oldest kept
    # parameter (the first weight, 288) is released, which is enough; its bias stays
    layers, live = after_forward(700)
    assert layers == [ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE, ZeroParamStatus.AVAILABLE]
    assert live == 24 + 600 + 75 <= 700


def test_module_granularity_threshold_fetches_a_fine_grained_subtree_at_once():
    engine = build(config(stage3_module_granularity_threshold=10 ** 6, stage3_prefetch_bucket_size=0,
                          stage3_max_reuse_distance=0))
    model = engine.module
    seen = []
    model[0].register_forward_hook(lambda *a: seen.append(status(model[4].weight)))
    with Collectives() as c:
        engine.backward(forward_backward(engine))
    assert seen == [ZeroParamStatus.AVAILABLE]  # the whole Sequential is one unit
    assert c.count("all_gather") == 2  # one gather before forward, one before backward


class Switch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.swap = False

    def forward(self, x):
        return self.a(self.b(x)) if self.swap else self.b(self.a(x))


def test_changed_module_order_is_logged_with_log_trace_cache_warnings_and_training_stays_right(caplog):
    torch.manual_seed(0)
    engine = build(config(log_trace_cache_warnings=True), model=Switch(),
                   optimizer=lambda g: torch.optim.SGD(g, lr=0.1))
    x = torch.randn(8, 4)
    logger = logging.getLogger("dsplug")
    logger.propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="dsplug"):
            for swap in (False, False, True):
                engine.module.swap = swap
                engine.backward(engine(x).pow(2).mean())
                engine.step()
    finally:
        logger.propagate = False
    assert "the recorded trace has" in caplog.text and "prefetching is off" in caplog.text
    engine.module.swap = True
    assert engine(x).shape == (8, 4)


def test_reduce_bucket_size_and_reduce_scatter_choose_the_collectives():
    results = {}
    for name, zero in {"one-bucket": {}, "per-parameter": {"reduce_bucket_size": 1},
                       "all-reduce": {"reduce_scatter": False}, "overlap": {"overlap_comm": True}}.items():
        engine = build(config(stage3_param_persistence_threshold=10 ** 6, **zero))
        with Collectives() as c:
            losses = train(engine, 2)
        results[name] = (c.count("reduce_scatter"), c.count("all_reduce") - 2 * 2, losses)  # minus norm + loss
    assert results["one-bucket"][:2] == (2, 0)
    assert results["per-parameter"][:2] == (12, 0)
    assert results["all-reduce"][:2] == (0, 2)
    for name in results:
        torch.testing.assert_close(results[name][2], results["one-bucket"][2], rtol=1e-6, atol=1e-7)


def test_overlapped_reductions_complete_during_backward_with_two_in_flight():
    """With overlap_comm, a bucket beyond GradientReducer.IN_FLIGHT completes the oldest reduction
    during backward (its buffer is reused), so the buckets held do not grow with the model; the
    result equals reducing one bucket at the end."""
    want = train(build(config(stage3_param_persistence_threshold=10 ** 6)), 2)
    engine = build(config(stage3_param_persistence_threshold=10 ** 6, reduce_bucket_size=1, overlap_comm=True))
    reducer = engine.stage.reducer
    seen = []
    add = reducer.add

    def counting_add(p, grad):
        add(p, grad)
        seen.append(len(reducer.outstanding))

    reducer.add = counting_add
    got = train(engine, 2)
    assert len(seen) == 12 and max(seen) == reducer.IN_FLIGHT  # 6 parameters a backward, one bucket each
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_module_state_dict_gathers_allgather_bucket_size_elements_at_a_time():
    for bucket, gathers in ((10 ** 8, 1), (1, 6)):
        engine = build(config(allgather_bucket_size=bucket))
        with Collectives() as c:
            state = engine.stage.module_state_dict()
        assert c.count("all_gather") == gathers
        for (k, v), ref in zip(state.items(), SeededMLP().state_dict().values()):
            assert torch.equal(v, ref), k


# --------------------------------------------------------------------------- 16-bit model saving
def test_save_16bit_model_returns_false_with_a_warning_when_gathering_is_off(tmp_path, caplog):
    engine = build(config(precision="bf16"))
    logger = logging.getLogger("dsplug")
    logger.propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="dsplug"):
            assert engine.save_16bit_model(tmp_path, "model.bin") is False
    finally:
        logger.propagate = False
    assert "stage3_gather_16bit_weights_on_model_save" in caplog.text
    assert not (tmp_path / "model.bin").exists()


def test_save_16bit_model_writes_the_gathered_weights(tmp_path):
    engine = build(config(precision="bf16", stage3_gather_16bit_weights_on_model_save=True))
    train(engine, 2)
    assert engine.save_16bit_model(tmp_path, "model.bin") is True
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    want = dict(zip([n for n, _ in engine.module.named_parameters()], gathered(engine.module)))
    assert list(saved) == list(want)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value.float(), want[name]), name


# --------------------------------------------------------------------------- shared / external parameters
class TiedLM(torch.nn.Module):
    """An embedding whose weight is reused by a tied head and, outside any submodule, by the parent."""

    def __init__(self, register: bool):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(10, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # the same Parameter registered in two modules
        with GatheredParameters(list(self.parameters()), modifier_rank=0), torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        if register:
            dsplug.zero.register_external_parameter(self, self.embed.weight)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.embed(tokens)))
        logits = self.head(h)
        # the parent itself also reads the embedding weight, outside embed's forward
        return logits + torch.nn.functional.linear(h, self.embed.weight)


def _lm_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)


def test_shared_and_external_parameters_train_like_plain_pytorch():
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    plain = TiedLM(register=False)
    opt = sgd(plain.parameters())
    engine = build(config(stage3_max_reuse_distance=0), model=TiedLM(register=True), optimizer=sgd)
    for step in range(3):
        tokens, target = _lm_batch(step)
        want = torch.nn.functional.cross_entropy(plain(tokens), target)
        opt.zero_grad()
        want.backward()
        opt.step()
        got = torch.nn.functional.cross_entropy(engine(tokens), target)
        engine.backward(got)
        engine.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    for got, ref in zip(gathered(engine.module), plain.parameters()):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)


def test_unregistered_use_outside_the_owning_forward_fails_and_unregister_checks():
    engine = build(config(stage3_max_reuse_distance=0), model=TiedLM(register=False),
                   optimizer=lambda g: torch.optim.SGD(g, lr=0.1))
    tokens, _ = _lm_batch(0)
    with pytest.raises(RuntimeError):
        engine(tokens)  # the embedding weight was released after embed's forward
    with pytest.raises(ValueError, match="not registered as external"):
        dsplug.zero.unregister_external_parameter(engine.module.mix, engine.module.embed.weight)


# --------------------------------------------------------------------------- zero.Init / GatheredParameters
def test_init_builds_partitioned_modules_equal_to_plain_ones_and_unpatches():
    linear_init = torch.nn.Linear.__init__
    with dsplug.zero.Init(dtype=torch.bfloat16):
        class Block(torch.nn.Module):  # a class defined inside the context is wrapped as well
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(3, 5)
                with torch.no_grad():  # a subclass may still initialise what it just created
                    self.scale = torch.nn.Parameter(torch.full((5,), 2.0))

        model = SeededMLP()
        block = Block()
    assert torch.nn.Linear.__init__ is linear_init and "__init_subclass__" not in torch.nn.Module.__dict__
    for p in list(model.parameters()) + list(block.parameters()):
        assert dsplug.zero.is_zero_param(p) and p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        assert p.ds_tensor.dtype == torch.bfloat16 and p.ds_tensor.numel() == p.ds_numel  # one rank owns all
    for got, ref in zip(gathered(model), SeededMLP().parameters()):
        assert torch.equal(got, ref.detach().to(torch.bfloat16).float())
    with GatheredParameters(block.scale):
        assert torch.equal(block.scale.float(), torch.full((5,), 2.0))
    with dsplug.zero.Init(enabled=False):
        assert not dsplug.zero.is_zero_param(torch.nn.Linear(2, 2).weight)
    existing = torch.nn.Linear(2, 2)
    dsplug.zero.Init(module=existing)
    assert existing.weight.ds_shape == (2, 2)


def test_init_lets_a_parent_initialise_its_childrens_weights_with_apply():
    """Hugging Face's post_init pattern: the parent's __init__ runs self.apply(init_fn) after its
    children were built (and partitioned); init_fn sees them whole and its values are kept.
    Module.apply is torch's own again after the context."""
    plain_apply = torch.nn.Module.apply
    order = []

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
            self.apply(self._init)

        def _init(self, module):
            order.append(type(module).__name__)
            if isinstance(module, torch.nn.Linear):
                assert module.weight.shape == (module.out_features, module.in_features)
                with torch.no_grad():
                    module.weight.fill_(0.25 * module.out_features)
                    module.bias.fill_(-1.0)

    with dsplug.zero.Init():
        model = Parent()
    assert torch.nn.Module.apply is plain_apply
    assert order == ["Linear", "ReLU", "Linear", "Sequential", "Parent"]  # children first, as torch's
    whole = gathered(model)
    assert torch.equal(whole[0], torch.full((6, 4), 1.5)) and torch.equal(whole[1], torch.full((6,), -1.0))
    assert torch.equal(whole[2], torch.full((2, 6), 0.5)) and torch.equal(whole[3], torch.full((2,), -1.0))
    assert all(dsplug.zero.is_zero_param(p) and p.numel() == 0 for p in model.parameters())


def test_init_partitions_skip_init_modules_with_their_parent():
    """torch.nn.utils.skip_init builds on the meta device and gives memory after __init__: such a
    module is partitioned with the module around it (DeepSpeed's TestParamPartitioningSkipInit)."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.skipped = torch.nn.utils.skip_init(torch.nn.Linear, 4, 3)
            self.plain = torch.nn.Linear(3, 2)

    with dsplug.zero.Init():
        model = Model()
    assert all(dsplug.zero.is_zero_param(p) and p.numel() == 0 for p in model.parameters())
    assert model.skipped.weight.ds_shape == (3, 4) and model.skipped.weight.ds_tensor.device.type == "cpu"
    with GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        model.skipped.weight.fill_(0.5)
    assert torch.equal(gathered(model)[0], torch.full((3, 4), 0.5))


def test_gathered_parameters_without_modifier_rank_discards_changes():
    with dsplug.zero.Init():
        model = SeededMLP()
    before = gathered(model)
    with GatheredParameters(model[0].weight), torch.no_grad():
        model[0].weight.fill_(7.0)
    assert torch.equal(gathered(model)[0], before[0])
    with GatheredParameters(model[0].weight, modifier_rank=0), torch.no_grad():
        model[0].weight.fill_(7.0)
    assert torch.equal(gathered(model)[0], torch.full((HIDDEN, IN), 7.0))
    with pytest.raises(ValueError, match="modifier_rank=3 is not a rank"):
        GatheredParameters(model[0].weight, modifier_rank=3)
    with GatheredParameters(model[0].weight, enabled=False):
        assert model[0].weight.numel() == 0
    with GatheredParameters(model[2].weight, fwd_module=model[0]):  # also registered as external to model[0]
        assert model[2].weight.shape == (HIDDEN, HIDDEN)
    from dsplug.plugins.zero.stage3.external import external_parameters

    assert external_parameters(model[0]) == [model[2].weight]
    plain = torch.nn.Linear(2, 2)
    with GatheredParameters(plain.weight, modifier_rank=0):  # not partitioned: nothing to do
        assert plain.weight.shape == (2, 2)


def test_init_model_trains_like_one_built_without_init():
    with dsplug.zero.Init():
        model = SeededMLP()
    engine_init = build(config(gas=2), model=model)
    engine_plain = build(config(gas=2))
    assert train(engine_init, 3) == train(engine_plain, 3)
    for a, b in zip(gathered(engine_init.module), gathered(engine_plain.module)):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- refusals
def test_unsupported_options_are_refused_with_the_key_named():
    # (offload devices belong to the offload plugins: tests/plugins/offload/test_offload.py)
    with pytest.raises(NotImplementedError, match="mpu"):
        dsplug.zero.Init(mpu=object())
    with pytest.raises(NotImplementedError, match="remote_device='tpu'"):
        dsplug.zero.Init(remote_device="tpu")
    with pytest.raises(ValueError, match="config_dict_or_path= or its alias config="):
        dsplug.zero.Init(config_dict_or_path={}, config={})


# --------------------------------------------------------------------------- checkpoint format helpers
@pytest.mark.parametrize("layout", ["per_param", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_consolidate_rebuilds_full_values_from_either_layout(layout, world):
    from dsplug.plugins.zero.stage3.checkpoint import consolidate
    from dsplug.plugins.zero.stage3.partitioned_param import piece_of

    shapes = [torch.Size([3, 5]), torch.Size([7]), torch.Size([1]), torch.Size([2, 2])]
    g = torch.Generator().manual_seed(1)
    fulls = [torch.randn(s, generator=g) for s in shapes]
    avgs = [torch.randn(s, generator=g) for s in shapes]

    def ranks_of(tensors):
        if layout == "per_param":
            return [torch.cat([piece_of(t, r, world) for t in tensors]) for r in range(world)]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        size = math.ceil(flat.numel() / world)
        flat = torch.nn.functional.pad(flat, (0, size * world - flat.numel()))
        return list(flat.split(size))

    fp32, avg = ranks_of(fulls), ranks_of(avgs)
    names = ["a", "b", "c", "d"]
    states = [{"zero_stage": 3, "layout": layout, "world_size": world, "rank": r, "groups": [{
        "names": names, "shapes": shapes, "numel": sum(s.numel() for s in shapes),
        "partition_numel": fp32[r].numel(), "fp32": fp32[r], "state": {"exp_avg": avg[r], "step": torch.tensor(4.0)},
        "hyper": {"lr": 0.1}}]} for r in range(world)]
    out = consolidate(states)
    for name, full, a in zip(names, fulls, avgs):
        assert torch.equal(out[name]["fp32"], full) and torch.equal(out[name]["state"]["exp_avg"], a)
        assert out[name]["scalars"]["step"] == 4.0 and out[name]["hyper"] == {"lr": 0.1}


def test_loading_a_stage0_checkpoint_into_stage3_explains_what_to_do(tmp_path):
    stage0 = dsplug.initialize(model=SeededMLP(), optimizer=adamw,
                               config={**config(), "zero_optimization": {"stage": 0}})[0]
    stage0.save_checkpoint(tmp_path, tag="s0")
    engine = build(config())
    with pytest.raises(ValueError, match="saved at ZeRO stage 0.*load_module_only=True"):
        engine.load_checkpoint(tmp_path, tag="s0")
    engine.load_checkpoint(tmp_path, tag="s0", load_module_only=True)
    for a, b in zip(gathered(engine.module), stage0.module.parameters()):
        assert torch.equal(a, b.detach())


def test_load_from_fp32_weights_chooses_the_master_weights_source(tmp_path):
    engine = build(config(precision="bf16"))
    train(engine, 2)
    engine.save_checkpoint(tmp_path, tag="t")
    saved_fp32 = engine.stage.state_dict()["groups"][0]["fp32"].clone()
    for from_fp32 in (True, False):
        other = build(config(precision="bf16", load_from_fp32_weights=from_fp32))
        other.load_checkpoint(tmp_path, tag="t")
        master = other.stage.state_dict()["groups"][0]["fp32"]
        want = saved_fp32 if from_fp32 else saved_fp32.to(torch.bfloat16).float()  # the 16-bit weights
        assert torch.equal(master, want)
    assert not torch.equal(saved_fp32, saved_fp32.to(torch.bfloat16).float())


def test_inference_without_an_optimizer():
    engine, optimizer, _, _ = dsplug.initialize(model=SeededMLP(), config=config())
    assert optimizer is None
    x, _ = local_batch(0, 0, 0, 1)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), SeededMLP()(x))


class CheckpointedMLP(SeededMLP):
    """Activation checkpointing: the recomputed forward runs inside backward."""

    reentrant = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: self[1](self[0](t)), x, use_reentrant=self.reentrant)
        h = checkpoint(lambda t: self[3](self[2](t)), h, use_reentrant=self.reentrant)
        return self[4](h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_trains_like_plain_pytorch(reentrant):
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    plain = SeededMLP()
    opt = sgd(plain.parameters())
    model = CheckpointedMLP()
    model.reentrant = reentrant
    engine = build(config(stage3_max_reuse_distance=0), model=model, optimizer=sgd)
    for step in range(3):
        x = torch.randn(8, IN, generator=torch.Generator().manual_seed(step), requires_grad=reentrant)
        want = plain(x).pow(2).mean()
        opt.zero_grad()
        want.backward()
        opt.step()
        got = engine(x).pow(2).mean()
        engine.backward(got)
        engine.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    for got, ref in zip(gathered(engine.module), plain.parameters()):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)


class LinearEndedCheckpoint(SeededMLP):
    """Checkpointed blocks that end in a Linear, as a transformer layer's attention / MLP do
    (``out = h + down_proj(...)``): backward reaches the Linear's ``_PreBackward`` (which gathers its
    weight) before anything unpacks a saved tensor, so the recompute starts after that gather.
    ``block`` runs the layers inside one non-reentrant checkpoint; ``frozen`` layers take no gradient."""

    def __init__(self, checkpointed: bool = True, frozen=()):
        super().__init__()
        self.checkpointed = checkpointed
        for i in frozen:
            self[i].requires_grad_(False)

    def block(self, fn, x):
        if not self.checkpointed:
            return fn(x)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, x, use_reentrant=False)

    def forward(self, x):
        h = self.block(lambda t: self[2](self[1](self[0](t))), x)  # ends in Linear(HIDDEN, HIDDEN)
        h = h + self.block(lambda t: self[2](self[3](t)), h)  # the same Linear again (a shared weight)
        return self[4](h)


def checkpointed_vs_plain(engine, steps: int, lr: float, frozen=(), rank: int = 0, world: int = 1):
    """Train ``engine`` (a :class:`LinearEndedCheckpoint` under stage 3) and the same network in
    plain PyTorch without checkpointing (SGD on the global batch); return both runs' losses and weights."""
    plain = LinearEndedCheckpoint(checkpointed=False, frozen=frozen)
    opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=lr)
    got, want = [], []
    for step in range(steps):
        x, y = local_batch(step, 0, 0, 1)  # the global batch (8 samples)
        share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        opt.zero_grad()
        loss = loss_fn(plain(x), y)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
        mine = loss_fn(engine(x[share]), y[share])
        engine.backward(mine)
        engine.step()
        got.append(float(mine.detach()))
    return {"got": got, "want": want, "params": gathered(engine.module),
            "plain": [p.detach().clone() for p in plain.parameters()]}


@pytest.mark.parametrize("frozen", [(), (0,)], ids=["trainable", "first-layer-frozen"])
def test_non_reentrant_checkpoint_ending_in_a_partitioned_linear(frozen):
    """Hugging Face's gradient checkpointing (non-reentrant) of blocks ending in a partitioned
    Linear: the recompute must not release what backward still needs (autograd shapes the
    gradient after the parameter). It failed with 'The size of tensor a (0) must match ...'."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    engine = build(config(), model=LinearEndedCheckpoint(frozen=frozen), optimizer=sgd)
    run = checkpointed_vs_plain(engine, 3, 0.1, frozen)
    torch.testing.assert_close(torch.tensor(run["got"]), torch.tensor(run["want"]), rtol=1e-5, atol=1e-6)
    for got, ref in zip(run["params"], run["plain"]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # and the weights moved (not a run where nothing trained)
    assert not torch.equal(run["plain"][2], LinearEndedCheckpoint()[2].weight.detach())
    # after backward every non-persistent parameter is released again
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_major_bucket_equals_padded_columns(world):
    """The reduce-scatter bucket (one copy per gradient) equals padding each flattened gradient
    to world x k and placing the [world, k] blocks side by side."""
    import torch.nn.functional as F

    from dsplug.plugins.zero.stage3.reduce import rank_major_bucket

    for shapes in ([(5,)], [(3, 4), (7,)], [(1,)], [(8,)], [(2, 3), (1,), (9, 2)]):
        grads = [torch.randn(s) for s in shapes]
        sizes = [-(-g.numel() // world) for g in grads]
        expected = torch.cat([F.pad(g.reshape(-1), (0, world * k - g.numel())).view(world, k)
                              for g, k in zip(grads, sizes)], dim=1)
        assert torch.equal(rank_major_bucket(grads, sizes, world, torch.float32), expected)


@pytest.mark.parametrize("zero, expected", [({"stage": 3}, True), ({"stage": 2}, False),
                                            ({"stage": 3, "overlap_comm": False}, False),
                                            ({"stage": 1, "overlap_comm": True}, True)])
def test_overlap_comm_defaults_to_on_at_stage3_only(zero, expected):
    """DeepSpeed's default for overlap_comm depends on the stage (true at 3); an explicit value wins."""
    cfg = dsplug.DsplugConfig({"train_batch_size": 2, "zero_optimization": zero}, world_size=1)
    assert cfg.section("zero_optimization").overlap_comm is expected


# --------------------------------------------------------------------------- kept gather buffers
def test_released_full_buffers_are_reused_unless_something_still_views_them():
    """A released full buffer of a parameter gathered on its own is kept and handed to the next
    gather of that size -- but not while anything (a saved view, the user) still reads it."""
    from dsplug.plugins.zero.stage3.partitioned_param import PER_PARAM_GATHER_NUMEL

    side = int(math.isqrt(PER_PARAM_GATHER_NUMEL))  # a square weight gathered on its own
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(side, side, bias=False), torch.nn.Linear(side, side, bias=False))
    engine = build(config(), model=model)
    partitioner = engine.stage.partitioner
    first, second = model[0].weight, model[1].weight
    want_first = first.ds_tensor.detach().clone().view(side, side)

    partitioner.fetch([first])
    held = first.data  # the user keeps a view of the gathered value
    where = held.data_ptr()
    partitioner.release([first])
    assert partitioner.kept_numel == side * side  # kept, but not handed out while viewed
    partitioner.fetch([second])
    assert second.data.data_ptr() != where
    assert torch.equal(held, want_first)  # the second gather did not write over it
    del held

    partitioner.release([second])
    assert partitioner.kept_numel == 2 * side * side
    partitioner.fetch([first, second])  # both take kept buffers (no allocation)
    assert partitioner.kept_numel == 0
    assert where in (first.data.data_ptr(), second.data.data_ptr())
    assert torch.equal(first.data, want_first)
    assert torch.equal(second.data, second.ds_tensor.view(side, side))


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, OUT)
        self.b = torch.nn.Linear(IN, OUT)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


def test_a_partition_without_gradient_in_a_window_reads_zero():
    """Stage 3 does not zero its gradient partitions at zero_grad (the first reduced piece after it is
    copied in): a parameter used in one window and not in the next must still read a zero gradient
    in the second, and train as plain PyTorch does (AdamW over the same two windows)."""
    from dsplug.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = _Branches()
    plain = _Branches()
    plain.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    engine = dsplug.initialize(model=model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), config={
        "train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})[0]
    seen = []
    for window, use_b in enumerate((True, False, True)):
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(window))
        engine.backward(engine(x, use_b).pow(2).mean())
        seen.append(safe_get_full_grad(engine.module.b.weight))
        engine.step()
        opt.zero_grad()
        plain(x, use_b).pow(2).mean().backward()
        if plain.b.weight.grad is None:  # (torch skips a parameter without gradient; ZeRO steps it on zeros)
            for p in plain.b.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
    assert seen[0].abs().sum() > 0 and torch.equal(seen[1], torch.zeros_like(seen[1]))
    with GatheredParameters(list(engine.module.parameters())):
        for (name, got), want in zip(engine.module.named_parameters(), plain.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)
