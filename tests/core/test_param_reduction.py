"""The reduction seam (``dsplug_reduction_groups`` / ``dsplug_param_reduction``), exercised by a
plugin that is not MoE: the example of docs/writing-plugins.md (parameters marked
``rank_local`` stay private to each rank), run as written. The built-in ZeRO stages 0-2 must
train its parameters with each rank's own gradient and the others averaged (against plain torch),
add the private gradients' squares over ranks for the norm, checkpoint each rank's own values,
and stage 3 must refuse them by the plugin's own words. The comm-hook example of the same guide
counts the bytes of a real 2-rank run."""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_distributed

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-plugins.md"


def guide_blocks(heading: str):
    """The ```python blocks of the guide's section ``heading``, in order."""
    text = GUIDE.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


def reduction_plugin():
    """The guide's example plugin, as a module."""
    module = types.ModuleType("guide_rank_local")
    exec(guide_blocks("Where a parameter's gradient is averaged (dsplug_param_reduction)")[0], module.__dict__)
    return module


class Net(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(4, 3)
        self.local = torch.nn.Linear(3, 1)
        with torch.no_grad():
            self.local.weight.fill_(0.1 * (rank + 1))  # each rank starts its private layer differently
            self.local.bias.fill_(-0.2 * rank)
        for p in self.local.parameters():
            p.rank_local = True

    def forward(self, x):
        return self.local(torch.tanh(self.dense(x)))


def batch(rank: int):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))


CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1e6,
          "steps_per_print": 10 ** 6}


def _train(stage: int, tmp: str):
    import dsplug
    from dsplug.testing import make_registry, tiny_engine

    dsplug.init_distributed(verbose=False)
    rank = dsplug.comm.get_rank()
    registry = make_registry(reduction_plugin())
    model = Net(rank)
    groups = [{"params": list(model.dense.parameters())}, {"params": list(model.local.parameters())}]
    config = {**CONFIG, "zero_optimization": {"stage": stage}}
    engine = tiny_engine(config, model=model, model_parameters=groups, registry=registry,
                         optimizer=lambda g: torch.optim.SGD(g, lr=1.0))
    assert engine.reduction_groups == ["local"]
    engine.backward(engine(batch(rank)).sum())
    engine.step()
    norm = engine.get_global_grad_norm()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.save_checkpoint(tmp, tag=f"stage{stage}")
    fresh_model = Net(rank + 7)  # other private values: the checkpoint must bring back this rank's
    fresh = tiny_engine(config, model=fresh_model, registry=registry,
                        model_parameters=[{"params": list(fresh_model.dense.parameters())},
                                          {"params": list(fresh_model.local.parameters())}],
                        optimizer=lambda g: torch.optim.SGD(g, lr=1.0))
    fresh.load_checkpoint(tmp, tag=f"stage{stage}")
    reloaded = {n: p.detach().clone() for n, p in fresh_model.named_parameters()}
    return rank, after, norm, reloaded


def _reference():
    """Plain torch: the dense layer moves by the mean of the two ranks' gradients, each rank's
    private layer by its own gradient; the norm covers the mean dense gradient and both private ones."""
    grads = []
    for rank in range(2):
        model = Net(rank)
        model(batch(rank)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    dense = {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0] if n.startswith("dense")}
    norm = torch.sqrt(sum((g ** 2).sum() for g in dense.values()) +
                      sum((g[n] ** 2).sum() for g in grads for n in g if n.startswith("local")))
    want = {}
    for rank in range(2):
        start = dict(Net(rank).named_parameters())
        want[rank] = {n: start[n].detach() - (dense[n] if n in dense else grads[rank][n]) for n in start}
    return want, float(norm)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_follow_the_guides_reduction_plugin(stage, tmp_path):
    want, norm = _reference()
    for rank, after, got_norm, reloaded in run_distributed(_train, 2, stage, str(tmp_path)):
        for name, value in want[rank].items():
            torch.testing.assert_close(after[name], value)
            torch.testing.assert_close(reloaded[name], value)
        assert got_norm == pytest.approx(norm, rel=1e-5)


def test_stage3_and_mixed_groups_are_refused_in_the_plugins_words():
    from dsplug.testing import make_registry, tiny_engine

    registry = make_registry(reduction_plugin())
    with pytest.raises(ValueError, match=r"zero_optimization.stage=3: the model has 2 rank-local parameters "
                                         r"\(averaged in the group 'local'"):
        tiny_engine({"zero_optimization": {"stage": 3}}, model=Net(0), registry=registry)
    with pytest.raises(ValueError, match=r"param group 0 mixes rank-local parameters \(local.weight, local.bias\) "
                                         r"with parameters averaged elsewhere; give the optimizer separate groups "
                                         r"\(put them in a param group of their own\)"):
        tiny_engine({"zero_optimization": {"stage": 1}}, model=Net(0), registry=registry)


def test_a_wrong_answer_names_the_plugin():
    from dsplug import hookimpl
    from dsplug.context import BuildContext
    from dsplug.testing import make_registry

    class Wrong:
        __name__ = "tests.wrong_reduction"

        @hookimpl
        def dsplug_param_reduction(self, param):
            return "the world"

    context = BuildContext(registry=make_registry(Wrong()))
    with pytest.raises(TypeError, match=r"plugin '<test>:tests.wrong_reduction' returned 'the world' from "
                                        r"dsplug_param_reduction .* expected None or a dsplug.descriptors.Reduction"):
        context.reduction_of(torch.nn.Parameter(torch.zeros(2)))
    default = BuildContext(comm="dp", world_size=3).reduction_of(torch.nn.Parameter(torch.zeros(2)))
    assert (default.key, default.comm, default.divisor, default.shard_comm) == (None, "dp", 3, None)


# ------------------------------------------------------------------------------ the comm-hook example
def _count_bytes():
    import dsplug

    dsplug.init_distributed(verbose=False)
    namespace = {}
    for block in guide_blocks("Watching collectives (comm hooks)"):
        exec(block, namespace)
    return namespace["counter"].bytes, sum(p.numel() for p in namespace["engine"].module.parameters())


@pytest.mark.multiprocess
def test_the_guides_byte_counter_sees_the_gradient_reductions():
    """The guide's ZeRO-2 engine, 3 steps on 2 ranks: each step reduces every fp32 gradient to the
    rank owning its slice, all-gathers the updated fp32 weights, and all-reduces one fp32 (the
    squared gradient norm) -- the numbers the guide prints."""
    for counted, numel in run_distributed(_count_bytes, 2):
        assert counted == {"reduce": 3 * 4 * numel, "all_gather": 3 * 4 * numel, "all_reduce": 3 * 4}
