"""Compression methods on the `dsplug train` character LM, relative to the dense model, same run.

    python benchmarks/compression.py                    # 300 steps, 4 layers, d_model 128 (~4 min on 2 cores)
    python benchmarks/compression.py --steps 100 --layers 2

One invocation trains the built-in character transformer (plugins/train: CharTransformer, the
built-in corpus, its train / held-out split and ``held_out_loss``) four times with the same seed,
the same data order (the engine's loader, seeded by the config) and the same number of steps,
each through ``dsplug.initialize`` (AdamW + WarmupCosineLR as in the built-in
``default_config.json``, monitors off) and ``engine(x)`` / ``engine.backward`` / ``engine.step``:

* ``dense``: the baseline;
* ``quant-int8``: ``weight_quantization`` of every Linear layer, 8 bits, symmetric, quantized in
  the forward from ``schedule_offset`` (10% of the steps), then ``redundancy_clean``. Bytes on
  disk are the real storage: the quantized weights saved as int8 codes + float32 scales
  (``quantize_to_int``), everything else as in the dense save; the file is loaded back into a
  fresh model and its held-out loss checked against the cleaned model's;
* ``row-prune-50%``: ``row_pruning`` of half the rows of each block's ``mlp.0`` (related
  ``mlp.2``) from ``schedule_offset`` (30% of the steps), then ``redundancy_clean``, which removes
  them physically;
* ``layer-reduce``: a student with half the layers, initialised from the trained dense model
  (``init_compression(student, config, teacher_model=dense)``, evenly spaced teacher layers,
  embeddings and final LayerNorm copied), then trained like the others (so it has had the dense
  model's steps plus its own: its held-out loss is not one at equal training).

Per variant: parameters, bytes on disk (``torch.save`` of the final, cleaned state dict), held-out
loss, mean training step time (ms, after ``--warmup`` steps; also only over the steps after the
method's schedule offset) and the final model's forward time on a held-out batch, with each
figure's ratio to ``dense``. The held-out loss of each compressed model before and after
``redundancy_clean`` is printed too (they should agree to float rounding).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _builtin_lm import builtin_lm_config  # noqa: E402


# ------------------------------------------------------------------------------ configs
def base_config(args) -> Dict[str, Any]:
    """The built-in ``dsplug train`` config without its monitors, filled in for this run."""
    raw = builtin_lm_config(args.micro_batch, args.seed, args.steps)
    return raw


def quant_section(args) -> Dict[str, Any]:
    return {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantizer_kernel": False,
                              "schedule_offset": quant_offset(args), "quantize_groups": args.quantize_groups,
                              "quantization_type": "symmetric", "rounding": "nearest",
                              "quantize_weight_in_forward": True},
        "different_groups": {"wq": {"params": {"start_bits": args.bits, "target_bits": args.bits,
                                               "quantization_period": 1},
                                    "modules": [args.quantize_modules]}}}}


def prune_section(args) -> Dict[str, Any]:
    return {"row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": prune_offset(args), "method": args.prune_method},
        "different_groups": {"rp": {"params": {"dense_ratio": args.dense_ratio},
                                    "modules": [r"mlp\.0$"], "related_modules": [[r"mlp\.2$"]]}}}}


def teacher_layers(n_layers: int, keep: int) -> List[int]:
    """``keep`` evenly spaced layers of ``n_layers`` (4 -> 2: [0, 2])."""
    return [i * n_layers // keep for i in range(keep)]


def reduce_section(args) -> Dict[str, Any]:
    keep = max(1, args.layers // 2)
    return {"layer_reduction": {"enabled": True, "keep_number_layer": keep, "module_name_prefix": "blocks",
                                "teacher_layer": teacher_layers(args.layers, keep),
                                "other_module_name": ["token_embedding", "position_embedding", "ln_final"]}}


def quant_offset(args) -> int:
    return int(round(0.1 * args.steps))


def prune_offset(args) -> int:
    return int(round(0.3 * args.steps))


def with_compression(config: Dict[str, Any], section: Dict[str, Any]) -> Dict[str, Any]:
    config = copy.deepcopy(config)
    config["compression_training"] = section
    return config


# ------------------------------------------------------------------------------ training and measuring
class Data:
    def __init__(self, args):
        from dsplug.plugins.train.data import CharVocab, CharWindows, read_builtin_corpus, split_tokens

        text = read_builtin_corpus()
        self.vocab = CharVocab.of_text(text)
        tokens = torch.tensor(self.vocab.encode(text), dtype=torch.long)
        self.train_tokens, self.held_tokens = split_tokens(tokens, args.seq_len)
        self.dataset = CharWindows(self.train_tokens, args.seq_len)
        self.chars = len(text)


def model_config(args, vocab_size: int, n_layers: Optional[int] = None):
    from dsplug.plugins.train.model import ModelConfig

    return ModelConfig(vocab_size=vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                       n_layers=n_layers or args.layers, n_heads=args.heads)


def fresh_model(args, data: Data, n_layers: Optional[int] = None):
    from dsplug.plugins.train.model import CharTransformer

    torch.manual_seed(args.seed)
    return CharTransformer(model_config(args, len(data.vocab), n_layers))


def train(model, config: Dict[str, Any], data: Data, args):
    """(trained module, per-step seconds); the engine's loader gives the same order for every run."""
    import dsplug
    from dsplug.plugins.train.data import batches_from
    from dsplug.plugins.train.model import next_token_loss

    engine, _, loader, _ = dsplug.initialize(model=model, training_data=data.dataset, config=config)
    batches = batches_from(loader, 0)
    times = []
    engine.train()
    while engine.global_steps < args.steps:
        x, y = next(batches)
        start = time.perf_counter()
        loss = next_token_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    module = engine.module
    engine.destroy()
    return module, times


def held_out(model, data: Data, args) -> float:
    from dsplug.plugins.train.data import held_out_loss

    return held_out_loss(model, data.held_tokens, args.seq_len, args.micro_batch)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # the tied head counts once


def saved_bytes(state: Dict[str, Any], name: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.pt")
        torch.save(state, path)
        return os.path.getsize(path)


@torch.no_grad()
def forward_ms(models: List[Any], data: Data, args, rounds: int = 5, repeats: int = 5) -> List[float]:
    """Median time (ms) of one eval forward of a held-out micro-batch, per model; the models take
    turns (``rounds`` x ``repeats`` forwards each), so a load change hits them alike."""
    x = torch.stack([data.held_tokens[i * args.seq_len:(i + 1) * args.seq_len] for i in range(args.micro_batch)
                     if (i + 1) * args.seq_len <= len(data.held_tokens)])
    for model in models:
        model.eval()
        model(x)
    times: List[List[float]] = [[] for _ in models]
    for _ in range(rounds):
        for model, out in zip(models, times):
            for _ in range(repeats):
                start = time.perf_counter()
                model(x)
                out.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def mean_ms(times: List[float], first: int) -> float:
    tail = times[first:]
    return statistics.fmean(tail) * 1e3 if tail else float("nan")


# ------------------------------------------------------------------------------ int8 storage
def quantized_layers(model) -> Dict[str, Any]:
    """{layer name: WeightQuant} of the layers whose weights are quantized now."""
    out = {}
    for name, module in model.named_modules():
        quant = getattr(module, "weight_quant", None)
        if quant is not None and quant.bits is not None:
            out[name] = quant
    return out


def int_codes(model, layers: Dict[str, Any]) -> Dict[str, Any]:
    """{layer name: QuantizedTensor} of the trained float weights (before the clean bakes them)."""
    from dsplug.ops.quantize import quantize_to_int

    return {name: quantize_to_int(model.get_submodule(name).weight.detach(), quant.bits, groups=quant.groups,
                                  symmetric=quant.symmetric)
            for name, quant in layers.items()}


def int_state_dict(cleaned, codes: Dict[str, Any]) -> Dict[str, Any]:
    """The cleaned model's state dict with each quantized weight (and any tensor tied to it) as codes."""
    state = cleaned.state_dict()
    by_storage = {cleaned.get_submodule(name).weight.data_ptr(): qt.state_dict() for name, qt in codes.items()}
    return {key: by_storage.get(value.data_ptr(), value) if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}


def load_int_state(model, state: Dict[str, Any]):
    from dsplug.ops.quantize import QuantizedTensor

    plain = {key: QuantizedTensor.from_state_dict(value).dequantize() if isinstance(value, dict) else value
             for key, value in state.items()}
    model.load_state_dict(plain)
    return model


# ------------------------------------------------------------------------------ the variants
def run(args) -> None:
    from dsplug.compression.compress import init_compression, redundancy_clean
    from dsplug.ops import quantize as quant_ops

    torch.set_num_threads(args.threads)
    data = Data(args)
    config = base_config(args)
    rows = []
    notes = []

    def add(name, model, state, times, loss, offset):  # the final model is kept for forward timing
        rows.append(dict(name=name, params=num_params(model), bytes=saved_bytes(state, name), loss=loss,
                         ms=mean_ms(times, args.warmup), ms_after=mean_ms(times, max(args.warmup, offset)),
                         model=model))
        print(f"  {name}: done, held-out loss {loss:.4f}", flush=True)

    print(f"character transformer: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context "
          f"{args.seq_len}, vocabulary {len(data.vocab)}; {data.chars / 1000:.0f} KB built-in corpus "
          f"({len(data.dataset)} training windows, {len(data.held_tokens)} held-out characters)")
    print(f"{args.steps} steps x {args.micro_batch} sequences, AdamW lr {config['optimizer']['params']['lr']}, "
          f"seed {args.seed}, {args.threads} thread(s); quantizer backend: {quant_ops.backend()}", flush=True)

    # 1. dense
    dense, times = train(fresh_model(args, data), config, data, args)
    add("dense", dense, dense.state_dict(), times, held_out(dense, data, args), 0)

    # 2. weight quantization -> int8 storage
    qconfig = with_compression(config, quant_section(args))
    model, times = train(fresh_model(args, data), qconfig, data, args)
    before = held_out(model, data, args)
    layers = quantized_layers(model)
    codes = int_codes(model, layers)
    cleaned = redundancy_clean(model, qconfig)
    after = held_out(cleaned, data, args)
    exact = all(torch.equal(qt.dequantize(), cleaned.get_submodule(name).weight.detach())
                for name, qt in codes.items())
    state = int_state_dict(cleaned, codes)
    reloaded = held_out(load_int_state(fresh_model(args, data), state), data, args)
    add("quant-int8", cleaned, state, times, after, quant_offset(args))
    notes.append(f"quant-int8: held-out loss before clean {before:.6f}, after {after:.6f} "
                 f"(diff {after - before:+.2e}); "
                 f"{len(codes)} Linear weights stored as int{args.bits} codes + {args.quantize_groups} float32 "
                 f"scale(s) each; codes dequantize to the cleaned weights exactly: {exact}; loaded back from the "
                 f"int file: held-out loss {reloaded:.6f} (diff {reloaded - after:+.2e})")
    if "head" in codes:
        notes.append("  (head.weight is tied to token_embedding.weight: before the clean only the head's use of it is "
                     "quantized, the clean bakes Q(w) into the shared weight, so the embedding lookups change too -- "
                     "the source of the before/after difference; --quantize-modules blocks leaves the head out)")

    # 3. row pruning
    pconfig = with_compression(config, prune_section(args))
    model, times = train(fresh_model(args, data), pconfig, data, args)
    before = held_out(model, data, args)
    cleaned = redundancy_clean(model, pconfig)
    after = held_out(cleaned, data, args)
    widths = sorted({block.mlp[0].out_features for block in cleaned.blocks})
    add(f"row-prune-{round(100 * (1 - args.dense_ratio))}%", cleaned, cleaned.state_dict(), times, after,
        prune_offset(args))
    notes.append(f"row-prune: held-out loss before clean {before:.6f}, after {after:.6f} (diff {after - before:+.2e}); "
                 f"mlp.0 widths after clean: {widths} (of {4 * args.d_model}), method {args.prune_method}")

    # 4. layer reduction, teacher = the dense model of (1)
    rconfig = with_compression(config, reduce_section(args))
    section = rconfig["compression_training"]["layer_reduction"]
    student = fresh_model(args, data, n_layers=section["keep_number_layer"])
    student = init_compression(student, rconfig, teacher_model=dense)
    at_init = held_out(student, data, args)
    model, times = train(student, rconfig, data, args)  # the engine keeps the reduced student as it is
    before = held_out(model, data, args)
    cleaned = redundancy_clean(model, rconfig)
    after = held_out(cleaned, data, args)
    add("layer-reduce", cleaned, cleaned.state_dict(), times, after, 0)
    notes.append(f"layer-reduce: {len(cleaned.blocks)} of {args.layers} layers, teacher layers "
                 f"{section['teacher_layer']}; held-out "
                 f"loss of the student at init {at_init:.4f}; before clean "
                 f"{before:.6f}, after {after:.6f} (diff {after - before:+.2e}); it continues from the dense "
                 f"model's {args.steps} steps, so its loss reflects {2 * args.steps} steps of training in all")

    for row, ms in zip(rows, forward_ms([r["model"] for r in rows], data, args)):
        row["fwd"] = ms
    print_table(rows, args)
    for note in notes:
        print(note)


def print_table(rows: List[Dict[str, Any]], args) -> None:
    base = rows[0]
    print()
    print(f"{'variant':<16}{'params':>10}{'x':>7}{'bytes':>11}{'x':>7}{'held-out':>10}{'x':>7}"
          f"{'step ms':>9}{'x':>7}{'after-offset ms':>17}{'x':>7}{'fwd ms':>8}{'x':>7}")
    for r in rows:
        print(f"{r['name']:<16}{r['params']:>10,}{r['params'] / base['params']:>7.3f}"
              f"{r['bytes']:>11,}{r['bytes'] / base['bytes']:>7.3f}"
              f"{r['loss']:>10.4f}{r['loss'] / base['loss']:>7.3f}"
              f"{r['ms']:>9.1f}{r['ms'] / base['ms']:>7.2f}"
              f"{r['ms_after']:>17.1f}{r['ms_after'] / base['ms_after']:>7.2f}"
              f"{r['fwd']:>8.2f}{r['fwd'] / base['fwd']:>7.2f}")
    print(f"x: ratio to dense (same invocation). step ms: mean training step (forward+backward+step) after "
          f"{args.warmup} warm-up steps; after-offset ms: only the steps after the method's schedule_offset "
          f"(quant {quant_offset(args)}, prune {prune_offset(args)}); fwd ms: median eval forward of the final model "
          f"on one held-out batch of {args.micro_batch} (models timed in turns); bytes: torch.save of the final "
          f"state dict.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (timings are steadier with 1)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time means")
    parser.add_argument("--bits", type=int, default=8, help="weight quantization bits (<= 8 for int storage)")
    parser.add_argument("--quantize-groups", type=int, default=1, help="quantize_groups (scales per weight matrix)")
    parser.add_argument("--quantize-modules", default="*", help="weight_quantization module pattern ('*': all Linear)")
    parser.add_argument("--prune-method", choices=("l1", "topk"), default="l1")
    parser.add_argument("--dense-ratio", type=float, default=0.5, help="share of mlp.0 rows kept")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error("--layers must be at least 2 (layer reduction keeps half)")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    run(args)


if __name__ == "__main__":
    sys.exit(main())
