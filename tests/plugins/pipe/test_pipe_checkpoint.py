"""Pipeline checkpoints over real processes: saved at 2 stages, reloaded at 1 stage (and the other
way round) and at the same layout, each resumed run continuing exactly like the uninterrupted one."""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.plugins.pipe.test_pipe_train import BASE_SEED, GAS, LR, batches, pipe_layers, token_loss

pytestmark = pytest.mark.multiprocess


def ckpt_config(zero_stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                          "warmup_num_steps": 5}},
            "zero_optimization": {"stage": zero_stage}}


def _engine(num_stages, zero_stage):
    import dsplug
    from dsplug.pipe import PipelineModule

    model = PipelineModule(pipe_layers(), num_stages=num_stages, loss_fn=token_loss, seed_layers=True,
                           base_seed=BASE_SEED)
    engine, *_ = dsplug.initialize(model=model, config=ckpt_config(zero_stage))
    return engine, model


def _steps(engine, n, total):
    data = batches(total, GAS, 1)
    losses = []
    for _ in range(n):
        step = data[engine.global_steps]
        losses.append(float(engine.train_batch(iter([micro[0] for micro in step]))))
    return losses


def _state(engine, model):
    layers = {idx: {k: v.detach().clone() for k, v in layer.state_dict().items()}
              for idx, layer in model.local_layer_modules()}
    return {"layers": layers, "lr": engine.get_lr(), "global_steps": engine.global_steps}


def _run(num_stages, zero_stage, plan):
    """``plan``: a list of ("load", dir, tag) / ("save", dir, client) / ("train", n) / ("new",) steps;
    returns the losses of each train step and the state at the end of each engine."""
    engine, model = _engine(num_stages, zero_stage)
    out = {"losses": [], "states": [], "loaded": []}
    for item in plan:
        if item[0] == "new":
            out["states"].append(_state(engine, model))
            engine, model = _engine(num_stages, zero_stage)
        elif item[0] == "load":
            path, client = engine.load_checkpoint(item[1], tag=item[2])
            out["loaded"].append((os.path.basename(path), client.get("note"), engine.global_steps))
        elif item[0] == "save":
            engine.save_checkpoint(item[1], client_state={"note": item[2]})
        else:
            out["losses"].append(_steps(engine, item[1], 4))
    out["states"].append(_state(engine, model))
    return out


def _merge(results):
    """Layer states of every stage of a run, by layer index."""
    layers = {}
    for r in results:
        layers.update(r["states"][-1]["layers"])
    return layers


def _assert_same(layers, expected):
    assert sorted(layers) == sorted(expected)
    for idx in expected:
        for key, value in expected[idx].items():
            torch.testing.assert_close(layers[idx][key], value, rtol=2e-5, atol=1e-6, msg=f"layer {idx} {key}")


@pytest.mark.slow
def test_checkpoint_saved_at_two_stages_reloads_at_one_and_back(tmp_path):
    a, b = str(tmp_path / "two"), str(tmp_path / "one")
    # uninterrupted at 2 stages (ZeRO 1): 2 steps, save, 2 more
    two = run_distributed(_run, 2, 2, 1, [("train", 2), ("save", a, "from-two"), ("train", 2)])
    expected_losses = two[0]["losses"][1]
    assert two[0]["losses"] == two[1]["losses"]
    expected = _merge(two)
    files = sorted(os.listdir(os.path.join(a, "global_step2")))
    for idx in range(6):
        assert f"layer_{idx:02d}-model_states.pt" in files and f"layer_{idx:02d}-optim_states.pt" in files
    assert "pipe_stage_00-layers.json" in files and "pipe_stage_01-layers.json" in files
    # DeepSpeed's per-layer file is the layer's own state dict
    lin = torch.nn.Linear(8, 8)
    lin.load_state_dict(torch.load(os.path.join(a, "global_step2", "layer_01-model_states.pt"), weights_only=True))

    # one stage (ZeRO 0) resumes the 2-stage checkpoint, saves it again at once, and continues
    one = run_distributed(_run, 1, 1, 0, [("load", a, None), ("save", b, "from-one"), ("train", 2)])[0]
    assert one["loaded"] == [("global_step2", "from-two", 2)]
    assert one["losses"][0] == pytest.approx(expected_losses, rel=1e-5)
    _assert_same(one["states"][-1]["layers"], expected)
    assert one["states"][-1]["lr"] == pytest.approx(two[0]["states"][-1]["lr"])

    # two stages (ZeRO 1) resume the 1-stage checkpoint; then a fresh engine the 2-stage one (same layout)
    back = run_distributed(_run, 2, 2, 1, [("load", b, "global_step2"), ("train", 2), ("new",),
                                           ("load", a, "global_step2"), ("train", 2)])
    for r in back:
        assert [l[2] for l in r["loaded"]] == [2, 2] and [l[1] for l in r["loaded"]] == ["from-one", "from-two"]
        assert r["losses"][0] == pytest.approx(expected_losses, rel=1e-5)
        assert r["losses"][1] == pytest.approx(expected_losses, rel=1e-6)
    _assert_same({k: v for r in back for k, v in r["states"][0]["layers"].items()}, expected)
    _assert_same(_merge(back), expected)


def _load_error(path):
    """Load ``path`` at 2 stages (ZeRO 1); the error's type and message, or None."""
    engine, _model = _engine(2, 1)
    try:
        engine.load_checkpoint(path, tag="global_step1")
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
def test_layer_files_are_in_the_manifest_and_a_corrupted_one_is_caught_on_load(tmp_path):
    import json

    from dsplug import checkpoint as ckpt

    saved = str(tmp_path / "one")
    run_distributed(_run, 1, 1, 0, [("train", 1), ("save", saved, "one")])
    tag_dir = os.path.join(saved, "global_step1")
    listed = json.loads(open(os.path.join(tag_dir, "manifest.json")).read())["files"]
    layer_files = [f for f in os.listdir(tag_dir) if f.startswith("layer_")]
    assert len(layer_files) == 2 * 6 and "pipe_stage_00-layers.json" in listed  # weights + optimizer, 6 layers
    assert set(layer_files) <= set(listed)
    assert ckpt.verify(tag_dir) == []

    victim = os.path.join(tag_dir, "layer_01-model_states.pt")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    assert [p for p in ckpt.verify(tag_dir) if "layer_01-model_states.pt" in p]

    # 2 stages read the 1-stage checkpoint layer by layer: the corrupted file stops every rank
    for rank, error in enumerate(run_distributed(_load_error, 2, saved)):
        assert error is not None and error[0] == "CheckpointError", f"rank {rank}: {error}"
        assert "layer_01-model_states.pt" in error[1] and "manifest" in error[1], f"rank {rank}: {error[1]}"
