"""Models, data and plain-PyTorch reference loops shared by the engine tests.

The reference loops are written here, independently of dsplug: torch.optim, manual gradient
accumulation, averaging over ranks (by training on the concatenated global batch), clipping with
torch.nn.utils.clip_grad_norm_, and hand-written master-weight handling for fp16 / bf16.
"""
from __future__ import annotations

import copy

import torch

IN, HIDDEN, OUT = 12, 24, 3


def make_model(seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def batch(step: int, micro: int, rank: int, size: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(size, IN, generator=g)
    y = torch.randn(size, OUT, generator=g)
    return x, y


def loss_fn(out, y):
    return ((out.float() - y) ** 2).mean()


def dsplug_run(config: dict, steps: int, optimizer=None, lr_scheduler=None, seed: int = 0, inject=None):
    """Train with dsplug in this process (rank / world from the environment).

    Returns per-step losses (mean over micro-steps, averaged over ranks) and final fp32 params.
    ``inject(engine, step)`` may tamper with gradients before the step (overflow tests).
    """
    import dsplug
    from dsplug import comm

    model = make_model(seed)
    engine, _, _, _ = dsplug.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
    rank, gas, micro = comm.get_rank(), engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses, lrs = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            x, y = batch(step, m, rank, micro)
            loss = loss_fn(engine(x.to(engine.precision.model_dtype)), y)
            engine.backward(loss)
            if inject is not None and m == gas - 1:
                inject(engine, step)
            engine.step()
            total += float(loss.detach())
        t = torch.tensor([total / gas])
        comm.all_reduce(t)
        losses.append(float(t) / comm.get_world_size())
        lrs.append(engine.get_lr()[0])
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    return {"losses": losses, "params": params, "lrs": lrs, "skipped": engine.skipped_steps,
            "scale": engine.get_loss_scale(), "norm": engine.get_global_grad_norm()}


def reference_run(steps: int, world: int, micro: int, gas: int, make_optimizer, *, clip: float = 0.0,
                  precision: str = "fp32", scale: float = 1.0, scheduler=None, seed: int = 0):
    """The same training, written with plain PyTorch on one process over the global batch."""
    model = make_model(seed)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "amp": torch.float32}[precision]
    master = [p.detach().clone().float() for p in model.parameters()]
    work = copy.deepcopy(model).to(dtype)
    opt = make_optimizer(master if precision in ("fp16", "bf16") else list(work.parameters()))
    sched = scheduler(opt) if scheduler is not None else None
    trainable = master if precision in ("fp16", "bf16") else list(work.parameters())
    losses, lrs = [], []
    for step in range(steps):
        accum = [torch.zeros_like(p, dtype=torch.float32) for p in trainable]
        total = 0.0
        for m in range(gas):
            xs, ys = zip(*(batch(step, m, r, micro) for r in range(world)))
            x, y = torch.cat(xs), torch.cat(ys)
            if precision == "amp":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = work(x)
            else:
                out = work(x.to(dtype))
            # mean over the global batch == average over ranks of each rank's mean
            per_rank = [loss_fn(o, yy) for o, yy in zip(out.chunk(world), y.chunk(world))]
            loss = torch.stack(per_rank).mean()
            total += float(loss.detach())
            (loss / gas * scale).backward()
            for a, p in zip(accum, work.parameters()):
                a.add_(p.grad.float())
                p.grad = None
        for t, a in zip(trainable, accum):
            t.grad = a / scale
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if precision in ("fp16", "bf16"):
            with torch.no_grad():
                for p, m in zip(work.parameters(), master):
                    p.copy_(m)
        losses.append(total / gas)
        lrs.append(opt.param_groups[0]["lr"])
    params = [m.clone() for m in master] if precision in ("fp16", "bf16") else \
        [p.detach().float().clone() for p in work.parameters()]
    return {"losses": losses, "params": params, "lrs": lrs}


def assert_close_runs(got, want, rtol=1e-5, atol=1e-6):
    import numpy as np

    np.testing.assert_allclose(got["losses"], want["losses"], rtol=rtol, atol=atol)
    assert len(got["params"]) == len(want["params"]) > 0
    for a, b in zip(got["params"], want["params"]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
