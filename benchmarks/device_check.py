"""The GPU device check: dsplug's CUDA / NCCL paths, each proven against a reference, timed beside
torch DDP and FSDP2 on the same GPU. Started by ``benchmarks/device_check.sh`` (which installs
dsplug from the working tree first and tees everything to ``$OUT/device_check.log``).

    python benchmarks/device_check.py                     # every check, on the GPU (NCCL, world 1)
    python benchmarks/device_check.py --only stages_bf16,ops_cuda
    DEVICE_CHECK_DRY=1 python benchmarks/device_check.py  # every check on CPU / gloo, tiny sizes

Each check runs in its own process with its own timeout (a hang or a CUDA error costs that check
only), prints its numbers and a PASS / FAIL / SKIP line with the reason, and the run ends with a
summary and a step-time table (dsplug's stages beside DDP and FSDP2). The whole run stays inside
``DEVICE_CHECK_BUDGET_S`` seconds (default 420): a check gets at most what is left of it.

Checks (the names ``--only`` takes):

* ``env``          torch / CUDA / NCCL / cuDNN versions, the device, the accelerator dsplug picks
                   and ``dsplug report`` (toolchain and native-op status).
* ``native_ops``   ``dsplug build-ops cpu_adam quantizer`` (ninja + pybind11); when the toolchain
                   is missing the ops run their pure-torch fallbacks and this says so.
* ``stages_bf16``  the engine at ZeRO stages 0-3, bf16, on the built-in transformer LM, world 1 over
  ``stages_fp16``  NCCL: losses finite and falling, stages 1-3 equal to stage 0 within tolerance;
                   fp16 with dynamic loss scaling (skipped steps and the scale are printed).
* ``offload``      stage 2 with ``offload_optimizer: cpu`` and stage 3 with ``offload_param`` and
                   ``offload_optimizer`` on cpu, ``pin_memory: true``: the host buffers are pinned,
                   the optimizer is DeepSpeedCPUAdam (cpu_adam), losses equal stage 0's, and the
                   GPU holds less than without offloading.
* ``checkpoint``   save at step 3 and resume in a fresh engine (bf16, stages 0, 2, 3): the same
                   losses as the uninterrupted run, the state back on the GPU.
* ``baselines``    torch DDP (fp32 weights, bf16 autocast) and FSDP2 ``fully_shard`` (bf16 params,
                   fp32 reduce) on the same model, data and optimizer hyper-parameters.
* ``ops_cuda``     FusedAdam on CUDA tensors = torch.optim.AdamW / Adam (fused-kernel and foreach
                   paths), FusedLamb on CUDA = on CPU, the quantizer on CUDA tensors (torch path) =
                   on CPU (native when built), DeepSpeedCPUAdam on pinned host tensors = AdamW.
* ``activation_checkpointing``  ``dsplug.checkpointing.checkpoint`` on the GPU: loss and gradients
                   equal the plain model's (also with checkpoint_in_cpu, and with contiguous pinned
                   host buffers), less peak memory, and the engine with the checkpointed model.
* ``comm_volume``  ``benchmarks/comm_volume.py --worlds 1`` (the comm layer's listener, memory
                   breakdown vs estimate) on the NCCL group.
* ``pytest_cuda``  ``pytest -m cuda tests/core/test_cuda_paths.py``.

The model: ``dsplug.plugins.train.model.CharTransformer`` on a learnable synthetic sequence
(next token = (5 * token + 7) mod vocab), AdamW, gradient clipping 1.0, constant learning rate.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
DRY = os.environ.get("DEVICE_CHECK_DRY", "") not in ("", "0")
BUDGET_S = float(os.environ.get("DEVICE_CHECK_BUDGET_S", "420"))

#: model and run sizes: on the GPU (~60M parameters) and in the dry run (CPU, a few seconds each)
REAL = dict(vocab=256, seq=256, d_model=768, layers=8, heads=12, batch=16, steps=14, warmup=4, lr=2e-3,
            ckpt_batch=32)
TINY = dict(vocab=64, seq=16, d_model=32, layers=2, heads=4, batch=4, steps=8, warmup=2, lr=1e-2, ckpt_batch=4)
S = TINY if DRY else REAL

#: how far a stage's loss may be from stage 0's at the same step (relative)
STAGE_TOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}
#: fp16 runs start their dynamic loss scale at 2**this (hysteresis 1): the first steps' gradients
#: overflow in fp16, so the skip-and-halve path runs before training goes on
FP16_SCALE_POWER = 24
#: at most this many steps are added to make up for skipped ones
MAKE_UP = 12
#: "falling": the lowest of the last three losses is below the first by at least this fraction
FALL = 0.05


# ================================================================================ shared helpers
def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "device_check_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def expected_device() -> str:
    return "cpu" if DRY else "cuda"


def expected_backend() -> str:
    return "gloo" if DRY else "nccl"


def say(text: str = "") -> None:
    print(text, flush=True)


def make_lm(seed: int = 0):
    import torch

    from dsplug.plugins.train.model import CharTransformer, ModelConfig

    torch.manual_seed(seed)
    return CharTransformer(ModelConfig(vocab_size=S["vocab"], seq_len=S["seq"], d_model=S["d_model"],
                                       n_layers=S["layers"], n_heads=S["heads"]))


def lm_batch(step: int, device, batch: Optional[int] = None):
    """(inputs, targets) of step ``step``: rows of the sequence t -> (5 t + 7) mod vocab from random
    starts (the same for every run of the same step)."""
    import torch

    batch = batch or S["batch"]
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.empty(batch, S["seq"] + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, S["vocab"], (batch,), generator=g)
    for t in range(S["seq"]):
        tokens[:, t + 1] = (5 * tokens[:, t] + 7) % S["vocab"]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(logits, targets):
    from dsplug.plugins.train.model import next_token_loss

    return next_token_loss(logits, targets)


def synchronize() -> None:
    import torch

    if torch.cuda.is_available() and not DRY:
        torch.cuda.synchronize()


def reset_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available() and not DRY:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mib() -> Optional[float]:
    import torch

    if torch.cuda.is_available() and not DRY:
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return None


def falling(losses: List[float]) -> bool:
    return len(losses) >= 4 and min(losses[-3:]) < losses[0] * (1 - FALL)


def rel_diff(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a, b))


def fmt_losses(losses: List[float]) -> str:
    return " ".join(f"{x:.4f}" for x in losses)


def engine_config(precision: str, zero: Dict[str, Any]) -> Dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": S["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": S["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                         "weight_decay": 0.0}},
              "zero_optimization": dict(zero)}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":  # dynamic loss scaling, started high enough to overflow (skip + halve) early
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": FP16_SCALE_POWER, "hysteresis": 1}
    return config


def train_engine(label: str, precision: str, zero: Dict[str, Any], model=None, forward=None,
                 extra_config: Optional[Dict[str, Any]] = None, inspect: Optional[Callable] = None) -> Dict[str, Any]:
    """Train the LM with dsplug for S["steps"] steps; losses, step times, peak memory and facts."""
    import torch
    import torch.distributed as dist

    import dsplug

    reset_memory()
    model = model if model is not None else make_lm()
    config = engine_config(precision, zero)
    config.update(extra_config or {})
    engine, *_ = dsplug.initialize(model=model, config=config)
    facts = {"backend": dist.get_backend() if dist.is_initialized() else "none",
             "device": str(engine.device), "accelerator": engine.accelerator.name,
             "optimizer": type(engine.basic_optimizer).__name__,
             "op_backend": getattr(getattr(engine.basic_optimizer, "op", None), "backend", None)}
    losses, times, scales = [], [], []
    step = 0
    # S["steps"] applied steps: fp16 steps skipped for an overflow are made up (at most MAKE_UP of them)
    while step - engine.skipped_steps < S["steps"] and step < S["steps"] + MAKE_UP:
        x, y = lm_batch(step, engine.device)
        synchronize()
        start = time.perf_counter()
        logits = forward(engine, x) if forward is not None else engine(x)
        loss = lm_loss(logits, y)
        engine.backward(loss)
        engine.step()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss.detach()))
        scales.append(float(engine.precision.loss_scale))
        step += 1
    if inspect is not None:
        facts.update(inspect(engine))
    row = {"label": label, "precision": precision, "losses": losses, "times_ms": times,
           "ms": statistics.median(times[-(S["steps"] - S["warmup"]):]), "peak_mib": peak_mib(),
           "skipped": int(engine.skipped_steps),
           "loss_scales": scales, **facts}
    engine.destroy()
    del engine, model
    reset_memory()
    peak = f", peak {row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else ""
    scale = f", skipped {row['skipped']}, loss scale {scales[0]:g} -> {scales[-1]:g}" if precision == "fp16" else ""
    say(f"  {label:<34} {row['ms']:8.2f} ms/step{peak}{scale}  [{facts['backend']}, {facts['device']}, "
        f"{facts['optimizer']}]")
    say(f"    losses: {fmt_losses(losses)}")
    return row


def check_row(row: Dict[str, Any], reference: Optional[Dict[str, Any]], tol: float) -> List[str]:
    """What is wrong with a training run (empty: nothing)."""
    problems = []
    if not all(math.isfinite(x) for x in row["losses"]):
        problems.append(f"{row['label']}: non-finite loss")
    elif not falling(row["losses"]):
        problems.append(f"{row['label']}: loss not falling ({row['losses'][0]:.4f} -> {row['losses'][-1]:.4f})")
    if row["backend"] != expected_backend():
        problems.append(f"{row['label']}: process group backend {row['backend']!r}, expected {expected_backend()!r}")
    if not row["device"].startswith(expected_device()):
        problems.append(f"{row['label']}: engine device {row['device']}, expected {expected_device()}")
    if reference is not None and reference is not row:
        diff = rel_diff(row["losses"], reference["losses"])
        if diff > tol:
            problems.append(f"{row['label']}: losses differ from {reference['label']}'s by {diff:.2e} (> {tol:g})")
        if row["skipped"] != reference["skipped"]:
            problems.append(f"{row['label']}: {row['skipped']} skipped steps, {reference['label']} "
                            f"{reference['skipped']}")
    return problems


def verdict(problems: List[str], ok: str) -> Tuple[str, str]:
    return ("FAIL", "; ".join(problems)) if problems else ("PASS", ok)


# ================================================================================ the checks
def check_env():
    import torch

    say(f"python {sys.version.split()[0]} ({sys.executable})")
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
    data = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        data.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1), sms=props.multi_processor_count)
        say(f"device {props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2 ** 30:.1f} GiB, "
            f"{props.multi_processor_count} SMs, bf16 supported {torch.cuda.is_bf16_supported()}")
        try:
            data["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - reported
            data["nccl"] = f"unknown ({exc})"
        data["cudnn"] = torch.backends.cudnn.version()
        say(f"NCCL {data['nccl']}, cuDNN {data['cudnn']}")
    dist = torch.distributed
    say(f"torch.distributed: nccl {dist.is_nccl_available()}, gloo {dist.is_gloo_available()}")
    import dsplug
    from dsplug.accelerator import get_accelerator

    accel = get_accelerator()
    data.update(dsplug=dsplug.__file__, accelerator=accel.name, comm_backend=accel.communication_backend_name())
    say(f"dsplug {dsplug.__file__}; accelerator {accel.name}, backend {accel.communication_backend_name()}")
    report = subprocess.run([sys.executable, "-m", "dsplug.cli", "report"], capture_output=True, text=True,
                            timeout=60)
    say(report.stdout.rstrip())
    if report.returncode:
        say(report.stderr.rstrip())
    problems = []
    if accel.name != expected_device():
        problems.append(f"dsplug picked the {accel.name!r} accelerator, expected {expected_device()!r}")
    if not DRY and not torch.distributed.is_nccl_available():
        problems.append("torch has no NCCL")
    if report.returncode:
        problems.append(f"dsplug report exited {report.returncode}")
    return (*verdict(problems, f"accelerator {accel.name}, backend {accel.communication_backend_name()}"), data)


def check_native_ops():
    ops = ["cpu_adam", "quantizer"]
    run = subprocess.run([sys.executable, "-m", "dsplug.cli", "build-ops", "--json", *ops], capture_output=True,
                         text=True, timeout=max(30, _remaining() - 5))
    say(run.stdout.rstrip())
    if run.stderr.strip():
        say(run.stderr.rstrip()[-3000:])
    try:
        result = json.loads(run.stdout[run.stdout.index("{"):])
    except ValueError:
        return "FAIL", f"dsplug build-ops printed no JSON (exit {run.returncode})", {}
    built = {o["op"]: o for o in result.get("ops", [])}
    native = [name for name, o in built.items() if o.get("ok")]
    fallback = [name for name in ops if name not in native]
    data = {"native": native, "fallback": fallback, "seconds": result.get("seconds")}
    if not fallback:
        return "PASS", f"built natively in {result.get('seconds')} s: {', '.join(native)}", data
    details = "; ".join(f"{n}: {built.get(n, {}).get('detail') or built.get(n, {}).get('error') or 'not built'}"
                        for n in fallback)
    toolchain = _toolchain()
    if toolchain:  # no compiler / ninja / pybind11: the fallbacks are the designed path
        return "SKIP", f"no native build ({toolchain}); pure-torch fallbacks in use for {', '.join(fallback)}", data
    return "FAIL", f"the toolchain is there but the build failed: {details}; fallbacks in use", data


def _toolchain() -> str:
    """What is missing to compile native ops ('' when nothing)."""
    import shutil

    missing = []
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which(os.environ.get("CXX", "c++"))):
        missing.append("no C++ compiler")
    if not shutil.which("ninja"):
        try:
            import ninja  # noqa: F401
        except ImportError:
            missing.append("no ninja")
    try:
        import pybind11  # noqa: F401
    except ImportError:
        missing.append("no pybind11")
    return ", ".join(missing)


STAGES = [(f"stage {s}", {"stage": s}) for s in (0, 1, 2, 3)]


def check_stages(precision: str):
    rows = [train_engine(f"{precision} {label}", precision, zero) for label, zero in STAGES]
    problems = []
    for row in rows:
        problems += check_row(row, rows[0], STAGE_TOL[precision])
    if precision == "fp16":
        scales = rows[0]["loss_scales"]
        if rows[0]["skipped"] and not scales[-1] < 2 ** FP16_SCALE_POWER:
            problems.append("fp16: steps were skipped but the loss scale did not go down")
    spread = max(rel_diff(r["losses"], rows[0]["losses"]) for r in rows)
    ok = (f"4 stages, losses {rows[0]['losses'][0]:.3f} -> {rows[0]['losses'][-1]:.3f}, max deviation from stage 0 "
          f"{spread:.1e} (tol {STAGE_TOL[precision]:g})")
    if precision == "fp16":
        ok += f", {rows[0]['skipped']} overflow-skipped step(s), final loss scale {rows[0]['loss_scales'][-1]:g}"
    return (*verdict(problems, ok), {"rows": rows})


def _pinned_tensors(engine) -> Dict[str, List]:
    """The host buffers an offloading stage keeps, by role."""
    stage = engine.stage
    found: Dict[str, List] = {}
    offload = getattr(stage, "offload", None)
    if hasattr(stage, "opt_params") and offload is not None and hasattr(offload, "host_grads"):  # stages 1/2
        found["fp32 master partitions"] = list(stage.opt_params)
        found["host gradient buffers"] = list(offload.host_grads.values())
    if hasattr(stage, "partitioner"):  # stage 3
        found["parameter partitions (ds_tensor)"] = [p.ds_tensor for p in engine.module.parameters()
                                                     if getattr(p, "ds_tensor", None) is not None]
        for role in ("host_master", "host_grad"):
            tensors = [getattr(g, role) for g in getattr(stage, "groups", []) if getattr(g, role, None) is not None]
            if tensors:
                found[role.replace("_", " ")] = tensors
    return found


def _inspect_offload(engine) -> Dict[str, Any]:
    report = {}
    for role, tensors in _pinned_tensors(engine).items():
        report[role] = {"count": len(tensors), "pinned": sum(bool(t.is_pinned()) for t in tensors),
                        "on_cpu": sum(t.device.type == "cpu" for t in tensors),
                        "mib": round(sum(t.numel() * t.element_size() for t in tensors) / 2 ** 20, 2)}
    return {"host_buffers": report}


OFFLOADS = [
    ("bf16 stage 2 +offload_optimizer", {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    ("bf16 stage 3 +offload_param+opt", {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True}}),
]


#: bf16 trajectories of arithmetically different optimizers (CPU Adam on the host vs the fused GPU Adam) part
#: after a few steps (torch DDP and FSDP2 differ from stage 0 by 0.1-0.2 at step 10 too): bf16 offload runs
#: are compared with stage 0 on their first steps only, and an fp32 run checks the whole trajectory
BF16_COMPARED_STEPS = 4


def check_offload():
    reference = train_engine("bf16 stage 0 (reference)", "bf16", {"stage": 0})
    fp32_reference = train_engine("fp32 stage 0 (reference)", "fp32", {"stage": 0})
    plain = {2: train_engine("bf16 stage 2 (no offload)", "bf16", {"stage": 2}),
             3: train_engine("bf16 stage 3 (no offload)", "bf16", {"stage": 3})}
    rows = []
    problems = []
    for label, zero in OFFLOADS:
        row = train_engine(label, "bf16", zero, inspect=_inspect_offload)
        rows.append(row)
        problems += check_row(row, None, STAGE_TOL["bf16"])
        early = rel_diff(row["losses"][:BF16_COMPARED_STEPS], reference["losses"][:BF16_COMPARED_STEPS])
        if early > STAGE_TOL["bf16"]:
            problems.append(f"{label}: first {BF16_COMPARED_STEPS} losses differ from {reference['label']}'s by "
                            f"{early:.2e} (> {STAGE_TOL['bf16']:g})")
        exact = train_engine(label.replace("bf16", "fp32"), "fp32", zero)
        rows.append(exact)
        problems += check_row(exact, fp32_reference, STAGE_TOL["fp32"])
        if row["optimizer"] != "DeepSpeedCPUAdam":
            problems.append(f"{label}: optimizer {row['optimizer']}, expected DeepSpeedCPUAdam (cpu_adam)")
        say(f"    cpu_adam backend: {row['op_backend']}")
        if not row["host_buffers"]:
            problems.append(f"{label}: found no host buffers to inspect")
        for role, r in row["host_buffers"].items():
            say(f"    {role}: {r['count']} tensor(s), {r['mib']} MiB, {r['on_cpu']} on cpu, {r['pinned']} pinned")
            if r["on_cpu"] != r["count"]:
                problems.append(f"{label}: {role}: {r['count'] - r['on_cpu']} not in host memory")
            if not DRY and r["pinned"] != r["count"]:
                problems.append(f"{label}: {role}: {r['count'] - r['pinned']} of {r['count']} not pinned")
        base = plain[zero["stage"]]
        if row["peak_mib"] is not None and base["peak_mib"] is not None:
            say(f"    peak GPU memory {row['peak_mib']:.0f} MiB vs {base['peak_mib']:.0f} MiB without offload")
            if not row["peak_mib"] < base["peak_mib"]:
                problems.append(f"{label}: peak GPU memory {row['peak_mib']:.0f} MiB, not below the "
                                f"{base['peak_mib']:.0f} MiB of {base['label']}")
    backend = rows[0]["op_backend"]
    ok = (f"pinned host buffers, DeepSpeedCPUAdam ({backend}), fp32 losses within {STAGE_TOL['fp32']:g} of stage 0"
          + ("" if not DRY else " (dry: no pinning on a CPU-only machine)"))
    return (*verdict(problems, ok), {"rows": [reference, fp32_reference, plain[2], plain[3], *rows]})


# -------------------------------------------------------------------------------- checkpoint round trip
def _run_steps(engine, first: int, count: int) -> List[float]:
    losses = []
    for step in range(first, first + count):
        x, y = lm_batch(step, engine.device)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def check_checkpoint():
    """Save after 3 steps, go on 3 steps; a fresh engine (other initial weights) loads the save
    and takes the same 3 steps: the same losses, the state back on the device."""
    import dsplug

    problems, data = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (0, 2, 3):
            config = engine_config("bf16", {"stage": stage})
            engine, *_ = dsplug.initialize(model=make_lm(0), config=config)
            _run_steps(engine, 0, 3)
            path = os.path.join(tmp, f"stage{stage}")
            engine.save_checkpoint(path, tag="step3")
            straight = _run_steps(engine, 3, 3)
            engine.destroy()
            fresh, *_ = dsplug.initialize(model=make_lm(1), config=engine_config("bf16", {"stage": stage}))
            loaded, _ = fresh.load_checkpoint(path, tag="step3")
            devices = sorted({str(t.device.type) for t in fresh.module.parameters()}
                             | {str(v.device.type) for st in fresh.optimizer.state.values() for v in st.values()
                                if hasattr(v, "device") and v.dim() > 0})
            resumed = _run_steps(fresh, 3, 3)
            fresh.destroy()
            diff = rel_diff(resumed, straight)
            data[f"stage {stage}"] = {"straight": straight, "resumed": resumed, "rel_diff": diff, "devices": devices}
            say(f"  bf16 stage {stage}: straight {fmt_losses(straight)} | resumed {fmt_losses(resumed)} "
                f"(rel diff {diff:.1e}); parameters and optimizer state on {', '.join(devices)}")
            if loaded is None:
                problems.append(f"stage {stage}: load_checkpoint found nothing at {path}")
            if not diff <= 1e-3:
                problems.append(f"stage {stage}: resumed losses differ from the uninterrupted run by {diff:.1e}")
            if devices != [expected_device()]:  # nothing is offloaded: everything belongs on the device
                problems.append(f"stage {stage}: parameters / optimizer state on {devices} after loading, "
                                f"expected {expected_device()} only")
    return (*verdict(problems, "stages 0, 2, 3: resumed runs equal the uninterrupted ones"), data)


# -------------------------------------------------------------------------------- baselines
def _init_torch_group():
    import socket

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if not DRY:
        torch.cuda.set_device(0)
    dist.init_process_group(expected_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _train_torch(label: str, wrap: Callable, autocast: bool, fused: bool) -> Dict[str, Any]:
    import torch

    device = torch.device(expected_device())
    reset_memory()
    model = make_lm().to(device)
    wrapped = wrap(model)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=S["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            **({"fused": True} if fused else {}))
    losses, times = [], []
    for step in range(S["steps"]):
        x, y = lm_batch(step, device)
        synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = wrapped(x)
        loss = lm_loss(logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss.detach()))
    row = {"label": label, "precision": "bf16", "losses": losses, "times_ms": times,
           "ms": statistics.median(times[S["warmup"]:]), "peak_mib": peak_mib(), "skipped": 0,
           "backend": torch.distributed.get_backend(), "device": str(device),
           "optimizer": f"torch.optim.AdamW({'fused' if fused else 'foreach'})"}
    del wrapped, model, opt
    reset_memory()
    peak = f", peak {row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else ""
    say(f"  {label:<34} {row['ms']:8.2f} ms/step{peak}  [{row['backend']}, {row['device']}, {row['optimizer']}]")
    say(f"    losses: {fmt_losses(losses)}")
    return row


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=None if DRY else [0])


def _fsdp2(model):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def check_baselines():
    _init_torch_group()
    fused = not DRY
    rows, problems = [], []
    for label, wrap, autocast in (("torch DDP (fp32 + bf16 autocast)", _ddp, True),
                                  ("torch FSDP2 (bf16 params, fp32 reduce)", _fsdp2, False)):
        try:
            row = _train_torch(label, wrap, autocast, fused)
        except Exception as exc:  # noqa: BLE001 - one baseline failing must not hide the other
            if not fused:
                raise
            say(f"  {label}: fused AdamW failed ({type(exc).__name__}: {str(exc)[:200]}); again with foreach")
            row = _train_torch(label, wrap, autocast, False)
        rows.append(row)
        problems += check_row(row, None, 0)
    ok = ", ".join(f"{r['label'].split(' (')[0]} {r['ms']:.2f} ms/step" for r in rows)
    return (*verdict(problems, ok), {"rows": rows})


# -------------------------------------------------------------------------------- native ops' CUDA paths
def _rel(a, b) -> float:
    import torch

    a, b = a.double().cpu(), b.double().cpu()
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-30))


def _optimizer_pair(make_ours, make_ref, device, dtype, steps: int = 5, seed: int = 0):
    """Relative error of our optimizer's parameters against the reference's after ``steps`` steps."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = [(257, 129), (1000,), (33, 7, 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    ours = [t.clone().to(device, dtype).requires_grad_() for t in init]
    ref = [t.clone().to(device, dtype).requires_grad_() for t in init]
    opt_a, opt_b = make_ours(ours), make_ref(ref)
    for step in range(steps):
        for p, q, gr in zip(ours, ref, grads[step]):
            p.grad = gr.to(device, dtype)
            q.grad = gr.to(device, dtype)
        opt_a.step()
        opt_b.step()
    return max(_rel(p.detach(), q.detach()) for p, q in zip(ours, ref))


def check_ops():
    import torch

    from dsplug.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from dsplug.ops.lamb import FusedLamb
    from dsplug.plugins.optimizers.adam_optimizer import fused_kernel_available

    device = torch.device(expected_device())
    problems, data = [], {}
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)

    def record(name, err, tol):
        data[name] = err
        mark = "ok" if err <= tol else "TOO LARGE"
        say(f"  {name:<58} rel err {err:.2e} (tol {tol:g}) {mark}")
        if not err <= tol:
            problems.append(f"{name}: rel err {err:.2e} > {tol:g}")

    for fused_kernel in (True, False):
        def ours(ps, decoupled=True, fk=fused_kernel):
            opt = FusedAdam(ps, adam_w_mode=decoupled, **hyper)
            opt.use_fused_kernel = fk
            return opt

        path = "fused kernel" if fused_kernel and fused_kernel_available(device, torch.float32) else "foreach"
        record(f"FusedAdam({device.type}, fp32, {path}) vs torch AdamW",
               _optimizer_pair(ours, lambda ps: torch.optim.AdamW(ps, foreach=False, **hyper), device,
                               torch.float32), 1e-5)
        record(f"FusedAdam({device.type}, fp32, {path}, L2) vs torch Adam",
               _optimizer_pair(lambda ps: ours(ps, decoupled=False),
                               lambda ps: torch.optim.Adam(ps, foreach=False, **hyper), device, torch.float32), 1e-5)
    record(f"FusedAdam({device.type}, bf16 params) vs torch AdamW bf16",
           _optimizer_pair(lambda ps: FusedAdam(ps, **hyper),
                           lambda ps: torch.optim.AdamW(ps, foreach=False, **hyper), device, torch.bfloat16), 2e-2)
    lamb = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    if device.type != "cpu":
        def cpu_lamb(ps):  # the same class on the CPU, fed the same gradients: one code path, two devices
            twins = [p.detach().cpu().clone().requires_grad_() for p in ps]
            inner = FusedLamb(twins, **lamb)

            class Mirror:
                def step(self):
                    for t, p in zip(twins, ps):
                        t.grad = p.grad.detach().cpu()
                    inner.step()
                    with torch.no_grad():
                        for t, p in zip(twins, ps):
                            p.copy_(t)
            return Mirror()

        record("FusedLamb(cuda) vs FusedLamb(cpu)",
               _optimizer_pair(lambda ps: FusedLamb(ps, **lamb), cpu_lamb, device, torch.float32), 1e-5)

    # cpu_adam on pinned host tensors (what ZeRO-Offload steps)
    pin = not DRY and torch.cuda.is_available()

    def cpu_adam(ps):
        if pin:
            for p in ps:
                p.data = p.data.pin_memory()
        opt = DeepSpeedCPUAdam(ps, adamw_mode=True, **hyper)
        data["cpu_adam_backend"] = opt.op.backend
        return opt

    record(f"DeepSpeedCPUAdam({'pinned ' if pin else ''}host) vs torch AdamW",
           _optimizer_pair(cpu_adam, lambda ps: torch.optim.AdamW(ps, foreach=False, **hyper),
                           torch.device("cpu"), torch.float32), 1e-5)
    say(f"  cpu_adam backend: {data.get('cpu_adam_backend')}")

    # the quantizer: CUDA tensors take the pure-torch path; the CPU takes the native op when built
    from dsplug.ops import quantize as q

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1024, generator=g) * 3
    for bits, groups, symmetric in ((8, 16, True), (4, 64, False)):
        cpu_out = q.quantize_dequantize(x, bits, groups=groups, symmetric=symmetric)
        dev_out = q.quantize_dequantize(x.to(device), bits, groups=groups, symmetric=symmetric).cpu()
        step = (x.view(groups, -1).amax(1) - x.view(groups, -1).amin(1)).max() / (2 ** bits - 1)
        worst = float((cpu_out - dev_out).abs().max())
        # ulp-level differences (the GPU's fused multiply-add) are not a different rounding decision,
        # which moves an element by a whole step: count only elements off by over 1e-3 of a step
        off = float(((cpu_out - dev_out).abs() > 1e-3 * float(step)).float().mean())
        name = f"quantize_dequantize({device.type}) vs cpu, {bits}-bit, {groups} groups, sym={symmetric}"
        data[name] = {"max_abs": worst, "fraction_off": off}
        good = worst <= float(step) * 1.01 and off <= 1e-3
        say(f"  {name:<58} max |diff| {worst:.2e} (one step {float(step):.2e}), {off:.1e} of elements differ "
            f"{'ok' if good else 'TOO LARGE'}")
        if not good:
            problems.append(f"{name}: max |diff| {worst:.2e}, {off:.1e} of elements differ")
    from dsplug.op_builder import QuantizerBuilder

    say(f"  quantizer on cpu: {QuantizerBuilder().load().backend}")
    return (*verdict(problems, f"{len(data)} comparisons within tolerance; cpu_adam {data.get('cpu_adam_backend')}"),
            data)


# -------------------------------------------------------------------------------- activation checkpointing
def _lm_forward(model, tokens, checkpointed: bool):
    """CharTransformer.forward with every block through dsplug.checkpointing.checkpoint."""
    import torch

    from dsplug import checkpointing

    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.token_embedding(tokens) + model.position_embedding(positions)
    for block in model.blocks:
        x = checkpointing.checkpoint(block, x) if checkpointed else block(x)
    return model.head(model.ln_final(x))


def _grads_and_peak(device, checkpointed: bool, batch: int):
    import torch

    reset_memory()
    model = make_lm().to(device)
    x, y = lm_batch(0, device, batch)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    loss = lm_loss(_lm_forward(model, x, checkpointed), y)
    loss.backward()
    synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if device.type == "cuda" else None
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, peak


def check_activation_checkpointing():
    import torch

    from dsplug import checkpointing

    device = torch.device(expected_device())
    problems, data = [], {}
    checkpointing.configure(None)  # every option off: plain recompute
    loss0, grads0, peak0 = _grads_and_peak(device, False, S["ckpt_batch"])
    say(f"  plain:                     loss {loss0:.6f}" + (f", peak {peak0:.0f} MiB" if peak0 is not None else ""))
    variants = [("checkpoint()", dict()),
                ("checkpoint(), checkpoint_in_cpu", dict(checkpoint_in_cpu=True)),
                ("checkpoint(), contiguous pinned host rows",
                 dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=S["layers"],
                      checkpoint_in_cpu=True))]
    for name, settings in variants:
        checkpointing.configure(None, **settings)
        loss, grads, peak = _grads_and_peak(device, True, S["ckpt_batch"])
        err = max(_rel(grads[n], grads0[n]) for n in grads0)
        missing = sorted(set(grads0) - set(grads))
        data[name] = {"loss": loss, "grad_rel_err": err, "peak_mib": peak}
        say(f"  {name:<26} loss {loss:.6f}, max grad rel err {err:.1e}"
            + (f", peak {peak:.0f} MiB ({peak / peak0:.2f}x plain)" if peak is not None else ""))
        if missing:
            problems.append(f"{name}: no gradient for {missing[:3]}")
        if abs(loss - loss0) > 1e-5 * abs(loss0) or not err <= 1e-4:
            problems.append(f"{name}: loss {loss:.6f} vs {loss0:.6f}, grad rel err {err:.1e} (tol 1e-4)")
        if name == "checkpoint()" and peak is not None and not peak < peak0:
            problems.append(f"{name}: peak memory {peak:.0f} MiB not below the plain model's {peak0:.0f} MiB")
    # the engine with a checkpointed model (its activation_checkpointing section configures the API)
    checkpointing.configure(None)
    plain = train_engine("bf16 stage 2, plain model", "bf16", {"stage": 2})
    ckpt = train_engine("bf16 stage 2, checkpointed blocks", "bf16", {"stage": 2},
                        forward=lambda engine, x: _lm_forward(engine.module, x, True),
                        extra_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    problems += check_row(ckpt, plain, STAGE_TOL["bf16"])
    data["engine"] = {"plain_ms": plain["ms"], "checkpointed_ms": ckpt["ms"]}
    return (*verdict(problems, "gradients equal the plain model's (3 variants), engine losses equal"), data)


# -------------------------------------------------------------------------------- comm volume
def check_comm_volume():
    size = ["--width", "64", "--layers", "2", "--micro", "4", "--steps", "2"] if DRY else \
        ["--width", "2048", "--layers", "6", "--micro", "16", "--steps", "3"]
    cmd = [sys.executable, str(REPO / "benchmarks" / "comm_volume.py"), "--worlds", "1", "--stages", "0,1,2,3",
           "--bf16", *size]
    say("  " + " ".join(cmd))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, _remaining() - 5))
    say(run.stdout.rstrip())
    if run.returncode:
        say(run.stderr.rstrip()[-4000:])
        return "FAIL", f"comm_volume.py exited {run.returncode}: {_last_line(run.stderr)}", {}
    rows = [line for line in run.stdout.splitlines() if line.strip()[:1].isdigit()]
    if len(rows) != 4:
        return "FAIL", f"expected 4 table rows (stages 0-3), got {len(rows)}", {}
    return "PASS", f"ran at world 1 on {expected_backend()}: 4 stages (bytes sent are 0 at world 1 by definition)", \
        {"table": rows}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# -------------------------------------------------------------------------------- pytest
def check_pytest():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
           str(REPO / "tests" / "core" / "test_cuda_paths.py")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, _remaining() - 5), cwd=REPO)
    say(run.stdout.rstrip()[-6000:])
    summary = _last_line(run.stdout)
    if run.returncode == 0:
        return "PASS", summary, {}
    if run.returncode == 5:
        return "FAIL", "no test collected", {}
    return "FAIL", summary, {}


CHECKS: Dict[str, Tuple[int, Callable]] = {
    "env": (60, check_env),
    "native_ops": (180, check_native_ops),
    "stages_bf16": (150, lambda: check_stages("bf16")),
    "stages_fp16": (150, lambda: check_stages("fp16")),
    "offload": (180, check_offload),
    "checkpoint": (90, check_checkpoint),
    "baselines": (120, check_baselines),
    "ops_cuda": (90, check_ops),
    "activation_checkpointing": (120, check_activation_checkpointing),
    "comm_volume": (150, check_comm_volume),
    "pytest_cuda": (240, check_pytest),
}


# ================================================================================ driver
_DEADLINE = {"t": None}


def _remaining() -> float:
    deadline = _DEADLINE["t"] or float(os.environ.get("DEVICE_CHECK_DEADLINE", "0") or 0)
    return deadline - time.time() if deadline else 600.0


def run_one(name: str, result_path: str) -> int:
    """In the check's own process: run it, print its verdict, write its result."""
    os.environ.setdefault("DSPLUG_COMM_TIMEOUT", "120")  # a stuck collective fails inside the check's timeout
    if DRY:
        os.environ["DSPLUG_ACCELERATOR"] = "cpu"
    start = time.time()
    try:
        status, reason, data = CHECKS[name][1]()
    except Exception as exc:  # noqa: BLE001 - a check's crash is its FAIL
        traceback.print_exc()
        first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        status, reason, data = "FAIL", f"{type(exc).__name__}: {first_line}", {}
    result = {"name": name, "status": status, "reason": reason, "data": data, "seconds": round(time.time() - start, 1)}
    with open(result_path, "w") as f:
        json.dump(result, f, default=str)
    say(f"{status}: {name}: {reason}")
    return 0


def run_all(names: List[str]) -> int:
    deadline = time.time() + BUDGET_S
    env = dict(os.environ, DEVICE_CHECK_DEADLINE=str(deadline), PYTHONUNBUFFERED="1")
    results = []
    say(f"device check: {'DRY (cpu, gloo, tiny sizes)' if DRY else 'GPU (cuda, nccl, world 1)'}; "
        f"budget {BUDGET_S:.0f} s; checks: {', '.join(names)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            own = CHECKS[name][0] * (2 if DRY else 1)  # the CPU is slower than the GPU at the same job
            left = deadline - time.time()
            if left < 20:
                results.append({"name": name, "status": "SKIP", "reason": f"budget spent ({left:.0f} s left)",
                                "data": {}, "seconds": 0})
                say(f"SKIP: {name}: budget spent")
                continue
            limit = min(own, left - 5)
            say(f"\n=== {name} (timeout {limit:.0f} s)")
            path = os.path.join(tmp, f"{name}.json")
            start = time.time()
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--run-check", name, "--result", path],
                                    env=env, start_new_session=True)
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the check's own process group (it may have children)
                proc.wait()
            elapsed = round(time.time() - start, 1)
            if os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
            elif elapsed >= limit - 0.5:
                result = {"name": name, "status": "FAIL", "reason": f"timed out after {limit:.0f} s", "data": {}}
                say(f"FAIL: {name}: timed out after {limit:.0f} s")
            else:
                result = {"name": name, "status": "FAIL", "data": {},
                          "reason": f"the check's process died (exit {proc.returncode}) without a result"}
                say(f"FAIL: {name}: process died (exit {proc.returncode})")
            result["seconds"] = elapsed
            results.append(result)
    summarize(results)
    with open(out_dir() / "device_check.json", "w") as f:
        json.dump({"dry": DRY, "sizes": S, "results": results}, f, indent=1, default=str)
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


def summarize(results: List[Dict[str, Any]]) -> None:
    rows = []
    baseline_ms = None
    for r in results:
        for row in r.get("data", {}).get("rows", []) if isinstance(r.get("data"), dict) else []:
            rows.append(row)
            if row["label"].startswith("torch DDP"):
                baseline_ms = row["ms"]
    if rows:
        say(f"\n=== step times (model {S['layers']} x d{S['d_model']}, seq {S['seq']}, batch {S['batch']}, "
            f"{'cpu' if DRY else 'one GPU'}; median of {S['steps'] - S['warmup']} steps after {S['warmup']})")
        say(f"{'run':<40} {'ms/step':>9} {'x DDP':>7} {'peak MiB':>9} {'first loss':>10} {'last loss':>10}")
        seen = set()
        for row in rows:
            if row["label"] in seen:
                continue
            seen.add(row["label"])
            ratio = f"{row['ms'] / baseline_ms:7.2f}" if baseline_ms else f"{'-':>7}"
            peak = f"{row['peak_mib']:9.0f}" if row.get("peak_mib") is not None else f"{'-':>9}"
            first, last = row["losses"][0], row["losses"][-1]
            say(f"{row['label']:<40} {row['ms']:9.2f} {ratio} {peak} {first:10.4f} {last:10.4f}")
    say("\n=== summary")
    for r in results:
        say(f"{r['status']:<5} {r['name']:<26} {r['seconds']:6.1f} s  {r['reason']}")
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    say(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                        default=list(CHECKS), help=f"comma-separated checks (default: all: {', '.join(CHECKS)})")
    parser.add_argument("--run-check", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_check:
        return run_one(args.run_check, args.result)
    unknown = [n for n in args.only if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    return run_all(args.only)


if __name__ == "__main__":
    sys.exit(main())
