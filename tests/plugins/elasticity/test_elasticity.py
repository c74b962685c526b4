"""Elastic batch sizes: ``compute_elastic_config`` against hand-computed and documented cases, an
independent brute-force reference (hypothesis), the errors, and the batch triple ``initialize``
gets from an ``elasticity`` section at world sizes 1 and 2."""
from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsplug
from dsplug.config import ConfigError, DsplugConfig, DsplugConfigWarning
from dsplug.elasticity import (ElasticityConfig, ElasticityConfigError, ElasticityError,
                               ElasticityIncompatibleWorldSize, compute_elastic_config, elasticity_enabled,
                               ensure_immutable_elastic_config)

from dsplug.testing import SectionContract

from tests.dist_harness import run_distributed

VERSION = "0.14.0"  # a DeepSpeed version that has elasticity


def elastic(**section):
    body = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
            "max_gpus": 10000, "version": 0.1}
    body.update(section)
    return {"elasticity": body}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


class TestElasticitySection(SectionContract):
    plugin_name = "elasticity"
    # agrees with the harness's own batch keys (train_batch_size 2, micro 2, world size 1)
    section = {"enabled": True, "max_train_batch_size": 2, "micro_batch_sizes": [2], "max_gpus": 4, "version": 0.1}


# ------------------------------------------------------------------ independent brute-force reference
def hcn_reference(limit):
    """Highly composite numbers <= limit, straight from the definition (record divisor counts)."""
    out, best = [], 0
    for n in range(1, limit + 1):
        count = sum(1 for d in range(1, math.isqrt(n) + 1) if n % d == 0 for _ in ((d,) if d * d == n else (d, d)))
        if count > best:
            out.append(n)
            best = count
    return out


def reference_v01(micro, max_batch, min_gpus, max_gpus, prefer_larger):
    """The documented 0.1 search, written out by brute force."""
    hcn = hcn_reference(max_batch)
    bases = sorted(set(micro))
    common = math.lcm(*micro)
    if common <= max_batch:
        bases.append(common)
    candidates = {b * max(h for h in hcn if b * h <= max_batch) for b in bases}
    best = None
    for batch in candidates:
        valid = [g for g in range(min_gpus, max_gpus + 1) if any(batch % (m * g) == 0 for m in micro)]
        if not valid:
            continue
        key = (len(valid), batch if prefer_larger else -batch)
        if best is None or key > best[0]:
            best = (key, batch, valid)
    return (None, []) if best is None else (best[1], best[2])


def test_highly_composite_numbers_match_their_definition():
    from dsplug.plugins.elasticity.search import highly_composite_numbers

    assert list(highly_composite_numbers(5040)) == hcn_reference(5040)
    big = highly_composite_numbers(2 ** 40)  # the whole range of max_train_batch_size, at once
    assert big[:len(hcn_reference(5040))] == highly_composite_numbers(5040) and big[-1] <= 2 ** 40


# ------------------------------------------------------------------ documented and hand-computed cases
def test_documented_example_config():
    """DeepSpeed's example section (max 2000, micro [2, 4, 6], 1..10000 GPUs). By hand: the bases 2, 4,
    6 and lcm 12 give 2*840, 4*360, 6*240, 12*120 = 1680 and 1440; 1680 runs on every divisor of
    1680/2 = 840 (32 counts; 420 and 280 divide 840), 1440 on the divisors of 720 (30)."""
    final, valid = compute_elastic_config(elastic(min_time=20), VERSION)
    assert final == 1680
    assert valid == divisors(840) and len(valid) == 32
    # world size 7: 1680 / 7 = 240 per rank; 6 is the largest of [2, 4, 6] dividing it
    assert compute_elastic_config(elastic(), VERSION, world_size=7) == (1680, divisors(840), 6)


def test_lcm_candidate_and_gpu_window():
    """micro [8, 12, 16, 17], max 10000, 32..1500 GPUs: lcm 816 × 12 (the largest highly composite
    number <= 10000 // 816 = 12) = 9792 beats every micro-batch base; its GPU counts are the divisors
    of 9792 / m in [32, 1500] for m in the list (23 of them; DeepSpeed's own test expects 9792 and 23)."""
    config = elastic(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500)
    final, valid = compute_elastic_config(config, VERSION)
    expected = sorted({g for m in (8, 12, 16, 17) if 9792 % m == 0 for g in divisors(9792 // m) if 32 <= g <= 1500})
    assert final == 9792 and valid == expected and len(valid) == 23
    assert compute_elastic_config(config, VERSION, world_size=64) == (9792, expected, 17)  # 9792/64 = 153 = 9 × 17


def test_prefer_larger_batch_breaks_ties():
    """micro [2, 3], max 20: candidates 2*6 = 12 (GPU counts 1, 2, 3, 4, 6) and 3*6 = 18 (1, 2, 3, 6, 9)
    tie at five counts."""
    config = elastic(max_train_batch_size=20, micro_batch_sizes=[2, 3], max_gpus=100)
    assert compute_elastic_config(config, VERSION) == (18, [1, 2, 3, 6, 9])
    config["elasticity"]["prefer_larger_batch"] = False
    assert compute_elastic_config(config, VERSION) == (12, [1, 2, 3, 4, 6])
    config["elasticity"]["prefer_large_batch"] = config["elasticity"].pop("prefer_larger_batch")  # the docs' spelling
    assert compute_elastic_config(config, VERSION) == (12, [1, 2, 3, 4, 6])


def test_batch_never_exceeds_max_train_batch_size():
    """micro [1, 2, 3, 7], max 32: their lcm 42 is larger than the maximum and is not a candidate
    (DeepSpeed's implementation tries it and can return 42). 24 runs on 1, 2, 3, 4, 6, 8, 12, 24."""
    final, valid = compute_elastic_config(elastic(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7]), VERSION)
    assert (final, valid) == (24, [1, 2, 3, 4, 6, 8, 12, 24])


def test_incompatible_world_size_names_it_and_the_valid_counts():
    with pytest.raises(ElasticityIncompatibleWorldSize) as err:
        compute_elastic_config(elastic(), VERSION, world_size=9)
    text = str(err.value)
    assert "World size (9)" in text and "840" in text and "nearest valid: [7, 8, 10]" in text
    assert isinstance(err.value, ElasticityError) and isinstance(err.value, ValueError)


def test_version_02_counts_whole_nodes():
    """4 GPUs per node, model parallel 2: 2 data-parallel ranks per node; 4..16 GPUs = 1..4 nodes;
    per node at most 100 // 2 = 50: bases 2 and 4 (lcm) give 2*24 = 4*12 = 48, valid on 1..4 nodes.
    Final 48 × 2 = 96 over data-parallel sizes 2, 4, 6, 8."""
    config = elastic(version=0.2, max_train_batch_size=100, micro_batch_sizes=[2, 4], min_gpus=4, max_gpus=16,
                     num_gpus_per_node=4, model_parallel_size=2)
    assert compute_elastic_config(config, VERSION, world_size=8) == (96, [2, 4, 6, 8], 4)  # 96/4 = 24 = 4 × 6
    assert compute_elastic_config(config, VERSION, world_size=12) == (96, [2, 4, 6, 8], 4)  # 96/6 = 16
    # 10 GPUs = 5 data-parallel ranks, outside the list: 0.2 gives that size a batch of its own,
    # the largest k × m × 5 <= 100 (m = 2: 100, m = 4: 100), micro-batch 4 (100/5 = 20)
    assert compute_elastic_config(config, VERSION, world_size=10) == (100, [5], 4)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="not a multiple of elasticity.model_parallel_size=2"):
        compute_elastic_config(config, VERSION, world_size=7)


def test_version_02_reads_world_size_from_the_environment(monkeypatch):
    config = elastic(version=0.2, max_train_batch_size=24, micro_batch_sizes=[2, 3], max_gpus=4)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(config, VERSION)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert compute_elastic_config(config, VERSION) == (24, [1, 2, 3, 4])
    assert compute_elastic_config(config, VERSION, return_microbatch=True) == (24, [1, 2, 3, 4], 3)
    config["elasticity"]["version"] = 0.1
    assert compute_elastic_config(config, VERSION, return_microbatch=True) == (24, [1, 2, 3, 4], 3)


@pytest.mark.parametrize("change, error, words", [
    ({"__drop__": "elasticity"}, ElasticityConfigError, "'elasticity' is missing"),
    ({"enabled": False}, ElasticityConfigError, "Elasticity is disabled"),
    ({"__drop__": "max_train_batch_size"}, ElasticityConfigError, "elasticity.max_train_batch_size: required"),
    ({"micro_batch_sizes": [2, 4, 4000]}, ElasticityConfigError, "[4000] exceed max_train_batch_size=2000"),
    ({"micro_batch_sizes": []}, ElasticityConfigError, "at least one micro-batch size"),
    ({"micro_batch_sizes": [2, 0]}, ElasticityConfigError, "must be >= 1"),
    ({"max_gpu": 8}, ElasticityConfigError, "did you mean 'elasticity.max_gpus'"),
    ({"min_gpus": 8, "max_gpus": 4}, ElasticityConfigError, "4 is less than min_gpus=8"),
    ({"version": 0.3}, ElasticityError, "newer than this runtime supports (up to 0.2)"),
    ({"version": "0.15"}, ElasticityError, "must be 0.1 or 0.2"),
    ({"model_parallel_size": 2}, ElasticityConfigError, 'needs "version": 0.2'),
    ({"version": 0.2, "num_gpus_per_node": 6, "model_parallel_size": 4}, ElasticityConfigError,
     "6 is not divisible by model_parallel_size=4"),
    ({"min_gpus": 4000, "max_gpus": 5000}, ElasticityConfigError, "raise max_train_batch_size or lower min_gpus"),
])
def test_config_errors_name_the_key(change, error, words):
    config = elastic()
    drop = change.pop("__drop__", None)
    if drop == "elasticity":
        config = {"train_batch_size": 8}
    elif drop:
        del config["elasticity"][drop]
    config.get("elasticity", {}).update(change)
    with pytest.raises(error) as err:
        compute_elastic_config(config, VERSION, world_size=0)
    assert words in str(err.value)


def test_target_version_and_arguments():
    with pytest.raises(ElasticityError, match=r"needs DeepSpeed >= 0\.3\.8"):
        compute_elastic_config(elastic(), "0.3.7")
    with pytest.raises(ElasticityError, match="not a version number"):
        compute_elastic_config(elastic(), "latest")
    assert compute_elastic_config(elastic(), dsplug.__version__)[0] == 1680  # dsplug's own version
    with pytest.raises(ElasticityError, match="non-negative integer"):
        compute_elastic_config(elastic(), VERSION, world_size=-2)
    with pytest.raises(ElasticityConfigError, match="dictionary"):
        compute_elastic_config("elasticity", VERSION)


def test_elasticity_enabled_and_config_class():
    assert elasticity_enabled(elastic())
    assert not elasticity_enabled(elastic(enabled=False)) and not elasticity_enabled({}) and not elasticity_enabled(3)
    c = ElasticityConfig(elastic()["elasticity"])
    assert (c.max_acceptable_batch_size, c.micro_batches, c.version, c.prefer_larger_batch_size) == (2000, [2, 4, 6],
                                                                                                       0.1, True)
    defaults = ElasticityConfig({})  # a disabled section needs no keys: DeepSpeed's documented defaults
    assert (defaults.enabled, defaults.max_acceptable_batch_size, defaults.micro_batches, defaults.min_gpus,
            defaults.max_gpus, defaults.min_time, defaults.version, defaults.ignore_non_elastic_batch_info,
            defaults.num_gpus_per_node, defaults.model_parallel_size) == (False, 2000, [2, 4, 6], 1, 10000, 0, 0.2,
                                                                          False, 1, 1)


def test_ensure_immutable_elastic_config(monkeypatch, caplog):
    section = elastic()["elasticity"]
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger="dsplug"):
        ensure_immutable_elastic_config(section)
    assert "DEEPSPEED_ELASTICITY_CONFIG" in caplog.text
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(section))
    ensure_immutable_elastic_config(dict(section, min_gpus=4))  # min_gpus may differ
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(dict(section, micro_batch_sizes=[2, 4])))
    with pytest.raises(ElasticityConfigError, match=r"micro_batch_sizes=\[2, 4\]' seen by resource scheduler"):
        ensure_immutable_elastic_config(section)


def test_deepspeed_import_paths():
    import dsplug.elasticity as api
    from dsplug.elasticity.config import ElasticityConfigError as same
    from dsplug.elasticity.constants import MAX_ACCEPTABLE_BATCH_SIZE
    from dsplug.unavailable import NotAvailableInDsplug, module_error

    assert same is ElasticityConfigError and MAX_ACCEPTABLE_BATCH_SIZE == "max_train_batch_size"
    assert dsplug.elasticity is api  # reachable from the top-level module, as deepspeed.elasticity is
    assert module_error("deepspeed.elasticity") is None
    assert api.is_torch_elastic_compatible()
    with pytest.raises(NotAvailableInDsplug, match="dsplug launch --elastic_training"):
        api.DSElasticAgent  # noqa: B018


# ------------------------------------------------------------------ property test against the reference
@st.composite
def sections(draw):
    micro = draw(st.lists(st.integers(1, 24), min_size=1, max_size=4, unique=True))
    max_batch = draw(st.integers(max(micro), 1500))
    min_gpus = draw(st.integers(1, 12))
    max_gpus = draw(st.integers(min_gpus, min_gpus + 150))
    return dict(micro=micro, max_batch=max_batch, min_gpus=min_gpus, max_gpus=max_gpus, prefer=draw(st.booleans()))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sections())
def test_elastic_batch_properties(s):
    config = elastic(max_train_batch_size=s["max_batch"], micro_batch_sizes=s["micro"], min_gpus=s["min_gpus"],
                     max_gpus=s["max_gpus"], prefer_larger_batch=s["prefer"])
    expected = reference_v01(s["micro"], s["max_batch"], s["min_gpus"], s["max_gpus"], s["prefer"])
    if expected[0] is None:
        with pytest.raises(ElasticityConfigError):
            compute_elastic_config(config, VERSION)
        return
    final, valid = compute_elastic_config(config, VERSION)
    assert (final, valid) == expected
    assert final <= s["max_batch"] and valid == sorted(set(valid))
    for g in valid:
        assert s["min_gpus"] <= g <= s["max_gpus"]
        _, _, micro = compute_elastic_config(config, VERSION, world_size=g)
        assert micro in s["micro"] and final % (micro * g) == 0  # final = micro × gas × g, gas whole
        assert micro == max(m for m in s["micro"] if final % (m * g) == 0)
    for g in range(s["min_gpus"], min(s["max_gpus"], s["min_gpus"] + 40) + 1):
        if g not in valid:
            with pytest.raises(ElasticityIncompatibleWorldSize):
                compute_elastic_config(config, VERSION, world_size=g)


@settings(max_examples=60, deadline=None)
@given(sections(), st.sampled_from([(1, 1), (2, 1), (4, 2), (8, 2), (8, 4)]))
def test_version_02_properties(s, layout):
    """0.2 is the 0.1 search over whole nodes: reference computed at node level, scaled by the
    data-parallel ranks per node."""
    gpus_per_node, mp = layout
    per_node = gpus_per_node // mp
    min_gpus, max_gpus = s["min_gpus"], max(s["max_gpus"], s["min_gpus"] + gpus_per_node)
    config = elastic(version=0.2, max_train_batch_size=s["max_batch"] * per_node, micro_batch_sizes=s["micro"],
                     min_gpus=min_gpus, max_gpus=max_gpus, num_gpus_per_node=gpus_per_node, model_parallel_size=mp,
                     prefer_larger_batch=s["prefer"])
    low, high = -(-min_gpus // gpus_per_node), max_gpus // gpus_per_node
    node_final, node_valid = reference_v01(s["micro"], s["max_batch"], low, high, s["prefer"])
    if node_final is None:
        with pytest.raises(ElasticityConfigError):
            compute_elastic_config(config, VERSION, world_size=gpus_per_node)
        return
    final, valid, _ = compute_elastic_config(config, VERSION, world_size=node_valid[0] * gpus_per_node)
    assert final == node_final * per_node and valid == [n * per_node for n in node_valid]
    for dp in valid:
        assert min_gpus <= dp // per_node * gpus_per_node <= max_gpus
        again, _, micro = compute_elastic_config(config, VERSION, world_size=dp * mp)
        assert again == final and micro in s["micro"] and final % (micro * dp) == 0


# ------------------------------------------------------------------ the batch triple at initialize
SMALL = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "min_gpus": 1, "max_gpus": 4,
         "version": 0.1}
# by hand: bases 2, 3, lcm 6 give 2*12 = 24, 3*6 = 18, 6*4 = 24; 24 runs on 1, 2, 3, 4 GPUs (18 on 1, 2, 3).
# world 1: 24 per rank, largest micro dividing it 3, gas 8; world 2: 12 per rank, micro 3, gas 4.
HAND = {1: (24, 3, 8), 2: (24, 3, 4)}


@pytest.mark.parametrize("world", [1, 2])
def test_config_sets_the_triple_for_the_world_size(world):
    c = DsplugConfig({"elasticity": dict(SMALL)}, world_size=world)
    triple = (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)
    final, _, micro = compute_elastic_config({"elasticity": SMALL}, VERSION, world_size=world)
    assert triple == HAND[world] == (final, micro, final // (micro * world))
    again = DsplugConfig(dict(c), world_size=world)  # the resolved config (batch keys included) parses again
    assert (again.train_batch_size, again.train_micro_batch_size_per_gpu, again.gradient_accumulation_steps) == triple


def test_batch_keys_outside_the_section():
    with pytest.raises(ConfigError) as err:
        DsplugConfig({"elasticity": dict(SMALL), "train_batch_size": 32}, world_size=2)
    assert "train_batch_size: 32 disagrees with the elastic batch sizes at world size 2 (train_batch_size=24" in str(
        err.value) and "ignore_non_elastic_batch_info" in str(err.value)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: 2 disagrees"):
        DsplugConfig({"elasticity": dict(SMALL), "gradient_accumulation_steps": 2}, world_size=1)
    with pytest.warns(DsplugConfigWarning, match="32 is replaced by the elastic value 24"):
        c = DsplugConfig({"elasticity": dict(SMALL, ignore_non_elastic_batch_info=True), "train_batch_size": 32},
                         world_size=2)
    assert c.train_batch_size == 24
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agree = DsplugConfig({"elasticity": dict(SMALL), "train_batch_size": 24,
                              "train_micro_batch_size_per_gpu": "auto"}, world_size=2)
    assert (agree.train_batch_size, agree.train_micro_batch_size_per_gpu, agree.gradient_accumulation_steps) == HAND[2]


def test_config_errors_through_the_config_system():
    with pytest.raises(ConfigError, match=r"elasticity: World size \(5\) is not valid .* \[1, 2, 3, 4\]"):
        DsplugConfig({"elasticity": dict(SMALL)}, world_size=5)
    with pytest.raises(ConfigError) as err:
        DsplugConfig({"elasticity": {"enabled": True, "micro_batch_sizes": [2], "min_gpu": 1}}, world_size=1)
    text = str(err.value)
    assert "elasticity.min_gpu: unknown key; did you mean 'elasticity.min_gpus'" in text
    assert "elasticity.max_train_batch_size: required when elasticity is enabled" in text
    assert "set train_batch_size" not in text  # the elastic section owns the batch: no second, misleading error
    DsplugConfig({"elasticity": dict(SMALL)})  # `dsplug config check` (no world size): valid without batch keys
    with pytest.raises(ConfigError, match="train_batch_size: 32 disagrees with the elastic batch sizes"):
        DsplugConfig({"elasticity": dict(SMALL), "train_batch_size": 32})
    off = DsplugConfig({"elasticity": dict(SMALL, enabled=False), "train_batch_size": 8}, world_size=2)
    assert (off.train_batch_size, off.gradient_accumulation_steps) == (8, 1)
    from dsplug.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({"elasticity": dict(SMALL)}, world_size=2).elasticity_enabled


def _initialize_with_elasticity(section):
    import dsplug as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config={"elasticity": section,
                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    triple = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    steps = []
    for _ in range(triple[2]):
        loss = engine(torch.randn(triple[1], 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        steps.append(engine.global_steps)
    return triple, deepspeed.comm.get_world_size(), steps


def test_initialize_sets_the_triple_world_1():
    triple, world, steps = _initialize_with_elasticity(dict(SMALL))
    assert (world, triple) == (1, HAND[1])
    assert steps == [0] * 7 + [1]  # one optimizer step after gradient_accumulation_steps micro-steps


@pytest.mark.multiprocess
def test_initialize_sets_the_triple_world_2():
    results = run_distributed(_initialize_with_elasticity, 2, dict(SMALL))
    for triple, world, steps in results:
        assert (world, triple) == (2, HAND[2])
        assert steps == [0, 0, 0, 1]


# ------------------------------------------------------------------ resuming with other accumulation steps
def _train(config, steps, ckpt=None, load=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, _, _, _ = dsplug.initialize(model=model, model_parameters=model.parameters(), config=config)
    if load:
        engine.load_checkpoint(load)
    tb, mb = engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    while engine.global_steps < steps:
        x = torch.randn(tb, 4, generator=torch.Generator().manual_seed(engine.global_steps))
        for micro in range(gas):
            chunk = x[micro * mb:(micro + 1) * mb]
            engine.backward(torch.nn.functional.mse_loss(engine(chunk), chunk.sum(1, keepdim=True)))
            engine.step()
    if ckpt:
        engine.save_checkpoint(ckpt)
    return [p.detach().clone() for p in engine.module.parameters()]


def test_resume_with_other_accumulation_steps_is_exact(tmp_path):
    """A checkpoint saved with gradient_accumulation_steps 2 (as at world size 2) and resumed with 4
    (world size 1): the next optimizer step accumulates 4 micro-batches. Reference: plain PyTorch on
    the whole batch of each step."""
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "steps_per_print": 1000}
    _train(dict(base, train_batch_size=12, train_micro_batch_size_per_gpu=6), 3, ckpt=tmp_path)
    got = _train(dict(base, train_batch_size=12, train_micro_batch_size_per_gpu=3), 6, load=tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for step in range(6):
        x = torch.randn(12, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    for a, b in zip(got, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


def test_an_invalid_enabled_section_reports_only_its_own_error():
    """No derived 'set train_batch_size' error on top of the section's own (world size known)."""
    with pytest.raises(dsplug.config.ConfigError) as info:
        dsplug.DsplugConfig({"elasticity": {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [2, 4],
                                            "min_gpus": 0}}, world_size=2)
    assert "elasticity.min_gpus" in str(info.value) and "train_batch_size" not in str(info.value)


# ------------------------------------------------------------------------------ dsplug elastic (ds_elastic)
def test_elastic_command_prints_the_section_and_the_batch(tmp_path, capsys):
    from dsplug.cli import main

    section = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
               "max_gpus": 10000, "min_time": 20, "version": 0.1}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "elasticity": section}))
    from dsplug.elasticity import compute_elastic_config

    batch, gpus, micro = compute_elastic_config({"elasticity": section}, "0.19.8", world_size=4)
    assert main(["elastic", "-c", str(path), "-w", "4"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("Elasticity config:\n" + "-" * 42 + "\n")[1].split("\n---")[0]) == section
    assert out.endswith(f"Calculated results for world size 4:\n{'-' * 42}\nfinal_batch_size .... {batch}\n"
                        f"valid_gpus .......... {gpus}\nmicro_batch_size .... {micro}\n")
    assert main(["elastic", "-c", str(path)]) == 0
    assert capsys.readouterr().out.endswith(f"final_batch_size .... {batch}\nvalid_gpus .......... {gpus}\n")
    assert 9 not in gpus
    assert main(["elastic", "-c", str(path), "-w", "9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"dsplug elastic: {path}: ") and len(err.splitlines()) == 1
