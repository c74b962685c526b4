"""Offload devices side by side: step time and peak resident memory of ZeRO-Offload training.

    python benchmarks/offload.py                                  # 64M-parameter MLP (256 MB of fp32 weights)
    python benchmarks/offload.py --params 16M --steps 3 --devices cpu,mmap --stages 3

For each (stage, device) a fresh process builds an MLP, trains it with ``offload_optimizer`` (and
at stage 3 ``offload_param``) on that device (AdamW, so the CPU Adam steps the offloaded state),
and reports the median time of ``--steps`` steps after one warm-up step and its peak resident
set size (``ru_maxrss``: anonymous memory plus the pages of mapped files it touched), next to
the RSS right after building the model. ``sub_group_size`` is 2**23 elements (the swapped
sub-groups of ``nvme``); ``offload_param`` keeps nothing resident (``max_in_cpu: 0``). The baseline is device
``cpu`` in the same run. Devices: ``cpu`` and ``nvme`` (dsplug's), ``mmap`` (registered from
``contrib/dsplug-mmap-offload`` when that distribution is not installed). Files go to ``--dir``
(default: a temporary directory, removed afterwards).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"16M": (2048, 4), "64M": (2816, 8), "128M": (4096, 8)}  # (width, layers): width*width*layers weights


def child(args) -> None:
    import resource

    import torch

    import dsplug
    from dsplug.registry import get_registry

    torch.set_num_threads(args.threads)
    registry = get_registry()
    if args.device == "mmap" and registry.find("offload_device", "mmap") is None:
        sys.path.insert(0, os.path.join(REPO, "contrib", "dsplug-mmap-offload"))
        import dsplug_mmap_offload.plugin as plugin

        registry.register(plugin, distribution="dsplug-mmap-offload", version="0.1.0")
    width, layers = SIZES[args.params]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    section = {"device": args.device, "nvme_path": args.dir}
    zero = {"stage": args.stage, "offload_optimizer": dict(section), "sub_group_size": 2 ** 23}
    if args.stage == 3:
        zero["offload_param"] = dict(section, buffer_size=width * width, max_in_cpu=0)
    config = {"train_batch_size": 8, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = dsplug.initialize(model=model, config=config)
    x = torch.randn(8, width).to(engine.precision.model_dtype or torch.float32)
    times = []
    for _ in range(1 + args.steps):
        start = time.perf_counter()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.destroy()
    print(json.dumps({"step_s": statistics.median(times[1:]), "peak_rss_mb": peak / 1024,
                      "model_rss_mb": built_rss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="64M", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--devices", default="cpu,nvme,mmap")
    p.add_argument("--stages", default="3,2")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--bf16", action="store_true", help="train in bf16 (fp32 masters)")
    p.add_argument("--dir", default=None, help="directory for nvme / mmap files")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    made = args.dir is None
    root = args.dir or tempfile.mkdtemp(prefix="dsplug-offload-bench-")
    width, layers = SIZES[args.params]
    params = (width * width + width) * layers
    print(f"MLP {layers} x Linear({width}, {width}): {params / 1e6:.1f}M parameters, "
          f"{params * 4 / 2 ** 20:.0f} MB fp32; {'bf16' if args.bf16 else 'fp32'}, AdamW, {args.threads} threads")
    print(f"{'stage':>5} {'device':>6} {'step s':>8} {'vs cpu':>7} {'peak RSS MB':>12} {'vs cpu':>7} {'model MB':>9}")
    try:
        for stage in (int(s) for s in args.stages.split(",")):
            base = None
            for device in args.devices.split(","):
                if stage != 3 and device == "nvme":
                    continue  # stages 1-2 need a byte-addressable device
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", device, "--stage", str(stage),
                       "--params", args.params, "--steps", str(args.steps), "--threads", str(args.threads),
                       "--dir", root] + (["--bf16"] if args.bf16 else [])
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{stage:>5} {device:>6} failed: {done.stderr.strip().splitlines()[-1:]}")
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                base = base or (row if device == "cpu" else None)
                ratio = f"{row['step_s'] / base['step_s']:.2f}x" if base else "-"
                rss = f"{row['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base else "-"
                print(f"{stage:>5} {device:>6} {row['step_s']:>8.3f} {ratio:>7} {row['peak_rss_mb']:>12.0f} {rss:>7} "
                      f"{row['model_rss_mb']:>9.0f}", flush=True)
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
