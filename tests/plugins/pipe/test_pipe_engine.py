"""The pipeline engine in one process (one stage) and the point-to-point protocol: activation
checkpointing, tuples with integer tensors, eval_batch's forms, the meta message, bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dsplug.plugins.pipe import p2p
from dsplug.plugins.pipe.module import LayerSpec, PipelineError, PipelineModule


@pytest.fixture(autouse=True)
def _forget_the_grid():
    """An engine built here leaves its grid as the process's mpu: forget it for the next tests."""
    yield
    from dsplug.utils import groups

    groups._reset_for_tests()


def flatten(x):
    """A plain function as a layer (no parameters)."""
    return x.reshape(x.shape[0], -1)


def layers():
    return [LayerSpec(nn.Linear, 6, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 8), nn.Tanh(), flatten,
            LayerSpec(nn.Linear, 8, 3)]


def reference(seed=99):
    built = []
    for idx, layer in enumerate(layers()):
        if isinstance(layer, LayerSpec):
            torch.manual_seed(seed + idx)
            built.append(layer.build())
        else:
            built.append(layer)
    return built


def data(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def engine_for(interval=0, zero=0, gas=2, checkpoint_func=None):
    import dsplug

    extra = {"activation_checkpoint_func": checkpoint_func} if checkpoint_func is not None else {}
    model = PipelineModule(layers(), num_stages=1, loss_fn=nn.functional.mse_loss, seed_layers=True, base_seed=99,
                           activation_checkpoint_interval=interval, **extra)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_optimization": {"stage": zero}}
    engine, *_ = dsplug.initialize(model=model, config=cfg)
    return engine, model


@pytest.mark.parametrize("interval,checkpointed", [(0, 0), (1, 3), (4, 2)])
def test_one_stage_trains_like_a_plain_loop_with_and_without_activation_checkpointing(interval, checkpointed):
    from dsplug.checkpointing import checkpoint

    calls = []

    def spy(function, *args):  # the default function, counted
        calls.append(function)
        return checkpoint(function, *args)

    engine, model = engine_for(interval, checkpoint_func=spy)
    ref = reference()
    params = [p for m in ref if isinstance(m, nn.Module) for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    batches = data(6)
    for step in range(3):
        micro = batches[2 * step:2 * step + 2]
        got = float(engine.train_batch(iter(micro)))
        opt.zero_grad()
        want = 0.0
        for x, y in micro:
            for f in ref:
                x = f(x)
            loss = nn.functional.mse_loss(x, y)
            (loss / 2).backward()
            want += loss.item() / 2
        opt.step()
        assert got == pytest.approx(want, rel=1e-6)
    for idx, module in model.local_layer_modules():
        for key, value in module.state_dict().items():
            torch.testing.assert_close(value, ref[idx].state_dict()[key], rtol=1e-6, atol=1e-7)
    # chunks with parameters are checkpointed: interval 1 -> the three Linears; 4 -> both chunks
    assert len(calls) == checkpointed * 6


def test_default_checkpoint_function_comes_from_the_activation_checkpointing_plugin(monkeypatch):
    """Without activation_checkpoint_func the chunks run under the function the plugin answering
    dsplug_activation_checkpoint_function provides; with none installed the error says so."""
    import dsplug.registry as registry_module
    from dsplug.plugins.pipe.module import checkpoint

    calls = []
    provided = registry_module.get_registry().pm.hook.dsplug_activation_checkpoint_function()
    assert provided is not None and provided.__module__ == "dsplug.plugins.activation_checkpointing.checkpointing"

    losses = {}
    for interval in (0, 2):
        engine, _model = engine_for(interval)
        if interval:
            monkeypatch.setattr(provided.__module__ + ".checkpoint",
                                lambda f, *a: calls.append(f) or provided(f, *a))
        batches = data(4)
        losses[interval] = [float(engine.train_batch(iter(batches[2 * i:2 * i + 2]))) for i in range(2)]
        engine.destroy()
    assert losses[2] == losses[0] and len(calls) == 2 * 2 * 3  # 2 steps x 2 micro-batches x 3 chunks (each has a Linear)

    blocked = registry_module.Registry(blocked=("observer-activation-checkpointing",))
    monkeypatch.setattr(registry_module, "get_registry", lambda: blocked)
    with pytest.raises(PipelineError, match="no installed plugin provides one"):
        checkpoint(lambda x: x, torch.ones(1))


def test_eval_batch_forms():
    engine, model = engine_for()
    batches = data(2)
    with torch.no_grad():
        outs = [model(x) for x, _ in batches]
    losses = [nn.functional.mse_loss(o, y) for o, (_, y) in zip(outs, batches)]
    assert float(engine.eval_batch(iter(batches))) == pytest.approx(float(sum(losses) / 2))
    listed = engine.eval_batch(iter(batches), reduce_output=None)
    assert [float(v) for v in listed] == pytest.approx([float(l) for l in losses])
    value, logits = engine.eval_batch(iter(batches), return_logits=True)
    assert len(logits) == 2 and torch.allclose(logits[1], outs[1])
    mean_output = engine.eval_batch(iter(batches), compute_loss=False)
    torch.testing.assert_close(mean_output, (outs[0] + outs[1]) / 2)
    three = engine.eval_batch(iter(data(3)), num_micro_batches=3, reduce_output=None)
    assert len(three) == 3
    with pytest.raises(PipelineError, match="reduce_output='sum'"):
        engine.eval_batch(iter(batches), reduce_output="sum")


def test_bad_input_is_named():
    engine, _ = engine_for()
    with pytest.raises(PipelineError, match="pair \\(inputs, labels\\), got Tensor"):
        engine.train_batch(iter([torch.zeros(4, 6)] * 2))
    with pytest.raises(PipelineError, match="no data"):
        engine_for()[0].train_batch()
    with pytest.raises(PipelineError, match="train_batch"):
        engine.step()
    with torch.no_grad(), pytest.raises(PipelineError, match="requires gradients"):
        engine.train_batch(iter(data(2)))


def test_zero_stage_2_and_3_are_refused():
    import dsplug

    model = PipelineModule(layers(), num_stages=1, loss_fn=nn.functional.mse_loss)
    for stage in (2, 3):
        with pytest.raises(PipelineError, match=f"zero_optimization.stage {stage} cannot be combined"):
            dsplug.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                                                   "zero_optimization": {"stage": stage}})


def test_module_arguments_are_checked():
    with pytest.raises(PipelineError, match="num_stages=2 must divide the world size 1"):
        PipelineModule(layers(), num_stages=2)
    with pytest.raises(PipelineError, match="give num_stages or topology"):
        PipelineModule(layers())
    with pytest.raises(PipelineError, match="has no parameter 'kernel'"):
        from dsplug.pipe import TiedLayerSpec

        PipelineModule([TiedLayerSpec("t", nn.Linear, 2, 2, tied_weight_attr="kernel")], num_stages=1)


# ------------------------------------------------------------------ the link protocol
class FakeComm:
    """Point-to-point ops into per-destination queues (one process plays both ends)."""

    def __init__(self):
        self.queue = []

    def isend(self, tensor, dst):
        self.queue.append(tensor.clone())

        class Done:
            def wait(self):
                return True

        return Done()

    def recv(self, tensor, src=None):
        tensor.copy_(self.queue.pop(0))
        return src


def test_meta_round_trip_and_activation_transfer():
    meta = p2p.meta_of((torch.zeros(2, 3), torch.zeros(5, dtype=torch.int64), torch.zeros((), dtype=torch.bfloat16)))
    assert p2p.decode(p2p.encode(meta)) == meta
    comm = FakeComm()
    sender, receiver = p2p.Link(comm, 1, "cpu"), p2p.Link(comm, 0, "cpu")
    value = (torch.randn(2, 3), torch.arange(4))
    sender.send_activation(value)
    got = receiver.recv_activation()
    assert torch.equal(got[0], value[0]) and torch.equal(got[1], value[1])
    assert got[0].requires_grad and not got[1].requires_grad  # integers carry no gradient
    sender.send_activation((torch.ones(2, 3), torch.arange(4)))  # the same shapes: no meta this time
    assert len(comm.queue) == 2
    with pytest.raises(PipelineError, match=r"changed from \(float32\[2, 3\], int64\[4\]\) to \(float32\[3, 3\]"):
        sender.send_activation((torch.ones(3, 3), torch.arange(4)))
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        sender.send_activation((torch.ones(1), "text"))


def test_dynamic_shape_describes_every_activation():
    comm = FakeComm()
    sender, receiver = p2p.Link(comm, 1, "cpu", dynamic_shape=True), p2p.Link(comm, 0, "cpu", dynamic_shape=True)
    for rows in (2, 5, 1):
        sender.send_activation(torch.full((rows, 2), float(rows)))
        got = receiver.recv_activation()
        assert got.shape == (rows, 2) and float(got.detach()[0, 0]) == rows


def test_training_data_given_to_initialize_feeds_train_batch():
    import dsplug
    from torch.utils.data import TensorDataset

    model = PipelineModule(layers(), num_stages=1, loss_fn=nn.functional.mse_loss)
    dataset = TensorDataset(torch.randn(16, 6), torch.randn(16, 3))
    engine, _, loader, _ = dsplug.initialize(model=model, training_data=dataset, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert loader is not None and len(loader) == 4
    seen = []
    engine.set_batch_fn(lambda batch: seen.append(batch) or batch)
    for _ in range(4):  # 8 micro-batches: the loader's epochs 0 and 1
        engine.train_batch()
    assert engine.global_steps == 4 and len(seen) == 8
    for got, want in zip(seen[4:], list(loader)):  # the sampler is at epoch 1 now
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
