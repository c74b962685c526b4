"""ZeRO-Infinity past the machine's memory: the built-in LM scaled up, trained from NVMe swap files.

    python benchmarks/infinity.py --dir /path/on/the/disk [--ram-multiples 0.25,0.5,1,2] [--steps 4] [--deepspeed-python PY]

Rows are models whose fp32 training state (parameters, gradients, Adam's two moments: 16 bytes a
parameter) is the given multiple of this machine's RAM. Each row is the built-in character LM
(``dsplug.plugins.train.model.CharTransformer``) at width ``--width`` with as many layers as that
size needs, built inside ``dsplug.zero.Init(remote_device="nvme")`` (each Linear is partitioned as
soon as it is built, so the whole model never exists in memory), trained in bf16 at ZeRO stage 3
with ``offload_param`` and ``offload_optimizer`` on ``nvme`` in ``--dir`` (``max_in_cpu`` 0: every
parameter partition lives in a swap file; AdamW steps sub-groups of ``--sub-group`` elements swapped
in and out), on one fixed batch, in a fresh process.

Per step it prints: the loss; the step time; the peak RSS of that step (``VmHWM`` after resetting
it through ``/proc/self/clear_refs``) and its share of RAM (target <= 25 %); the bytes the swapper
read and wrote (both offload devices' swap files); the aio bandwidth measured on ``--dir`` in the
same run just before the row (aio_handle, O_DIRECT, locked buffers: 1 GiB written, then read); and
the step time as a multiple of the I/O bound, ``read bytes / read bandwidth + written bytes / write
bandwidth`` (target <= 1.5x). The first step of a row includes first-touch costs and is printed
but not summarized.

With ``--deepspeed-python`` (a separate venv with deepspeed and the same torch; never a
dependency), DeepSpeed trains the same model (``plugins/train/model.py`` loaded by path), with the
same initialization, config and batch, at the ``--deepspeed-multiples`` rows (``DS_ACCELERATOR=cpu``,
one process over gloo); its read / written bytes are its process's storage I/O
(``/proc/self/io``), as its swappers count none. If it cannot run, its error is printed in its row.

The check of the numbers: the same model at ``--small-width`` (where everything fits) is trained
twice, with the nvme offload and without any offload (plain ZeRO stage 3), and the losses must
agree within bf16's tolerance; every big row's loss must be finite and fall.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ, BATCH = 96, 32, 2
GiB = 1 << 30


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def layer_params(width: int) -> int:
    return 12 * width * width + 13 * width  # qkv, proj, 2 MLP matrices, their biases, 2 LayerNorms


def model_params(width: int, layers: int) -> int:
    return layers * layer_params(width) + (VOCAB + SEQ) * width + 2 * width


def disk_bytes(params: int) -> int:
    """Swap files of one run: bf16 partitions (2 B) + fp32 master, gradient, exp_avg, exp_avg_sq (16 B)."""
    return 18 * params


# --------------------------------------------------------------------------- the aio bandwidth
def aio_bandwidth(directory: str, total: int = GiB, chunk: int = 256 << 20):
    """(write GB/s, read GB/s) of the engine's aio settings on ``directory``, O_DIRECT."""
    import torch

    from dsplug.op_builder import AsyncIOBuilder
    from dsplug.plugins.offload.swap import _aio_settings

    ops = AsyncIOBuilder().load()
    handle = ops.aio_handle(*_aio_settings(None))
    buffers = [handle.new_cpu_locked_tensor(chunk, torch.empty(0, dtype=torch.uint8)) for _ in range(2)]
    for b in buffers:
        b.random_(0, 255)
    paths = [os.path.join(directory, f"aio-bandwidth-{i}.bin") for i in range(total // chunk)]
    try:
        start = time.perf_counter()
        for i, path in enumerate(paths):
            handle.async_pwrite(buffers[i % 2], path)
            if i % 2:
                handle.wait()
        handle.wait()
        write = total / (time.perf_counter() - start)
        start = time.perf_counter()
        for i, path in enumerate(paths):
            handle.async_pread(buffers[i % 2], path)
            if i % 2:
                handle.wait()
        handle.wait()
        read = total / (time.perf_counter() - start)
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    return write / 1e9, read / 1e9


# --------------------------------------------------------------------------- one run (child process)
def peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def init_like_builtin(model, layers: int, lib) -> None:
    """The built-in LM's initialization (normal(0, 0.02), residual projections scaled by depth, zero
    biases), one parameter at a time through ``lib.zero.GatheredParameters`` (``lib``: dsplug or
    deepspeed): inside zero.Init each Linear was partitioned when it was built, before the model's
    own init ran on empty tensors."""
    import torch

    for index, (name, p) in enumerate(model.named_parameters()):
        if "ln" in name:
            continue  # LayerNorms keep their ones / zeros
        with lib.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            else:
                scaled = name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight")
                # a generator per parameter: the values do not depend on what else the framework drew
                p.normal_(0.0, 0.02 / (2 * layers) ** 0.5 if scaled else 0.02,
                          generator=torch.Generator().manual_seed(index))


def build_config(args, offload: bool) -> dict:
    width = args.width
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10 * width,
            "reduce_bucket_size": int(args.bucket), "stage3_prefetch_bucket_size": int(args.prefetch),
            "stage3_max_live_parameters": int(args.max_live), "sub_group_size": int(args.sub_group)}
    if offload:
        nvme = {"device": "nvme", "nvme_path": args.dir}
        zero["offload_param"] = dict(nvme, max_in_cpu=0, buffer_count=int(args.param_buffers),
                                     buffer_size=4 * width * width)
        zero["offload_optimizer"] = dict(nvme, buffer_count=int(args.opt_buffers), pipeline_read=True,
                                         pipeline_write=True)
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}}


def builtin_lm_module():
    """``plugins/train/model.py`` loaded from this tree by path: it imports only torch, so the
    DeepSpeed run (another venv, without dsplug) trains the very same model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("builtin_lm_model", os.path.join(REPO, "plugins", "train", "model.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def process_io() -> tuple:
    """(bytes read, bytes written) by this process at the storage layer (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def child(args) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    deepspeed = args.framework == "deepspeed"
    lib = __import__("deepspeed" if deepspeed else "dsplug")
    lm = builtin_lm_module()
    offload = not args.plain
    config = build_config(args, offload)
    if deepspeed:
        lib.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    started = time.perf_counter()
    model_config = lm.ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=args.width, n_layers=args.layers,
                                  n_heads=max(1, args.width // 128))
    with lib.zero.Init(config_dict_or_path=config, remote_device="nvme" if offload else None, dtype=torch.bfloat16):
        model = lm.CharTransformer(model_config)
    init_like_builtin(model, args.layers, lib)
    built = time.perf_counter() - started
    build_rss = peak_rss()
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
    ready = time.perf_counter() - started
    devices = list(engine.stage.offload.values()) if offload and not deepspeed else []

    def moved():
        if deepspeed:  # DeepSpeed's swappers keep no byte counts: what this process read and wrote
            return process_io()
        files = [d.files for d in devices if getattr(d, "files", None) is not None]
        return sum(f.bytes_read for f in files), sum(f.bytes_written for f in files)

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    print(json.dumps({"kind": "setup", "params": sum(p.ds_numel for p in engine.module.parameters()),
                      "build_s": built, "ready_s": ready, "build_peak_rss": build_rss,
                      "init_peak_rss": peak_rss()}), flush=True)
    for step in range(args.steps):
        read0, written0 = moved()
        peak_rss_reset()
        start = time.perf_counter()
        logits = engine(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - start
        read1, written1 = moved()
        print(json.dumps({"kind": "step", "step": step, "loss": float(loss), "seconds": seconds,
                          "peak_rss": peak_rss(), "read": read1 - read0, "written": written1 - written0,
                          "load": os.getloadavg()[0]}), flush=True)
    engine.destroy()


def run_child(args, width: int, layers: int, plain: bool = False, framework: str = "dsplug"):
    """The child's JSON rows as they come; a failed run raises RuntimeError with its stderr's tail."""
    python, env = sys.executable, dict(os.environ)
    if framework == "deepspeed":
        from dsplug.testing.ranks import free_port

        python = args.deepspeed_python
        env.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()),
                   TORCH_EXTENSIONS_DIR=args.extensions_dir or os.path.join(args.dir, "deepspeed-extensions"))
    cmd = [python, os.path.abspath(__file__), "--child", "--framework", framework, "--dir", args.dir, "--width",
           str(width), "--layers", str(layers), "--steps", str(args.steps), "--threads", str(args.threads), "--lr",
           str(args.lr), "--sub-group", str(args.sub_group), "--bucket", str(args.bucket), "--prefetch",
           str(args.prefetch), "--max-live", str(args.max_live), "--param-buffers", str(args.param_buffers),
           "--opt-buffers", str(args.opt_buffers)] + (["--plain"] if plain else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            yield json.loads(line)
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"the {framework} run at width {width}, {layers} layers failed:\n{err[-3000:]}")


def print_run(rows_in, ram: int, read_bw: float, write_bw: float):
    """Print a run's setup line and step table as the rows arrive; returns (losses, [(row, bound)])."""
    print(f"{'step':>4} {'loss':>8} {'step s':>8} {'peak RSS GB':>11} {'% RAM':>6} {'read GB':>8} "
          f"{'written GB':>10} {'I/O bound s':>11} {'x bound':>8} {'load':>5}", flush=True)
    losses, rows = [], []
    for row in rows_in:
        if row["kind"] == "setup":
            print(f"     build {row['build_s']:.0f} s (peak RSS {row['build_peak_rss'] / 1e9:.2f} GB), engine ready "
                  f"at {row['ready_s']:.0f} s (peak RSS {row['init_peak_rss'] / 1e9:.2f} GB)", flush=True)
            continue
        bound = row["read"] / 1e9 / read_bw + row["written"] / 1e9 / write_bw
        losses.append(row["loss"])
        rows.append((row, bound))
        print(f"{row['step']:>4} {row['loss']:8.4f} {row['seconds']:8.1f} {row['peak_rss'] / 1e9:11.2f} "
              f"{100 * row['peak_rss'] / ram:5.1f}% {row['read'] / 1e9:8.1f} {row['written'] / 1e9:10.1f} "
              f"{bound:11.1f} {row['seconds'] / max(bound, 1e-9):7.2f}x {row['load']:5.2f}", flush=True)
    return losses, rows


def summarize(who: str, multiple: float, params: int, losses, rows, write_bw: float, read_bw: float):
    falling = all(math.isfinite(v) for v in losses) and len(losses) > 1 and losses[-1] < losses[0]
    later = rows[1:] or rows
    return (who, multiple, params, max(r["peak_rss"] for r, _ in later), sum(r["seconds"] for r, _ in later) / len(later),
            sum(r["seconds"] / max(b, 1e-9) for r, b in later) / len(later), write_bw, read_bw, falling)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="directory on the disk to swap to (the 'nvme_path')")
    p.add_argument("--ram-multiples", default="0.25,0.5,1,2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--small-width", type=int, default=256)
    p.add_argument("--small-layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--sub-group", type=float, default=2.5e7, help="sub_group_size (elements)")
    p.add_argument("--bucket", type=float, default=5e7, help="reduce_bucket_size (elements)")
    p.add_argument("--prefetch", type=float, default=2e8, help="stage3_prefetch_bucket_size (elements)")
    p.add_argument("--max-live", type=float, default=4e8, help="stage3_max_live_parameters (elements)")
    p.add_argument("--param-buffers", type=int, default=5, help="offload_param.buffer_count")
    p.add_argument("--opt-buffers", type=int, default=8, help="offload_optimizer.buffer_count")
    p.add_argument("--skip-check", action="store_true", help="skip the small-width plain-vs-offload check")
    p.add_argument("--deepspeed-python", default=os.environ.get("DSPLUG_DEEPSPEED_PYTHON"),
                   help="a Python with deepspeed (another venv): its run of the same model and config beside")
    p.add_argument("--deepspeed-multiples", default="0.25", help="the rows DeepSpeed runs too")
    p.add_argument("--extensions-dir", default=None, help="TORCH_EXTENSIONS_DIR for DeepSpeed's CPU ops")
    p.add_argument("--framework", default="dsplug", choices=["dsplug", "deepspeed"], help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.width = int(args.width)
        child(args)
        return 0
    os.makedirs(args.dir, exist_ok=True)
    ram = ram_bytes()
    print(f"RAM {ram / GiB:.1f} GiB; width {args.width}; bf16 compute, fp32 master/grad/Adam in swap files on "
          f"{args.dir}; sub_group_size {args.sub_group:.0e}; {args.threads} threads; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)

    ok = True
    if not args.skip_check:
        width, layers = args.small_width, args.small_layers
        small = argparse.Namespace(**{**vars(args), "width": width})
        plain = [r["loss"] for r in run_child(small, width, layers, plain=True) if r["kind"] == "step"]
        offl = [r["loss"] for r in run_child(small, width, layers) if r["kind"] == "step"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(offl, plain))
        agree = worst <= 2 ** -7 * 4
        ok &= agree
        print(f"check at width {width}, {layers} layers ({model_params(width, layers) / 1e6:.1f}M params): losses "
              f"plain stage 3 {['%.4f' % v for v in plain]}, nvme offload {['%.4f' % v for v in offl]}; worst "
              f"relative difference {worst:.2e} ({'agree' if agree else 'DIFFER'} within bf16)", flush=True)

    summary = []
    deepspeed_multiples = {float(m) for m in args.deepspeed_multiples.split(",") if m}
    for multiple in (float(m) for m in args.ram_multiples.split(",")):
        layers = max(1, math.ceil((multiple * ram / 16 - model_params(args.width, 0)) / layer_params(args.width)))
        params = model_params(args.width, layers)
        free = shutil.disk_usage(args.dir).free
        if disk_bytes(params) + 2 * GiB > free:
            print(f"\n{multiple}x RAM: {params / 1e9:.2f}B params need {disk_bytes(params) / 1e9:.1f} GB of swap files; "
                  f"{free / 1e9:.1f} GB free on {args.dir}: not run", flush=True)
            continue
        write_bw, read_bw = aio_bandwidth(args.dir)
        print(f"\n{multiple}x RAM: {layers} layers, {params / 1e9:.2f}B params, fp32 state {16 * params / 1e9:.1f} GB "
              f"({16 * params / ram:.2f}x RAM), swap files {disk_bytes(params) / 1e9:.1f} GB; aio on {args.dir}: "
              f"write {write_bw:.2f} GB/s, read {read_bw:.2f} GB/s; load average {os.getloadavg()[0]:.2f}", flush=True)
        losses, rows = print_run(run_child(args, args.width, layers), ram, read_bw, write_bw)
        entry = summarize("dsplug", multiple, params, losses, rows, write_bw, read_bw)
        ok &= entry[-1]
        summary.append(entry)
        if args.deepspeed_python and multiple in deepspeed_multiples:
            print(f"DeepSpeed, the same model and config ({args.deepspeed_python}):", flush=True)
            try:
                losses, rows = print_run(run_child(args, args.width, layers, framework="deepspeed"), ram, read_bw,
                                         write_bw)
                summary.append(summarize("DeepSpeed", multiple, params, losses, rows, write_bw, read_bw))
            except RuntimeError as exc:
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                # the benchmark's own call that failed (the last frame in this file), then the error
                ours = [i for i, line in enumerate(lines) if os.path.basename(__file__) in line]
                where = lines[ours[-1]:ours[-1] + 2] if ours else []
                print("DeepSpeed failed: " + " | ".join(where + lines[-3:]), flush=True)
                summary.append(("DeepSpeed", multiple, params, None, None, None, write_bw, read_bw, False))
            finally:
                shutil.rmtree(os.path.join(args.dir, "zero_stage_3"), ignore_errors=True)  # its swap files
    print("\nsummary (steps after the first; targets: peak RSS <= 25% of RAM, step <= 1.5x the I/O bound)")
    print(f"{'run':<9} {'x RAM':>6} {'params':>8} {'peak RSS GB':>11} {'% RAM':>6} {'step s':>7} {'x I/O bound':>11} "
          f"{'aio w/r GB/s':>13} {'loss falls':>10}")
    for who, multiple, params, rss, sec, xb, w, r, falling in summary:
        if rss is None:
            print(f"{who:<9} {multiple:6.2f} {params / 1e9:7.2f}B   failed (above)")
            continue
        print(f"{who:<9} {multiple:6.2f} {params / 1e9:7.2f}B {rss / 1e9:11.2f} {100 * rss / ram:5.1f}% {sec:7.1f} "
              f"{xb:10.2f}x {w:6.2f}/{r:<6.2f} {'yes' if falling else 'NO':>10}")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
