"""The CUDA / NCCL paths of the engine and of the native ops' device fallbacks (marker ``cuda``).

Skipped without a GPU; on a GPU machine ``pytest -m cuda tests/core/test_cuda_paths.py`` (which
``benchmarks/device_check.sh`` runs). Engine runs go through a real process with a world of one
over NCCL (the backend the CUDA accelerator plugin names); references are plain torch
(torch.optim, the same model without checkpointing, the same op on the CPU) or the stage-0 run.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist_harness import run_distributed

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")]

VOCAB, SEQ, STEPS = 64, 32, 8
LR = 1e-2


def _lm(seed: int = 0):
    from dsplug.plugins.train.model import CharTransformer, ModelConfig

    torch.manual_seed(seed)
    return CharTransformer(ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_layers=2, n_heads=4))


def _batch(step: int, device, batch: int = 8):
    """A learnable sequence: next token = (5 * token + 7) mod VOCAB, from random starts."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.empty(batch, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 7) % VOCAB
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _config(precision: str, zero: dict) -> dict:
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.0}},
              "zero_optimization": zero}
    if precision == "fp16":  # dynamic scaling started high: the first steps overflow, are skipped, the scale halves
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 24, "hysteresis": 1}
    else:
        config[precision] = {"enabled": True}
    return config


def _train(precision: str, zero: dict) -> dict:
    """In a rank process: train STEPS applied steps; losses and where things ran."""
    import torch.distributed as dist

    import dsplug
    from dsplug.plugins.train.model import next_token_loss

    engine, *_ = dsplug.initialize(model=_lm(), config=_config(precision, zero))
    losses, scales, step = [], [], 0
    while step - engine.skipped_steps < STEPS and step < STEPS + 12:
        x, y = _batch(step, engine.device)
        loss = next_token_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        scales.append(float(engine.precision.loss_scale))
        step += 1
    stage = engine.stage
    host = []  # the host buffers of an offloading stage
    if getattr(stage, "offload", None) is not None and hasattr(stage, "opt_params"):
        host += list(stage.opt_params) + list(stage.offload.host_grads.values())
    if hasattr(stage, "partitioner") and zero.get("offload_param"):
        host += [p.ds_tensor for p in engine.module.parameters()]
        host += [g.host_master for g in stage.groups if getattr(g, "host_master", None) is not None]
    out = {"losses": losses, "scales": scales, "skipped": int(engine.skipped_steps), "backend": dist.get_backend(),
           "device": str(engine.device), "optimizer": type(engine.basic_optimizer).__name__,
           "host": [(t.device.type, bool(t.is_pinned())) for t in host]}
    engine.destroy()
    return out


def _stages(precision: str) -> dict:
    return {s: _train(precision, {"stage": s}) for s in (0, 1, 2, 3)}


def _offloads() -> dict:
    pinned_cpu = {"device": "cpu", "pin_memory": True}
    return {"reference": _train("bf16", {"stage": 0}),
            "stage 2": _train("bf16", {"stage": 2, "offload_optimizer": dict(pinned_cpu)}),
            "stage 3": _train("bf16", {"stage": 3, "offload_optimizer": dict(pinned_cpu),
                                       "offload_param": dict(pinned_cpu)})}


def _assert_trains(run: dict) -> None:
    losses = run["losses"]
    assert all(math.isfinite(x) for x in losses), losses
    assert min(losses[-3:]) < 0.95 * losses[0], f"loss not falling: {losses}"
    assert run["backend"] == "nccl"
    assert run["device"].startswith("cuda")


def _close(a, b, tol: float) -> None:
    assert len(a) == len(b)
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst <= tol, f"losses differ by {worst:.2e} (> {tol}): {a} vs {b}"


@pytest.mark.parametrize("precision,tol", [("bf16", 2e-2), ("fp16", 1e-2)])
def test_zero_stages_over_nccl_train_like_stage_0(precision, tol):
    runs = run_distributed(_stages, 1, precision)[0]
    for stage, run in runs.items():
        _assert_trains(run)
        assert run["skipped"] == runs[0]["skipped"], f"stage {stage}"
        _close(run["losses"], runs[0]["losses"], tol)
    if precision == "fp16":
        assert runs[0]["skipped"] >= 1, "2**24 should overflow fp16 gradients at the first step"
        assert runs[0]["scales"][-1] < 2 ** 24


def test_cpu_offload_with_pinned_memory_trains_like_stage_0():
    runs = run_distributed(_offloads, 1)[0]
    for name in ("stage 2", "stage 3"):
        run = runs[name]
        _assert_trains(run)
        _close(run["losses"], runs["reference"]["losses"], 2e-2)
        assert run["optimizer"] == "DeepSpeedCPUAdam", name
        assert run["host"], f"{name}: no host buffers found"
        assert all(device == "cpu" and pinned for device, pinned in run["host"]), f"{name}: {run['host']}"


def _adam_pair(ours, reference, device, dtype=torch.float32, steps: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    shapes = [(129, 65), (1000,), (7, 3, 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    a = [t.to(device, dtype).requires_grad_() for t in init]
    b = [t.to(device, dtype).requires_grad_() for t in init]
    opt_a, opt_b = ours(a), reference(b)
    for step_grads in grads:
        for p, q, gr in zip(a, b, step_grads):
            p.grad, q.grad = gr.to(device, dtype), gr.to(device, dtype)
        opt_a.step()
        opt_b.step()
    return max(float((p.detach().double() - q.detach().double()).norm() / q.detach().double().norm())
               for p, q in zip(a, b))


HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize("fused_kernel", [True, False], ids=["fused-kernel", "foreach"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adam_on_cuda_matches_torch(fused_kernel, decoupled):
    from dsplug.ops.adam import FusedAdam

    def ours(params):
        opt = FusedAdam(params, adam_w_mode=decoupled, **HYPER)
        opt.use_fused_kernel = fused_kernel
        return opt

    reference = torch.optim.AdamW if decoupled else torch.optim.Adam
    assert _adam_pair(ours, lambda ps: reference(ps, foreach=False, **HYPER), "cuda") < 1e-5


def test_cpu_adam_on_pinned_host_tensors_matches_torch_adamw():
    from dsplug.ops.adam import DeepSpeedCPUAdam

    def ours(params):
        for p in params:
            p.data = p.data.pin_memory()
        assert all(p.is_pinned() for p in params)
        return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)

    assert _adam_pair(ours, lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER), "cpu") < 1e-6


@pytest.mark.parametrize("bits,groups,symmetric", [(8, 16, True), (4, 64, False)])
def test_quantizer_on_cuda_matches_the_cpu(bits, groups, symmetric):
    from dsplug.ops.quantize import quantize_dequantize

    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)) * 3
    on_cpu = quantize_dequantize(x, bits, groups=groups, symmetric=symmetric)
    on_gpu = quantize_dequantize(x.cuda(), bits, groups=groups, symmetric=symmetric)
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == x.dtype
    # the GPU's fused multiply-add leaves the dequantized values a few ulps apart (1.9e-6 at |x| ~ 10 on an
    # H100); a different rounding decision would move an element by a whole quantization step
    step = float((x.view(groups, -1).amax(1) - x.view(groups, -1).amin(1)).max()) / (2 ** bits - 1)
    differ = (on_gpu.cpu() - on_cpu).abs() > 1e-3 * step
    assert float(differ.float().mean()) <= 1e-3  # a rounding tie may land apart, nothing more


def _checkpointed_grads(checkpointed: bool):
    from dsplug import checkpointing
    from dsplug.plugins.train.model import next_token_loss

    model = _lm().cuda()
    x, y = _batch(0, "cuda")
    h = model.token_embedding(x) + model.position_embedding(torch.arange(SEQ, device="cuda"))
    for block in model.blocks:
        h = checkpointing.checkpoint(block, h) if checkpointed else block(h)
    loss = next_token_loss(model.head(model.ln_final(h)), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("settings", [{}, {"checkpoint_in_cpu": True},
                                      {"partition_activations": True, "contiguous_checkpointing": True,
                                       "num_checkpoints": 2, "checkpoint_in_cpu": True}],
                         ids=["on-device", "cpu", "contiguous-pinned"])
def test_activation_checkpointing_on_cuda_matches_the_plain_model(settings):
    from dsplug import checkpointing

    loss0, grads0 = _checkpointed_grads(False)
    checkpointing.configure(None, **settings)
    try:
        loss, grads = _checkpointed_grads(True)
    finally:
        checkpointing.configure(None)
    assert loss == pytest.approx(loss0, rel=1e-6)
    for name, g in grads0.items():
        assert float((grads[name] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-8, name
