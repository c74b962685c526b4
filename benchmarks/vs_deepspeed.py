"""Step time of dsplug vs DeepSpeed (same configs, same model, same machine, one invocation), with
dsplug's ratios to its own stage 0 and to torch DDP.

    python benchmarks/vs_deepspeed.py                                   # dsplug + DDP only
    python benchmarks/vs_deepspeed.py --deepspeed-python /work/dsvenv/bin/python
    python benchmarks/vs_deepspeed.py --sizes 50M --variants "stage 0,stage 3" --rounds 2

DeepSpeed is never a dependency: it runs from the Python interpreter named by
``--deepspeed-python`` (or ``DSPLUG_DEEPSPEED_PYTHON``), a separate venv with ``deepspeed`` and
the same torch (``DS_ACCELERATOR=cpu``; its first run compiles its CPU Adam for minutes into a
private ``TORCH_EXTENSIONS_DIR``). Without one, or when its import fails, the DeepSpeed column
says so and the dsplug / DDP figures still print.

Every run: ``--world`` processes over gloo on 127.0.0.1 (``--threads`` torch threads each), an
MLP of Linear(width, width) layers with GELU between (fp32, AdamW, lr 1e-3), micro-batch
``--micro``, ``--warmup`` untimed steps, then the median of ``--steps`` timed optimizer steps
(forward + backward + step, the slowest rank). Configs are DeepSpeed-format JSON given to both
frameworks unchanged; offload variants use DeepSpeed's CPU Adam and dsplug's native CPU Adam.
The ``fsdp2`` variant is contrib/dsplug-fsdp's ZeRO stage on PyTorch FSDP2 (dsplug only; its
``/stage 0`` ratio and stage 3's compare the two sharded stages).
The rounds interleave the frameworks so that machine noise hits both.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

SIZES = {"4M": (1024, 4), "50M": (2048, 12), "200M": (4096, 12)}
VARIANTS = {
    "stage 0": {"stage": 0},
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 2 + offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage 3": {"stage": 3},
    "stage 3 + offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    # contrib/dsplug-fsdp's stage on PyTorch FSDP2 (registered from the source tree when it is not
    # installed); DeepSpeed has no such stage, so its column stays empty
    "fsdp2": {"stage": "fsdp2"},
}
#: variants only dsplug runs
DSPLUG_ONLY = {"fsdp2"}
FSDP_CONTRIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contrib", "dsplug-fsdp")


def config(zero: dict, micro: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": dict(zero), "steps_per_print": 10 ** 9}


# ------------------------------------------------------------------------------ one rank (any framework)
def worker(framework: str, width: int, layers: int, micro: int, warmup: int, steps: int, cfg: dict) -> None:
    """Run in each rank's process (RANK / WORLD_SIZE / MASTER_* set); rank 0 prints one JSON line."""
    import time

    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.GELU())
    model = torch.nn.Sequential(*mods)
    if framework == "ddp":
        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def step(x):
            loss = net(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    else:
        lib = __import__("deepspeed" if framework == "deepspeed" else "dsplug")
        if framework == "dsplug" and str(cfg["zero_optimization"]["stage"]) == "fsdp2":
            _ensure_fsdp2()
        lib.init_distributed(dist_backend="gloo") if framework == "deepspeed" else lib.init_distributed()
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step(x):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    gen = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for i in range(warmup + steps):
        x = torch.randn(micro, width, generator=gen)
        dist.barrier()
        start = time.perf_counter()
        step(x)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"median_s": statistics.median(times)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _ensure_fsdp2() -> None:
    """The ``fsdp2`` stage: the installed dsplug-fsdp, else contrib/dsplug-fsdp from this tree."""
    from dsplug.registry import get_registry

    registry = get_registry()
    if registry.find("zero_stage", "fsdp2") is None:
        sys.path.insert(0, FSDP_CONTRIB)
        import dsplug_fsdp.plugin

        registry.register(dsplug_fsdp.plugin, distribution="dsplug-fsdp (source tree)")


# ------------------------------------------------------------------------------ launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(python: str, framework: str, args, width: int, layers: int, cfg: dict, env_extra=None):
    """Start ``args.world`` ranks of :func:`worker` under ``python``; the median step time or an error text."""
    port = _free_port()
    payload = json.dumps([framework, width, layers, args.micro, args.warmup, args.steps, cfg])
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import torch; torch.set_num_threads({args.threads}); import vs_deepspeed; "
            "vs_deepspeed.worker(*json.loads(sys.argv[1]))")
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in range(args.world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads),
                       **(env_extra or {}))
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            procs.append((subprocess.Popen([python, "-c", code, payload], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        failed = None
        for proc, log in procs:
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                failed = f"timed out after {args.timeout}s"
        outputs = []
        for proc, log in procs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["median_s"], None
    tail = next((o for o in outputs if "Error" in o), outputs[0]).strip().splitlines()[-3:]
    return None, failed or " | ".join(tail)


def _ms(v) -> str:
    return f"{v * 1e3:.1f}" if v is not None else "-"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _deepspeed_env(args):
    ext = args.extensions_dir or os.path.join(tempfile.gettempdir(), "dsplug-bench-ds-extensions")
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ext}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", default=os.environ.get("DSPLUG_DEEPSPEED_PYTHON"))
    parser.add_argument("--extensions-dir", default=None, help="TORCH_EXTENSIONS_DIR for DeepSpeed's CPU ops")
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=["4M", "50M"])
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    for v in args.variants:
        if v not in VARIANTS:
            parser.error(f"--variants: unknown {v!r}; known: {', '.join(VARIANTS)}")
    ds_python = args.deepspeed_python
    if ds_python:
        probe = subprocess.run([ds_python, "-c", "import deepspeed, sys; print(deepspeed.__version__)"],
                               env=dict(os.environ, **_deepspeed_env(args)), capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"DeepSpeed: {ds_python} cannot import deepspeed ({probe.stderr.strip().splitlines()[-1:]}); "
                  "its column is skipped")
            ds_python = None
        else:
            print(f"DeepSpeed {probe.stdout.strip()} from {ds_python}")
    else:
        print("DeepSpeed: no --deepspeed-python / DSPLUG_DEEPSPEED_PYTHON given; its column is skipped")

    print(f"{args.world} processes over gloo, {args.threads} thread(s) each, micro-batch {args.micro}, "
          f"median of {args.steps} steps after {args.warmup}, {args.rounds} round(s)")
    header = f"{'size':>4} {'variant':<18} | {'dsplug ms':>9} {'DeepSpeed ms':>12} {'dsplug/DS':>9} | " \
             f"{'/stage 0':>8} {'/DDP':>6}"
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        width, layers = SIZES[size]
        results = {}
        for _ in range(args.rounds):
            got, err = launch(sys.executable, "ddp", args, width, layers, {})
            results.setdefault(("ddp", None), []).append(got)
            for variant in args.variants:
                cfg = config(VARIANTS[variant], args.micro)
                got, err = launch(sys.executable, "dsplug", args, width, layers, cfg)
                if got is None:
                    print(f"  dsplug {variant}: failed: {err}")
                results.setdefault(("dsplug", variant), []).append(got)
                if ds_python and variant not in DSPLUG_ONLY:
                    got, err = launch(ds_python, "deepspeed", args, width, layers, cfg, _deepspeed_env(args))
                    if got is None:
                        print(f"  DeepSpeed {variant}: failed: {err}")
                    results.setdefault(("deepspeed", variant), []).append(got)

        def best(key):
            values = [v for v in results.get(key, []) if v is not None]
            return min(values) if values else None

        ddp, base = best(("ddp", None)), best(("dsplug", "stage 0"))
        for variant in args.variants:
            mine, theirs = best(("dsplug", variant)), best(("deepspeed", variant))

            print(f"{size:>4} {variant:<18} | {_ms(mine):>9} {_ms(theirs):>12} {_ratio(mine, theirs):>9} | "
                  f"{_ratio(mine, base):>8} {_ratio(mine, ddp):>6}")
        print(f"{size:>4} {'DDP':<18} | {_ms(ddp):>9}")


if __name__ == "__main__":
    main()
