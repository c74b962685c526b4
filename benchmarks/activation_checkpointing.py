"""Activation memory and step time of the built-in LM with and without ``dsplug.checkpointing``.

The built-in character LM (``dsplug.plugins.train.model.CharTransformer``: d_model 256, 6 layers,
4 heads, seq 128, batch 16, vocab 96, fp32, CPU, 2 threads) runs forward + backward (no optimizer).
Modes:

* ``no checkpointing`` -- the baseline every ratio is relative to;
* ``checkpoint`` -- every block through ``dsplug.checkpointing.checkpoint`` (default settings);
* ``checkpoint+cpu`` -- ``checkpoint_in_cpu`` (on a CPU run the "host copy" is an extra copy);
* ``checkpoint+partition+contiguous`` -- ``partition_activations`` (no mpu: the slice is the
  whole input) kept in the contiguous buffers (``num_checkpoints`` 6).

Memory, each mode in a fresh process:

* **activation peak** (exact, deterministic): the largest total size of distinct tensor storages
  held for backward at any moment of one forward + backward, tracked with
  ``torch.autograd.graph.saved_tensors_hooks`` (a storage counts from the first pack that holds it
  until its last saved reference is released; parameters excluded), plus the contiguous buffers,
  which live outside autograd for the whole run (their bytes, counted once, whole).
* **peak RSS growth** (end to end): after two warm-up steps the peak RSS is reset
  (``/proc/self/clear_refs``); the peak RSS (``VmHWM``) of one more forward + backward minus the
  RSS before it. The process runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns
  freed tensors to the OS and the RSS follows live memory. Includes every temporary of the step
  (not only what is saved for backward), so it shows what the saving is worth in the total.

Step time: all modes in one process, one step of each in turn per round (so load on the machine
hits every mode alike), median over the rounds after a warm-up round. Switching modes sets the
active settings directly instead of calling ``configure()``, which would free the contiguous
buffers that a real run keeps.

    python benchmarks/activation_checkpointing.py [--rounds 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref

MODES = ["no checkpointing", "checkpoint", "checkpoint+cpu", "checkpoint+partition+contiguous"]
D_MODEL, LAYERS, HEADS, SEQ, BATCH, VOCAB = 256, 6, 4, 128, 16, 96
OPTIONS = {"checkpoint": {}, "checkpoint+cpu": {"checkpoint_in_cpu": True},
           "checkpoint+partition+contiguous": {"partition_activations": True, "contiguous_checkpointing": True,
                                               "num_checkpoints": LAYERS}}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _model(mode):
    import torch

    import dsplug
    from dsplug.plugins.train.model import CharTransformer, ModelConfig

    torch.manual_seed(0)
    model = CharTransformer(ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=D_MODEL, n_layers=LAYERS,
                                        n_heads=HEADS))
    if mode != "no checkpointing":
        ck = dsplug.checkpointing
        for block in model.blocks:
            block.forward = lambda *args, _forward=block.forward: ck.checkpoint(_forward, *args)
    return model


def _select(mode) -> None:
    """Make ``mode``'s settings active (see the module docstring)."""
    from dsplug.plugins.activation_checkpointing import checkpointing as impl

    defaults = impl.attrs.asdict(impl.CheckpointingSettings())
    impl._settings = impl.CheckpointingSettings(**{**defaults, **OPTIONS.get(mode, {})})


def _data():
    import torch

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, inputs, targets) -> float:
    import torch.nn.functional as F

    loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    model.zero_grad(set_to_none=False)
    return loss.item()


class SavedBytes:
    """Peak bytes of distinct storages autograd holds for backward (``skip``: storages not counted)."""

    def __init__(self, skip):
        self.skip = set(skip)
        self.refs = {}  # storage pointer -> [saved references, bytes]
        self.live = self.peak = 0

    def _release(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def pack(self, tensor):
        class Held:
            pass

        held = Held()
        held.tensor = tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip:
            return held
        entry = self.refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def unpack(held):
        return held.tensor


def memory_child(mode: str) -> dict:
    import torch

    from dsplug.plugins.activation_checkpointing import checkpointing as impl

    torch.set_num_threads(2)
    model = _model(mode)
    _select(mode)
    inputs, targets = _data()
    loss = _step(model, inputs, targets)
    _step(model, inputs, targets)  # warm-up: one-time allocations (thread pools, kernels) happen here
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    rss_before = _status_bytes("VmRSS")
    _step(model, inputs, targets)
    rss_growth = _status_bytes("VmHWM") - rss_before
    buffers = [b.untyped_storage() for b in impl._BUFFERS.buffers.values()]
    skip = [p.untyped_storage().data_ptr() for p in model.parameters()] + [b.data_ptr() for b in buffers]
    tracker = SavedBytes(skip)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        _step(model, inputs, targets)
    return {"mode": mode, "loss": loss, "saved_peak": tracker.peak, "buffers": sum(b.nbytes() for b in buffers),
            "rss_growth": max(0, rss_growth)}


def time_all(rounds: int) -> dict:
    import torch

    torch.set_num_threads(2)
    models = {mode: _model(mode) for mode in MODES}
    inputs, targets = _data()
    times = {mode: [] for mode in MODES}
    for r in range(rounds + 1):
        for mode in MODES:
            _select(mode)
            start = time.perf_counter()
            _step(models[mode], inputs, targets)
            if r:  # round 0 warms up
                times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(memory_child(args.child)))
        return
    import torch

    print(f"built-in LM: d_model {D_MODEL}, {LAYERS} layers, {HEADS} heads, seq {SEQ}, batch {BATCH}, vocab {VOCAB}; "
          f"fp32 on CPU, 2 threads, torch {torch.__version__}; step = forward + backward, median of {args.rounds} "
          "interleaved rounds")
    memory = []
    for mode in MODES:
        # large allocations always mmap-ed, so freed activations leave the RSS (glibc would keep them)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run([sys.executable, __file__, "--child", mode], check=True, capture_output=True, text=True,
                             env=env)
        memory.append(json.loads(out.stdout.strip().splitlines()[-1]))
    times = time_all(args.rounds)
    mib = 2 ** 20
    base = memory[0]
    base_act = base["saved_peak"] + base["buffers"]
    header = (f"{'mode':33s} {'autograd peak':>13s} {'+ buffers':>9s} {'activations':>11s} {'x base':>6s}  "
              f"{'peak RSS growth':>15s} {'x base':>6s}  {'step':>7s} {'x base':>6s}")
    print(header)
    print("-" * len(header))
    for m in memory:
        act = m["saved_peak"] + m["buffers"]
        step = times[m["mode"]]
        print(f"{m['mode']:33s} {m['saved_peak'] / mib:10.1f}MiB {m['buffers'] / mib:6.1f}MiB {act / mib:8.1f}MiB "
              f"{act / base_act:6.3f}  {m['rss_growth'] / mib:12.1f}MiB {m['rss_growth'] / base['rss_growth']:6.3f}  "
              f"{step * 1000:5.0f}ms {step / times[MODES[0]]:6.3f}")
    same = all(m["loss"] == base["loss"] for m in memory)
    print(f"first-step loss identical in every mode: {same} ({base['loss']:.6f})")


if __name__ == "__main__":
    main()
