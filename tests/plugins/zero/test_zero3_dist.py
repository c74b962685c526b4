"""ZeRO stage 3 over gloo with 2 processes.

Distributed runs are expensive here, so one 2-process run (``main_run``) trains several engines
and records what the tests below check: fp32 / bf16 training with gradient accumulation and
clipping against plain PyTorch on the global batch, zero.Init against no Init, bytes held per rank
against the ZeRO memory formula, GatheredParameters with a modifier rank, save_16bit_model, and a
checkpoint saved at 2 ranks (its large weights gathered one by one, the rest packed). A checkpoint is
then resumed at 1 rank (in this process) and at 2 ranks (``resume_run``), and continues exactly
like the uninterrupted run.
"""
from __future__ import annotations

import torch
import pytest

from dsplug.plugins.zero.memory import model_state_bytes

from tests.dist_harness import run_distributed
from tests.engine_common import reference_run
from tests.plugins.zero.test_zero3 import SeededMLP, adamw, build, config, gathered, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD = 2
AGGRESSIVE = dict(stage3_prefetch_bucket_size=100, stage3_max_live_parameters=700, stage3_max_reuse_distance=0,
                  reduce_bucket_size=500)


def _main_job(ckpt_dir: str, file16: str):
    import dsplug
    from dsplug import comm
    from dsplug.plugins.zero.stage3 import partitioned_param
    from dsplug.zero import GatheredParameters

    # the weights of 288 and 576 elements are gathered one all-gather each, straight into their
    # full buffers, and the rest (the 72-element weight, the biases) packed into one: both paths
    # feed every check below
    partitioned_param.PER_PARAM_GATHER_NUMEL = 100
    out = {}
    # --- training equals the reference (fp32 with default knobs; bf16 with aggressive releasing)
    engine = build(config(WORLD, gas=2, clip=0.3))
    out["fp32"] = {"losses": train(engine, 4), "params": gathered(engine.module)}
    rank = comm.get_rank()
    out["partition_sizes"] = [p.ds_tensor.numel() for p in engine.module.parameters()]
    engine = build(config(WORLD, gas=2, clip=0.3, precision="bf16", **AGGRESSIVE))
    out["bf16"] = {"losses": train(engine, 4), "params": gathered(engine.module)}
    # one bucket per parameter: each evenly split gradient is reduce-scattered from where it is,
    # into its gradient partition at a window's first micro-step and accumulated at the second
    engine = build(config(WORLD, gas=2, clip=0.3, reduce_bucket_size=1))
    out["fp32 per parameter"] = {"losses": train(engine, 4), "params": gathered(engine.module)}

    # --- zero.Init builds the same model, partitioned from the start
    with dsplug.zero.Init():
        model = SeededMLP()
    out["init_partition_sizes"] = [p.ds_tensor.numel() for p in model.parameters()]
    out["init"] = train(build(config(WORLD), model=model), 3)
    out["no_init"] = train(build(config(WORLD)), 3)

    # --- a parent initialising its children's weights with self.apply (rank 0's values are kept)
    class ParentInitialises(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(12, 3)
            self.apply(self._init)

        def _init(self, module):
            if isinstance(module, torch.nn.Linear):
                with torch.no_grad():
                    module.weight.fill_(1.0 + rank)
                    module.bias.zero_()

    with dsplug.zero.Init():
        parent = ParentInitialises()
    out["parent_apply"] = [p.ds_tensor.detach().clone() for p in parent.parameters()]
    out["parent_apply_whole"] = gathered(parent)

    # --- bytes held by this rank after a step (threshold 0: nothing persistent)
    memory = {}
    for name, extra in {"fp32": {}, "bf16": {"precision": "bf16"}}.items():
        engine = build(config(WORLD, **extra))
        train(engine, 1)
        memory[name] = engine.model_state_memory()
        memory[name + "_accum"] = str(engine.stage.accum_dtype)
    engine = build(config(WORLD, stage3_param_persistence_threshold=100))  # biases and the last weight stay whole
    train(engine, 1)
    memory["persistent"] = engine.model_state_memory()
    out["memory"] = memory

    # --- GatheredParameters: change on rank 1, re-partition, and the optimizer's master copy follows
    engine = build(config(WORLD))
    weight = engine.module[0].weight
    with GatheredParameters(weight, modifier_rank=1), torch.no_grad():
        weight.fill_(0.5 if rank == 1 else -1.0)
    with GatheredParameters(weight):
        out["after_modifier"] = weight.detach().clone()
    with GatheredParameters(weight), torch.no_grad():
        weight.fill_(3.0)  # no modifier rank: dropped on exit
    with GatheredParameters(weight):
        out["after_plain"] = weight.detach().clone()
    out["own_piece"] = weight.ds_tensor.detach().clone()
    out["master_piece"] = engine.stage.state_dict()["groups"][0]["fp32"][:weight.ds_tensor.numel()].clone()

    # --- checkpoint after 2 steps, then 2 more uninterrupted steps; 16-bit weights
    engine = build(config(WORLD, precision="bf16", stage3_gather_16bit_weights_on_model_save=True))
    first = train(engine, 2)
    engine.save_checkpoint(ckpt_dir, tag="two")
    out["at_save16"] = gathered(engine.module)
    out["uninterrupted"] = {"losses": first + train(engine, 2, start=2), "params": gathered(engine.module)}
    out["saved16_returned"] = engine.save_16bit_model(*file16.rsplit("/", 1))
    out["gathered16"] = {n: p for n, p in zip([n for n, _ in engine.module.named_parameters()],
                                              gathered(engine.module))}
    return out


def _resume_job(ckpt_dir: str, tag: str, start: int):
    engine = build(config(WORLD, precision="bf16"))
    engine.load_checkpoint(ckpt_dir, tag=tag)
    return {"losses": train(engine, 2, start=start), "params": gathered(engine.module),
            "steps": engine.global_steps}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3")
    return {"two": str(root / "ckpt2"), "one": str(root / "ckpt1"), "file16": str(root / "weights16" / "model.bin")}


@pytest.fixture(scope="module")
def main_run(dirs):
    return run_distributed(_main_job, WORLD, dirs["two"], dirs["file16"], timeout=600)


def _close(got, want, rtol, atol):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol)
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_fp32_and_bf16_with_accumulation_and_clipping_equal_plain_pytorch(main_run):
    want = reference_run(4, WORLD, 4, 2, adamw, clip=0.3)
    want_bf16 = reference_run(4, WORLD, 4, 2, adamw, clip=0.3, precision="bf16")
    for rank_result in main_run:
        _close(rank_result["fp32"], want, rtol=1e-5, atol=1e-6)
        _close(rank_result["fp32 per parameter"], want, rtol=1e-5, atol=1e-6)
        _close(rank_result["bf16"], want_bf16, rtol=2e-2, atol=2e-2)
    for a, b in zip(main_run[0]["bf16"]["params"], main_run[1]["bf16"]["params"]):
        assert torch.equal(a, b), "ranks gathered different parameters"
    # every rank holds ceil(n/2) elements of each parameter
    sizes = [(p.numel() + 1) // 2 for p in SeededMLP().parameters()]
    assert main_run[0]["partition_sizes"] == main_run[1]["partition_sizes"] == sizes


def test_init_trains_exactly_like_without_init(main_run):
    sizes = [(p.numel() + 1) // 2 for p in SeededMLP().parameters()]
    want = reference_run(3, WORLD, 4, 1, adamw)  # no accumulation, no clipping
    for rank_result in main_run:
        assert rank_result["init_partition_sizes"] == sizes
        assert rank_result["init"] == rank_result["no_init"]
        torch.testing.assert_close(torch.tensor(rank_result["no_init"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=1e-6)


def test_init_keeps_rank_0s_values_from_a_parents_apply(main_run):
    """DeepSpeed's TestZero3InitForParentWeightInitialization: each rank fills 1 + rank, the
    partitions hold rank 0's 1.0 (18 of the weight's 36 elements at 2 ranks)."""
    for result in main_run:
        weight, bias = result["parent_apply"]
        assert weight.numel() == 18 and torch.equal(weight, torch.ones(18)) and torch.equal(bias, torch.zeros(2))
        assert torch.equal(result["parent_apply_whole"][0], torch.ones(3, 12))


def test_bytes_held_per_rank_match_the_zero3_memory_formula(main_run):
    """Partitions padded per parameter: Ψ' = Σ 2·ceil(n/2) elements; each rank holds Ψ'/N of each kind."""
    numels = [p.numel() for p in SeededMLP().parameters()]
    padded = sum(WORLD * ((n + WORLD - 1) // WORLD) for n in numels)
    scalars = 4 * len(numels)  # Adam's per-parameter 'step' counters (0-d fp32 tensors)
    for rank_result in main_run:
        memory = rank_result["memory"]
        fp32 = model_state_bytes(padded, WORLD, 3, half_precision=False)["device"]
        assert memory["fp32"]["parameters"] == fp32["parameters"]
        assert memory["fp32"]["gradients"] == fp32["gradients"]
        assert memory["fp32"]["optimizer_states"] == fp32["optimizer_states"] + scalars
        assert memory["fp32"]["gathered_parameters"] == 0
        # kept for reuse (reported as buffers, outside the model states): the one reduce bucket
        # (Ψ' elements, rank-major) with its reduced output (Ψ'/N), and the full buffers of the
        # weights gathered one by one (288 and 576 elements), released after use. The 576 one
        # once: autograd keeps a reference to the parameter, not its gathered value (the
        # coordinator's saved-tensor hooks), so releasing it after forward frees the buffer that
        # backward then gathers into again
        bucket = padded + padded // WORLD
        assert memory["fp32"]["buffers"] == 4 * (bucket + 288 + 576)
        assert memory["fp32"]["total"] == fp32["total"] + scalars
        bf16 = model_state_bytes(padded, WORLD, 3, half_precision=True)["device"]
        assert memory["bf16"]["parameters"] == bf16["parameters"]
        # under ZeRO bf16 accumulates gradients in bf16 by default, as DeepSpeed (data_types.grad_accum_dtype)
        assert memory["bf16_accum"] == "torch.bfloat16"
        assert memory["bf16"]["gradients"] == bf16["gradients"]
        assert memory["bf16"]["optimizer_states"] == bf16["optimizer_states"] + scalars
        # with a persistence threshold the small parameters are also held whole (in the padded buffer the
        # all-gather filled)
        small = [WORLD * ((n + WORLD - 1) // WORLD) for n in numels if n <= 100]
        assert memory["persistent"]["gathered_parameters"] == 4 * sum(small)
        assert memory["persistent"]["parameters"] == fp32["parameters"]


def test_gathered_parameters_modifier_rank_round_trip(main_run):
    shape = SeededMLP()[0].weight.shape
    for rank, rank_result in enumerate(main_run):
        assert torch.equal(rank_result["after_modifier"], torch.full(shape, 0.5))  # rank 1's values won
        assert torch.equal(rank_result["after_plain"], torch.full(shape, 0.5))  # changes without modifier dropped
        k = rank_result["own_piece"].numel()
        valid = min(k, shape.numel() - rank * k)
        assert torch.equal(rank_result["own_piece"][:valid], torch.full((valid,), 0.5))
        assert torch.equal(rank_result["master_piece"], rank_result["own_piece"])


def test_save_16bit_model_writes_the_gathered_weights(main_run, dirs):
    assert [r["saved16_returned"] for r in main_run] == [True, True]
    saved = torch.load(dirs["file16"], weights_only=True)
    assert list(saved) == list(main_run[0]["gathered16"])
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value.float(), main_run[0]["gathered16"][name]), name


def test_the_2_rank_checkpoint_consolidates_to_the_fp32_master_weights(main_run, dirs):
    from dsplug.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(dirs["two"], tag="two")
    names = [n for n, _ in SeededMLP().named_parameters()]
    assert list(fp32) == names
    for name, weights16 in zip(names, main_run[0]["at_save16"]):
        assert fp32[name].dtype == torch.float32
        assert torch.equal(fp32[name].to(torch.bfloat16).float(), weights16), name  # the bf16 copy of the master


@pytest.fixture(scope="module")
def single_resume(main_run, dirs):
    """Resume the 2-rank checkpoint in this process (1 rank); also save a 1-rank checkpoint."""
    engine = build(config(1, precision="bf16"))
    engine.load_checkpoint(dirs["two"], tag="two")
    resumed = {"losses": train(engine, 2, start=2), "params": gathered(engine.module), "steps": engine.global_steps}
    fresh = build(config(1, precision="bf16"))
    first = train(fresh, 2)
    fresh.save_checkpoint(dirs["one"], tag="one")
    uninterrupted = {"losses": first + train(fresh, 2, start=2), "params": gathered(fresh.module)}
    return {"resumed": resumed, "uninterrupted": uninterrupted}


@pytest.fixture(scope="module")
def resume_run(single_resume, dirs):
    return run_distributed(_resume_both, WORLD, dirs["two"], dirs["one"], timeout=600)


def _resume_both(two: str, one: str):
    return {"from_two": _resume_job(two, "two", 2), "from_one": _resume_job(one, "one", 2)}


def _continues(resumed, uninterrupted, rtol, atol):
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(uninterrupted["losses"][2:]),
                               rtol=rtol, atol=atol)
    for a, b in zip(resumed["params"], uninterrupted["params"]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_checkpoint_from_2_ranks_resumes_at_1_rank(main_run, single_resume):
    assert single_resume["resumed"]["steps"] == 4
    # one rank sums the same global batch in another order: bf16 rounding of the weights may differ
    _continues(single_resume["resumed"], main_run[0]["uninterrupted"], rtol=1e-2, atol=1e-2)


def test_checkpoint_resumes_at_2_ranks_from_2_and_from_1_rank(main_run, single_resume, resume_run):
    for rank_result in resume_run:
        assert rank_result["from_two"]["steps"] == 4
        _continues(rank_result["from_two"], main_run[0]["uninterrupted"], rtol=0, atol=0)
        _continues(rank_result["from_one"], single_resume["uninterrupted"], rtol=1e-2, atol=1e-2)


def _checkpointed_job():
    from dsplug import comm
    from tests.plugins.zero.test_zero3 import LinearEndedCheckpoint, checkpointed_vs_plain

    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    engine = build(config(WORLD), model=LinearEndedCheckpoint(), optimizer=sgd)
    run = checkpointed_vs_plain(engine, 3, 0.1, rank=comm.get_rank(), world=WORLD)
    run["partition_sizes"] = [p.ds_tensor.numel() for p in engine.module.parameters()]
    return run


def test_non_reentrant_checkpoint_of_partitioned_parameters_at_2_ranks():
    """Blocks ending in a Linear under torch.utils.checkpoint(use_reentrant=False), each rank on
    its half of the batch, equal plain PyTorch without checkpointing on the whole batch."""
    runs = run_distributed(_checkpointed_job, WORLD, timeout=300)
    sizes = [(p.numel() + 1) // 2 for p in SeededMLP().parameters()]
    mean = torch.tensor([r["got"] for r in runs]).mean(0)  # each rank's loss is over its half
    for run in runs:
        assert run["partition_sizes"] == sizes  # partitioned, each rank a half
        torch.testing.assert_close(mean, torch.tensor(run["want"]), rtol=1e-5, atol=1e-6)
        for got, ref in zip(run["params"], run["plain"]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
