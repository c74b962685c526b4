"""ZeRO++ at stage 3 (plugins/zero/zeropp.py): qwZ, qgZ and hpZ.

One 2-process run over gloo (``zeropp_run``) trains several engines on a small MLP whose
partitions span several quantization blocks and records what the tests below check: qwZ+qgZ
losses near plain stage 3 and decreasing; the forward's gathered weights against an independent
block quantization of the exact partitions (same on both ranks); hpZ with k = 2 (group = world)
and k = 1 training exactly like stage 3; qwZ+qgZ+hpZ exactly like qwZ+qgZ; the bytes on the wire;
a checkpoint resumed exactly. Config errors and the block codec run in this process.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsplug import hookimpl

from tests.dist_harness import run_distributed
from tests.engine_common import IN, OUT

WORLD = 2
STEPS = 10
QWZ_QGZ = dict(zero_quantized_weights=True, zero_quantized_gradients=True)


def wide_mlp():
    """12 -> 384 -> 16 -> 3: per-rank partitions of 2304 and 3072 elements (a full block and a
    shorter one each with blocks of 2048), plus small ones (one short block)."""
    from dsplug.zero import GatheredParameters

    model = torch.nn.Sequential(torch.nn.Linear(IN, 384), torch.nn.Tanh(), torch.nn.Linear(384, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, OUT))
    g = torch.Generator().manual_seed(3)
    with GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


class _Bytes:
    def __init__(self):
        self.by_op = {}

    @hookimpl
    def dsplug_comm_op(self, op, nbytes):
        self.by_op[op] = self.by_op.get(op, 0) + nbytes


def train(engine, steps: int):
    """``steps`` optimizer steps on one fixed batch (so that the loss falls); losses averaged over ranks."""
    from dsplug import comm

    from tests.engine_common import loss_fn
    from tests.plugins.zero.test_zero3 import local_batch

    x, y = local_batch(0, 0, comm.get_rank(), WORLD)
    losses = []
    for _ in range(steps):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        comm.all_reduce(t)
        losses.append(float(t) / WORLD)
    return losses


def _one_step_bytes(engine, step):
    """Bytes per op of one optimizer step (forward, backward, step), this rank's view."""
    from dsplug import comm

    from tests.engine_common import loss_fn
    from tests.plugins.zero.test_zero3 import local_batch

    listener = _Bytes()
    comm.events.register(listener)
    try:
        x, y = local_batch(step, 0, comm.get_rank(), WORLD)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    finally:
        comm.events.unregister(listener)
    return listener.by_op


def _job(ckpt_dir: str):
    from dsplug import comm
    from dsplug.zero import GatheredParameters

    from tests.plugins.zero.test_zero3 import adamw, build, config, gathered

    def engine_for(**zero):
        return build(config(WORLD, **zero), model=wide_mlp(), optimizer=adamw)

    out = {}
    base = engine_for()
    out["base"] = {"losses": train(base, STEPS), "params": gathered(base.module)}
    out["base_bytes"] = _one_step_bytes(base, STEPS)

    # --- qwZ + qgZ: train, checkpoint halfway, and look at the forward's gathered weights
    engine = engine_for(**QWZ_QGZ)
    losses = train(engine, STEPS // 2)
    engine.save_checkpoint(ckpt_dir, tag="half")
    losses += train(engine, STEPS // 2)
    out["qq"] = {"losses": losses, "params": gathered(engine.module)}
    out["qq_counts"] = dict(engine.stage.zeropp.wire.counts)
    out["qq_buckets"] = engine.stage.zeropp.gradients.buckets
    exact = [engine.stage.full_fp32_param(p) for p in engine.module.parameters()]  # the exact masters
    seen = {}

    def look(name):
        def hook(module, inputs):  # registered after the stage's own: sees the weights the module computes with
            seen.setdefault(name, [t.detach().clone() for t in module.parameters(recurse=False)])
        return hook

    hooks = [m.register_forward_pre_hook(look(n)) for n, m in engine.module.named_children()
             if isinstance(m, torch.nn.Linear)]
    out["qq_bytes"] = _one_step_bytes(engine, STEPS)
    for h in hooks:
        h.remove()
    out["qq_exact"] = exact
    out["qq_seen"] = [t for n in sorted(seen) for t in seen[n]]
    with GatheredParameters(list(engine.module.parameters())):  # exact again outside forward / backward
        out["qq_gathered_exact"] = [p.detach().clone() for p in engine.module.parameters()]
    out["qq_masters"] = [engine.stage.full_fp32_param(p) for p in engine.module.parameters()]

    resumed = engine_for(**QWZ_QGZ)
    resumed.load_checkpoint(ckpt_dir, tag="half")
    out["resumed"] = {"losses": train(resumed, STEPS // 2), "params": gathered(resumed.module),
                      "steps": resumed.global_steps}

    # --- qgZ alone: one backward's averaged gradient against the exact reduce-scatter
    from tests.engine_common import loss_fn
    from tests.plugins.zero.test_zero3 import local_batch

    x, y = local_batch(0, 0, comm.get_rank(), WORLD)
    out["grads"] = {}
    for name, zero in (("base", {}), ("qgz", {"zero_quantized_gradients": True})):
        probe = engine_for(**zero)
        probe.backward(loss_fn(probe(x), y))
        out["grads"][name] = [probe.stage.full_grad(p) for p in probe.module.parameters()]

    # --- hpZ
    hpz2 = engine_for(zero_hpz_partition_size=2)
    out["hpz2"] = {"losses": train(hpz2, STEPS), "params": gathered(hpz2.module)}
    out["hpz2_counts"] = dict(hpz2.stage.zeropp.wire.counts)
    out["hpz2_memory"] = hpz2.model_state_memory()
    hpz1 = engine_for(zero_hpz_partition_size=1)
    out["hpz1"] = {"losses": train(hpz1, STEPS), "params": gathered(hpz1.module)}
    out["hpz1_off"] = hpz1.stage.zeropp is None
    all3 = engine_for(zero_hpz_partition_size=2, **QWZ_QGZ)
    out["all3"] = {"losses": train(all3, STEPS), "params": gathered(all3.module)}
    out["all3_counts"] = dict(all3.stage.zeropp.wire.counts)
    out["all3_memory"] = all3.model_state_memory()
    return out


@pytest.fixture(scope="module")
def zeropp_run(tmp_path_factory):
    return run_distributed(_job, WORLD, str(tmp_path_factory.mktemp("zeropp") / "ckpt"), timeout=300)


def _equal(a, b):
    assert a["losses"] == b["losses"]
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)


def reference_blocks(full: torch.Tensor, world: int, block: int) -> torch.Tensor:
    """Independent qwZ reference: each rank's partition (ceil(n/N) elements, zero padded), cut into
    ``block``-element blocks, each quantized symmetric int8 (scale = max|x|/127, round half to even)
    and dequantized in fp32."""
    flat = full.reshape(-1).float()
    c = math.ceil(flat.numel() / world)
    padded = torch.zeros(world * c)
    padded[:flat.numel()] = flat
    out = []
    for piece in padded.view(world, c):
        for start in range(0, c, block):
            x = piece[start:start + block]
            scale = x.abs().max() / 127
            q = torch.zeros_like(x) if scale == 0 else torch.clamp(torch.round(x / scale), -127, 127)
            out.append(q * scale)
    return torch.cat(out)[:flat.numel()].view(full.shape)


# ------------------------------------------------------------------------------ 2 processes
@pytest.mark.multiprocess
def test_qwz_qgz_trains_close_to_stage3_and_decreases(zeropp_run):
    for rank_result in zeropp_run:
        base, qq = rank_result["base"]["losses"], rank_result["qq"]["losses"]
        # int8 weights and gradients: within 1% of the first loss of plain stage 3 throughout
        assert max(abs(a - b) for a, b in zip(qq, base)) < 0.01 * base[0], (qq, base)
        assert qq != base  # the quantization did something
        assert all(later < earlier for earlier, later in zip(qq, qq[1:])) and qq[-1] < 0.1 * qq[0]
        # qgZ alone: the averaged gradient of one backward, against the exact reduce-scatter
        for exact, quantized in zip(rank_result["grads"]["base"], rank_result["grads"]["qgz"]):
            err = (quantized - exact).abs().max()
            assert 0 < err <= 0.01 * exact.abs().max()
        counts = rank_result["qq_counts"]
        assert counts["quantized"] > 0 and counts["exact"] == 0 and counts["secondary"] == 0
        assert rank_result["qq_buckets"] >= STEPS


@pytest.mark.multiprocess
def test_qwz_gathered_weights_equal_blockwise_quantized_partitions_on_every_rank(zeropp_run):
    from dsplug.plugins.zero.stage3.zeropp import BLOCK_SIZE

    rank0, rank1 = zeropp_run
    for a, b in zip(rank0["qq_seen"], rank1["qq_seen"]):
        assert torch.equal(a, b), "ranks computed with different working weights"
    # the hook saw (weight, bias) per Linear, in module order: the same order as parameters()
    assert len(rank0["qq_seen"]) == len(rank0["qq_exact"]) == 6
    for seen, exact in zip(rank0["qq_seen"], rank0["qq_exact"]):
        assert torch.equal(seen, reference_blocks(exact, WORLD, BLOCK_SIZE))
        assert not torch.equal(seen, exact)
    # the master stays exact: GatheredParameters outside forward/backward gives it back
    for rank_result in zeropp_run:
        for got, master in zip(rank_result["qq_gathered_exact"], rank_result["qq_masters"]):
            assert torch.equal(got, master)


@pytest.mark.multiprocess
def test_compressed_bytes_on_the_wire(zeropp_run):
    for rank_result in zeropp_run:
        base, qq = rank_result["base_bytes"], rank_result["qq_bytes"]
        assert "all_to_all_single" in qq and "reduce_scatter" not in qq and "reduce_scatter" in base
        # int8 codes + one fp32 scale per 2048-element block against fp32 values
        assert base["all_gather"] / qq["all_gather"] > 3.5
        assert base["reduce_scatter"] / qq["all_to_all_single"] > 3.5
        assert sum(base.values()) / sum(qq.values()) > 3.5


@pytest.mark.multiprocess
def test_checkpoint_resumes_exactly_with_zeropp(zeropp_run):
    for rank_result in zeropp_run:
        assert rank_result["resumed"]["steps"] == STEPS // 2 * 2
        assert rank_result["resumed"]["losses"] == rank_result["qq"]["losses"][STEPS // 2:]
        for a, b in zip(rank_result["resumed"]["params"], rank_result["qq"]["params"]):
            assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_hpz_with_the_world_as_group_and_off_train_exactly_like_stage3(zeropp_run):
    numels = [p.numel() for p in wide_mlp().parameters()]
    for rank_result in zeropp_run:
        _equal(rank_result["hpz2"], rank_result["base"])
        _equal(rank_result["hpz1"], rank_result["base"])
        assert rank_result["hpz1_off"]
        counts = rank_result["hpz2_counts"]
        assert counts["secondary"] > 0 and counts["exact"] > 0 and counts["quantized"] == 0
        # the secondary shard: (N/k) * ceil(n/N) fp32 elements of every parameter
        assert rank_result["hpz2_memory"]["hpz_secondary"] == sum(4 * math.ceil(n / WORLD) for n in numels)
        # qwZ + qgZ + hpZ(k=2): the secondary holds the dequantized values, so nothing changes
        _equal(rank_result["all3"], rank_result["qq"])
        assert rank_result["all3_counts"]["secondary"] > 0 and rank_result["all3_counts"]["quantized"] > 0
        # ... kept as the int8 codes + fp32 block scales that arrived
        pieces = [math.ceil(n / WORLD) for n in numels]
        assert rank_result["all3_memory"]["hpz_secondary"] == sum(c + 4 * math.ceil(c / 2048) for c in pieces)


# ------------------------------------------------------------------------------ this process
def test_zeropp_keys_are_errors_below_stage_3_and_hpz_must_divide_the_world():
    from dsplug.config import ConfigError, DsplugConfig

    for stage in (0, 1, 2):
        for key, value in (("zero_quantized_weights", True), ("zero_quantized_gradients", True),
                           ("zero_hpz_partition_size", 2), ("zero_quantized_nontrainable_weights", True)):
            with pytest.raises(ConfigError) as err:
                DsplugConfig({"train_batch_size": 4, "zero_optimization": {"stage": stage, key: value}}, world_size=4)
            assert f"ZeRO++ ({key}) needs ZeRO stage 3" in str(err.value)
    DsplugConfig({"train_batch_size": 4, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2,
                                                                **QWZ_QGZ}}, world_size=4)
    with pytest.raises(ConfigError, match="3 does not divide the world size 4"):
        DsplugConfig({"train_batch_size": 4, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
                     world_size=4)


def test_hpz_size_that_does_not_divide_the_world_is_refused_by_the_engine():
    from tests.plugins.zero.test_zero3 import SeededMLP, adamw, build, config

    from dsplug.plugins.zero.stage3.zeropp import check_hpz

    with pytest.raises(ValueError, match="zero_hpz_partition_size: 2 does not divide the world size 1"):
        build(config(1, zero_hpz_partition_size=2), model=SeededMLP(), optimizer=adamw)
    # the stage's own check (against the real world size, when the config did not know it)
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3 must divide the data-parallel world size 4"):
        check_hpz(3, 4)
    check_hpz(2, 4)


def test_block_codec_matches_the_formula_and_carries_non_finite_values():
    from dsplug.plugins.zero.stage3.zeropp import BLOCK_SIZE, dequantize_blocks, quantize_blocks

    x = torch.randn(3 * BLOCK_SIZE, generator=torch.Generator().manual_seed(0))
    x[BLOCK_SIZE:2 * BLOCK_SIZE] = 0.0  # a zero block: scale 0, dequantizes to zeros
    q, scale = quantize_blocks(x, 3)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3,)
    got = dequantize_blocks(q.view(1, -1)[:, :2 * BLOCK_SIZE + 5], scale.view(1, -1))
    want = reference_blocks(x, 1, BLOCK_SIZE)[:2 * BLOCK_SIZE + 5]
    assert torch.equal(got.view(-1), want)
    x[7] = float("inf")
    q, scale = quantize_blocks(x, 3)
    assert torch.isnan(scale[0]) and torch.isfinite(scale[1:]).all()
    out = dequantize_blocks(q.view(1, -1), scale.view(1, -1)).view(-1)
    assert torch.isnan(out[:BLOCK_SIZE]).all() and torch.isfinite(out[BLOCK_SIZE:]).all()
