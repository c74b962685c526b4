"""Pipeline training over real processes (gloo): 2 stages x 1 and 2 stages x 2 data-parallel
replicas against the same model trained by a plain torch loop, tied weights, the p2p traffic."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dsplug import hookimpl

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.multiprocess

V, D, T, MB = 16, 8, 4, 2          # vocabulary, width, tokens per sample, samples per micro-batch
BASE_SEED = 1234
STEPS, GAS, LR = 3, 3, 0.05


def head(embedding, x):
    """The output head: the input embedding's matrix, transposed (the tied weight)."""
    return x @ embedding.weight.t()


def token_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def pipe_layers():
    from dsplug.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec("embed", nn.Embedding, V, D), LayerSpec(nn.Linear, D, D), nn.ReLU(),
            LayerSpec(nn.Linear, D, D), nn.ReLU(), TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=head)]


class Reference(nn.Module):
    """The same network without a pipeline: each layer built after seeding with base_seed + its index,
    as PipelineModule(seed_layers=True) builds them; the head uses the embedding's weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(BASE_SEED + 0)
        self.embed = nn.Embedding(V, D)
        torch.manual_seed(BASE_SEED + 1)
        self.lin1 = nn.Linear(D, D)
        torch.manual_seed(BASE_SEED + 3)
        self.lin2 = nn.Linear(D, D)

    def forward(self, x):
        h = torch.relu(self.lin2(torch.relu(self.lin1(self.embed(x)))))
        return head(self.embed, h)

    def by_layer(self):
        """State per pipeline layer index, as the pipeline's ranks report it."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        return {0: {"weight": sd["embed.weight"]}, 1: {"weight": sd["lin1.weight"], "bias": sd["lin1.bias"]},
                3: {"weight": sd["lin2.weight"], "bias": sd["lin2.bias"]}, 5: {"weight": sd["embed.weight"]}}


def batches(steps, gas, dp):
    """data[step][micro][replica] = (tokens, labels)."""
    g = torch.Generator().manual_seed(7)
    return [[[(torch.randint(0, V, (MB, T), generator=g), torch.randint(0, V, (MB, T), generator=g))
              for _r in range(dp)] for _m in range(gas)] for _s in range(steps)]


def reference_run(steps, gas, dp):
    """The plain torch loop: the same global batch (every replica's micro-batches), the loss of each
    micro-batch divided by their number, one AdamW step per batch."""
    model = Reference()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in batches(steps, gas, dp):
        opt.zero_grad()
        total = 0.0
        for micro in step:
            for x, y in micro:
                loss = token_loss(model(x), y)
                (loss / (gas * dp)).backward()
                total += loss.item()
        opt.step()
        losses.append(total / (gas * dp))
    with torch.no_grad():  # the first batch's mean loss after training (eval_batch's answer)
        first = batches(steps, gas, dp)[0]
        evaluated = sum(token_loss(model(x), y).item() for micro in first for x, y in micro) / (gas * dp)
    return losses, model.by_layer(), evaluated


def config(gas, zero_stage=0, **extra):
    return {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": zero_stage}, **extra}


class Recorder:
    """A ``dsplug_comm_op`` hook: the ops and bytes this rank sends / receives point-to-point."""

    def __init__(self):
        self.ops = []

    @hookimpl
    def dsplug_comm_op(self, op, nbytes):
        self.ops.append((op, int(nbytes)))


def _layer_states(model):
    return {idx: {k: v.detach().clone() for k, v in layer.state_dict().items()}
            for idx, layer in model.local_layer_modules()}


def _train(num_stages, zero_stage, steps, gas, save_dir=None):
    import dsplug
    from dsplug import comm
    from dsplug.pipe import PipelineModule

    model = PipelineModule(pipe_layers(), num_stages=num_stages, loss_fn=token_loss, seed_layers=True,
                           base_seed=BASE_SEED)
    engine, *_ = dsplug.initialize(model=model, config=config(gas, zero_stage))
    grid = model.mpu()
    dp, replica = grid.get_data_parallel_world_size(), grid.get_data_parallel_id()
    data = batches(steps, gas, dp)
    recorder = Recorder()
    comm.events.register(recorder)
    losses = []
    for step in data:
        losses.append(float(engine.train_batch(iter([micro[replica] for micro in step]))))
    comm.events.unregister(recorder)
    layers = _layer_states(model)
    tied = model.tied_modules["embed"].weight.detach().clone()
    eval_loss = float(engine.eval_batch(iter([micro[replica] for micro in data[0]])))
    resumed = None
    if save_dir is not None:  # save, then one more step: what a run resumed elsewhere must reproduce
        engine.save_checkpoint(save_dir)
        step = batches(steps + 1, gas, dp)[steps]
        resumed = (float(engine.train_batch(iter([micro[replica] for micro in step]))), _layer_states(model))
    return {"resumed": resumed, "stage": engine.stage_id, "replica": replica, "losses": losses, "layers": layers, "tied": tied,
            "parts": list(model.parts), "p2p": [o for o in recorder.ops if o[0] in ("send", "recv")],
            "eval": eval_loss, "micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
            "groups": (grid.dp_group, grid.pp_group, grid.ds_model_ranks, grid.get_model_parallel_rank(),
                       grid.prev_stage_rank(), grid.next_stage_rank()),
            "context": (engine.context.rank, engine.context.world_size, engine.context.mp_rank)}


def _resume_on_one_stage(save_dir, steps, gas, dp):
    """One process, one stage, ZeRO 0: load the pipeline checkpoint and train the next global batch
    (every replica's micro-batches as this run's micro-batches)."""
    import dsplug
    from dsplug.pipe import PipelineModule

    model = PipelineModule(pipe_layers(), num_stages=1, loss_fn=token_loss)
    engine, *_ = dsplug.initialize(model=model, config=config(gas * dp, 0))
    engine.load_checkpoint(save_dir)
    step = batches(steps + 1, gas, dp)[steps]
    loss = float(engine.train_batch(iter([pair for micro in step for pair in micro])))
    return loss, _layer_states(model), engine.global_steps


class AddMask(nn.Module):
    """x -> (x, an integer mask): a tuple activation with a tensor that carries no gradient."""

    def forward(self, x):
        return x, (x.sum(-1, keepdim=True) > 0).long()


class MaskedLinear(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, t):
        x, m = t
        return torch.tanh(self.lin(x)) * m + x * (1 - m), m


class Merge(nn.Module):
    def forward(self, t):
        return t[0] * (1 + t[1])


def tuple_layers():
    from dsplug.pipe import LayerSpec

    return [AddMask(), LayerSpec(MaskedLinear, D), LayerSpec(MaskedLinear, D), Merge(), LayerSpec(nn.Linear, D, 1)]


def tuple_data(steps=2, gas=2):
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(MB, D, generator=g), torch.randn(MB, 1, generator=g)) for _m in range(gas)]
            for _s in range(steps)]


def tuple_reference():
    built = []
    for idx, layer in enumerate(tuple_layers()):
        if hasattr(layer, "build"):
            torch.manual_seed(BASE_SEED + idx)
            layer = layer.build()
        built.append(layer)
    params = [p for m in built for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in tuple_data():
        opt.zero_grad()
        total = 0.0
        for x, y in step:
            for layer in built:
                x = layer(x)
            loss = nn.functional.mse_loss(x, y)
            (loss / len(step)).backward()
            total += loss.item() / len(step)
        opt.step()
        losses.append(total)
    return losses


def _tuples_and_refusals():
    """A tuple activation (float + integer mask) crossing the stage boundary trains like the plain
    model; and the settings the pipeline refuses with more than one stage, each named."""
    import dsplug
    from dsplug.pipe import PipelineError, PipelineModule

    model = PipelineModule(tuple_layers(), num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True,
                           base_seed=BASE_SEED, partition_method="uniform")
    engine, *_ = dsplug.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    losses = [float(engine.train_batch(iter(step))) for step in tuple_data()]

    model = PipelineModule(pipe_layers(), num_stages=2, loss_fn=token_loss)
    messages = {}
    for name, cfg in [("zero2", config(1, zero_stage=2)), ("clip", config(1, gradient_clipping=1.0)),
                      ("fp16", config(1, fp16={"enabled": True}))]:
        try:
            dsplug.initialize(model=model, config=cfg)
        except (PipelineError, ValueError) as exc:  # clip / fp16: the kernel's refusal for any mpu
            messages[name] = str(exc)
    try:
        dsplug.initialize(model=model, config=config(1), mpu=model.mpu())
    except PipelineError as exc:
        messages["mpu"] = str(exc)
    engine, *_ = dsplug.initialize(model=model, config=config(1))
    try:
        engine(torch.zeros(1, T, dtype=torch.long))
    except PipelineError as exc:
        messages["forward"] = str(exc)
    return losses, messages


def _check_against_reference(results, dp, steps, gas):
    """Losses, layers and tied weights of every rank against the plain loop; returns its eval loss."""
    ref_losses, ref_layers, ref_eval = reference_run(steps, gas, dp)
    for r in results:
        # the loss is returned on every stage and every replica: the mean over the global batch
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (r["stage"], r["losses"], ref_losses)
        for idx, state in r["layers"].items():
            for key, value in state.items():
                torch.testing.assert_close(value, ref_layers[idx][key], rtol=1e-5, atol=1e-6,
                                           msg=f"layer {idx} {key} on stage {r['stage']}")
    # the tied weight is the same tensor on every stage (bit for bit) and equals the reference's
    tied = [r["tied"] for r in results]
    for t in tied[1:]:
        assert torch.equal(t, tied[0])
    torch.testing.assert_close(tied[0], ref_layers[0]["weight"], rtol=1e-5, atol=1e-6)
    return ref_eval


def test_two_stages_train_like_the_plain_model_with_tied_weights():
    results = run_distributed(_train, 2, 2, 0, STEPS, GAS)
    assert [r["stage"] for r in results] == [0, 1]
    # 'parameters' balance: [embed 128, lin 72, relu 0 | lin 72, relu 0, head 128]
    assert all(r["parts"] == [0, 3, 6] for r in results)
    assert sorted(results[0]["layers"]) == [0, 1, 2] and sorted(results[1]["layers"]) == [3, 4, 5]
    ref_eval = _check_against_reference(results, 1, STEPS, GAS)
    assert results[0]["global_steps"] == STEPS and results[0]["micro_steps"] == STEPS * GAS
    # point-to-point traffic: stage 0 sends each micro-batch's activation (MB x T x D fp32) and, once,
    # its meta message (a length, then [is_tuple, count, dtype, ndim, *shape]); stage 1 sends a
    # gradient of the same size back per micro-batch
    act = MB * T * D * 4
    meta = [("send", 8), ("send", (4 + 3) * 8)]
    sends0 = [o for o in results[0]["p2p"] if o[0] == "send"]
    sends1 = [o for o in results[1]["p2p"] if o[0] == "send"]
    assert sends0 == meta + [("send", act)] * (STEPS * GAS)
    assert sends1 == [("send", act)] * (STEPS * GAS)
    assert sum(b for op, b in results[1]["p2p"] if op == "recv") == sum(b for _, b in sends0)
    # eval: the first batch's mean loss after training, on both stages
    assert results[0]["eval"] == results[1]["eval"] == pytest.approx(ref_eval, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_two_stages_by_two_replicas_train_like_the_plain_model(zero_stage, tmp_path):
    save = str(tmp_path) if zero_stage == 1 else None
    results = run_distributed(_train, 4, 2, zero_stage, STEPS, 2, save)
    # PipeDataParallelTopology: ranks 0, 1 are stage 0 (replicas 0, 1), ranks 2, 3 stage 1
    assert [(r["stage"], r["replica"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the grid's groups (data-parallel, pipe, model-parallel = one replica's stages) and p2p neighbours
    assert [r["groups"] for r in results] == [([0, 1], [0, 2], [0, 2], 0, None, 2),
                                              ([0, 1], [1, 3], [1, 3], 0, None, 3),
                                              ([2, 3], [0, 2], [0, 2], 1, 0, None),
                                              ([2, 3], [1, 3], [1, 3], 1, 1, None)]
    # the engine's context: data-parallel rank / size, model-parallel slice (= stage: the checkpoint's mp_rank)
    assert [r["context"] for r in results] == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    if save is not None:
        # the checkpoint of 2 stages x 2 ZeRO-1 replicas (optimizer state gathered from the partitions)
        # resumes on one process, one stage, and takes the same next step
        loss, layers, steps = run_distributed(_resume_on_one_stage, 1, save, STEPS, 2, 2)[0]
        assert steps == STEPS + 1
        assert loss == pytest.approx(results[0]["resumed"][0], rel=1e-5)
        for r in results:
            for idx, state in r["resumed"][1].items():
                for key, value in state.items():
                    torch.testing.assert_close(layers[idx][key], value, rtol=1e-5, atol=1e-6)
    _check_against_reference(results, 2, STEPS, 2)


def test_tuple_activations_and_refusals():
    (losses, messages), (losses1, _) = run_distributed(_tuples_and_refusals, 2)
    assert losses == losses1 == pytest.approx(tuple_reference(), rel=1e-5)
    assert "zero_optimization.stage 2" in messages["zero2"]
    assert "gradient_clipping" in messages["clip"]
    assert "fp16" in messages["fp16"] and "bf16" in messages["fp16"]
    assert "mpu=None" in messages["mpu"]
    assert "train_batch" in messages["forward"]
