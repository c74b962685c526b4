"""Fuzzing the config loader and DsplugConfig with mutations of realistic DeepSpeed configs.

Every generated config must end in exactly one of two ways:

* rejected with a :class:`ConfigError` (never another exception, never a hang), or
* accepted, and then :func:`check_accepted` — written here independently of the schemas —
  finds nothing that trains to NaN: every number finite and 64-bit, learning rates and loss
  scales in the ranges fp32 can hold, step counts whole and positive, nvme offload with a path.

Mutations: values replaced by NaN / ±inf / 1e308 / huge integers / wrong types, keys deleted,
typo'd keys added, values nested thousands of levels deep, keys duplicated in the text, invalid
bytes injected, text truncated; delivered as a dict, JSON text, bytes, a .json or .hjson file.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import signal
import struct
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsplug.config import ConfigError, DsplugConfig

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # ~10-20 s: 750 generated configs

# ------------------------------------------------------------------------------ base configs
HF_ZERO2 = {  # Hugging Face's ds_config_zero2.json
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO3_NVME = {  # ZeRO-Infinity with concrete values, as accelerate writes them (steps_per_print inf)
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_min_lr": 0,
                                                      "warmup_max_lr": 3e-5, "warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True},
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": math.inf,
    "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
    "gradient_predivide_factor": 1.0,
}
CLASSIC_FP16 = {  # DeepSpeed-docs style: static loss scale, Lamb, OneCycle, ZeRO-1
    "train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_predivide_factor": 2.0,
    "prescale_gradients": False,
    "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01}},
    "scheduler": {"type": "OneCycle", "params": {
        "cycle_first_step_size": 1000, "cycle_min_lr": 1e-4, "cycle_max_lr": [1e-3], "decay_lr_rate": 0.001,
        "decay_step_size": 1000, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99, "decay_mom_rate": 0.0}},
    "fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 1},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1},
}
AMP_TORCH_OPTIM = {  # amp + a torch.optim class selected by name + LR range test
    "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10, "seed": 1234, "gradient_predivide_factor": 8,
    "optimizer": {"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "momentum": 0.9}},
    "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": [1e-4], "lr_range_test_step_size": 100,
                                                    "lr_range_test_step_rate": 5, "lr_range_test_staircase": False}},
    "amp": {"enabled": True, "opt_level": "O1", "loss_scale": "dynamic", "max_loss_scale": 65536},
    "comms_logger": {"enabled": False, "prof_all": True},
}
COSINE_FP16 = {  # dynamic fp16 loss scaling, WarmupCosineLR ratios, torch's Adam
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
    "steps_per_print": 100,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2,
             "consecutive_hysteresis": False, "min_loss_scale": 0.25},
    "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                             "torch_adam": True}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000, "warmup_num_steps": 200,
                                                       "warmup_min_ratio": 0.01, "cos_min_ratio": 0.1}},
    "zero_optimization": {"stage": 0},
}
BASES = {
    "cosine-fp16": COSINE_FP16,
    "train-default": json.loads((REPO / "plugins" / "train" / "default_config.json").read_text()),
    "hf-zero2": HF_ZERO2,
    "hf-zero3-nvme": HF_ZERO3_NVME,
    "classic-fp16": CLASSIC_FP16,
    "amp-torch-optim": AMP_TORCH_OPTIM,
}

# ------------------------------------------------------------------------- the independent checker
LR_MAX = 1e6
FP32_MAX = struct.unpack("f", b"\xff\xff\x7f\x7f")[0]
FP32_MIN_NORMAL = 2.0 ** -126
INT64 = (-(2 ** 63), 2 ** 63 - 1)
SCALE_KEYS = ("loss_scale", "min_loss_scale", "max_loss_scale")


def _numbers(value):
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def check_accepted(config: DsplugConfig) -> None:
    """Nothing in an accepted config may make training produce NaN."""
    data = config.to_dict()
    json.dumps(data, allow_nan=False)  # raises on any NaN / Infinity left anywhere
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        name = path.rsplit(".", 1)[-1]
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in value.items())
            if value.get("device") == "nvme":
                assert isinstance(value.get("nvme_path"), str) and value["nvme_path"], path
            continue
        for number in _numbers(value):
            assert math.isfinite(number), (path, number)
            if isinstance(number, int):
                assert INT64[0] <= number <= INT64[1], (path, number)
            if name == "lr" or name.endswith("_lr"):
                assert 0 <= number <= LR_MAX, (path, number)
            if name in SCALE_KEYS and not (name == "loss_scale" and number == 0):  # fp16: 0 = dynamic
                assert FP32_MIN_NORMAL <= number <= FP32_MAX and 1 / number <= FP32_MAX, (path, number)
            if name.endswith("_ratio"):
                assert 0 <= number <= 1, (path, number)
        if name == "initial_scale_power":
            assert 0 <= value and 2.0 ** value <= FP32_MAX, (path, value)
        if name in ("steps_per_print", "hysteresis", "loss_scale_window"):
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (path, value)
        if name == "gradient_clipping" and not isinstance(value, str):
            assert value >= 0, (path, value)
        if name == "gradient_predivide_factor":  # divided by, then multiplied back: both ways finite in fp32
            assert value > 0 and value <= FP32_MAX and 1 / value <= FP32_MAX, (path, value)
            assert 1e-6 <= value <= 1e6, (path, value)
        if name == "betas" and isinstance(value, list):
            assert all(0 <= b < 1 for b in value), (path, value)
    # nvme offload needs a directory the user chose (no default is guessed)
    zero = config.raw.get("zero_optimization")
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key) if isinstance(zero, dict) else None
        if isinstance(section, dict) and section.get("device") == "nvme":
            assert isinstance(section.get("nvme_path"), str) and section["nvme_path"], (key, section)
    # what the engine reads
    assert isinstance(config.steps_per_print, int) and config.steps_per_print >= 1
    for step in (1, 10, 2000, 10 ** 9):
        if config.raw.get("steps_per_print") == math.inf:
            assert step % config.steps_per_print != 0


# ------------------------------------------------------------------------------ mutations
NASTY = [math.nan, math.inf, -math.inf, 1e308, -1e308, 1e-320, -1, 0, 0.5, 2 ** 63, 2 ** 64, -(2 ** 63) - 1,
         10 ** 400, 10 ** 30, "", "auto", "nvme", "NaN", "Infinity", [], [math.nan], [1e308, 1], {},
         {"a": math.inf}, {"lr": math.nan}, None, True, False, 8.0, 1e9, 3]


#: extreme numbers of the right type, near the bounds that matter (fp32's range, 64 bits, MAX_LR)
EXTREME = [math.nan, math.inf, -math.inf, 1e308, 1e300, 1e39, 2.0 ** 128, 2.0 ** 127, 3.5e38, 1e30, 1e10, 1e6, 1e6 + 1, 1e3, 1.5, 1, 0, 0.0, -0.0,
           1e-6, 1e-30, 1e-45, 1e-300, 5e-324, -1e-300, -1, 2 ** 53, 2 ** 63 - 1, 2 ** 63, 127, 128, 1e18, 9.3e18]


#: the keys whose extreme values train to NaN: mutated more often than the others
TARGETS = re.compile(r"(^lr$|_lr$|loss_scale|scale_power|hysteresis|steps_per_print|gradient_clipping|predivide|"
                     r"_ratio$|step_rate|betas|eps$|weight_decay|momentum|_mom$)")


def numeric_paths(obj):
    return [p for p in paths_of(obj) if isinstance(get(obj, p), (int, float)) and not isinstance(get(obj, p), bool)]


class Deep:
    """A value nested ``depth`` levels deep, materialised without recursion."""

    def __init__(self, depth: int, kind: str):
        self.depth, self.kind = depth, kind

    def text(self) -> str:
        if self.kind == "list":
            return "[" * self.depth + "1" + "]" * self.depth
        return '{"a": ' * self.depth + "1" + "}" * self.depth

    def build(self):
        value = 1
        for _ in range(self.depth):
            value = [value] if self.kind == "list" else {"a": value}
        return value


def paths_of(obj, prefix=()):
    """Every path (tuple of keys / indices) to a value below ``obj``, without descending into Deep."""
    out = []
    stack = [(obj, prefix)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                out.append(path + (k,))
                stack.append((v, path + (k,)))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                out.append(path + (i,))
                stack.append((v, path + (i,)))
    return sorted(out, key=lambda p: [str(x) for x in p])


def dict_paths(obj):
    return [()] + [p for p in paths_of(obj) if isinstance(get(obj, p), dict)]


def get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def typo(key: str, how: int) -> str:
    if len(key) < 2:
        return key + "x"
    i = how % (len(key) - 1)
    return [key[:i] + key[i + 1:], key[:i] + key[i + 1] + key[i] + key[i + 2:], key + "s", key.upper(),
            key.replace("_", "-")][how % 5]


@st.composite
def mutated(draw, numbers_only: bool = False):
    """``(base name, mutated config)``; ``numbers_only``: only numbers replaced by numbers (mostly at
    the keys that matter), so that many results are accepted and go through the checker."""
    name = draw(st.sampled_from(sorted(BASES)))
    config = copy.deepcopy(BASES[name])
    ops = (["target", "target", "target", "extreme"] if numbers_only else
           ["target", "target", "extreme", "extreme", "replace", "replace", "delete", "typo", "nest"])
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(ops))
        if op in ("extreme", "target"):  # a number of the right type, at or beyond a bound
            paths = numeric_paths(config)
            if op == "target":
                paths = [p for p in paths if any(TARGETS.search(str(k)) for k in p[-2:])] or paths
                offload = [p for p in paths_of(config) if p[-1] in ("nvme_path", "device")]
                if offload and draw(st.integers(0, 3)) == 0:  # nvme without its directory
                    path = draw(st.sampled_from(offload))
                    parent = get(config, path[:-1])
                    if path[-1] == "device":
                        parent["device"] = "nvme"
                    else:
                        choice = draw(st.sampled_from(["delete", None, ""]))
                        if choice == "delete":
                            del parent["nvme_path"]
                        else:
                            parent["nvme_path"] = choice
                    continue
            if paths:
                path = draw(st.sampled_from(paths))
                get(config, path[:-1])[path[-1]] = draw(st.sampled_from(EXTREME))
            continue
        if op in ("replace", "delete", "nest"):
            paths = paths_of(config)
            if not paths:
                continue
            path = draw(st.sampled_from(paths))
            parent, last = get(config, path[:-1]), path[-1]
            if op == "replace":
                parent[last] = copy.deepcopy(draw(st.sampled_from(NASTY)))
            elif op == "delete":
                del parent[last]
            else:
                parent[last] = Deep(draw(st.sampled_from([20, 99, 101, 500, 5000])), draw(st.sampled_from(["dict", "list"])))
        else:  # a typo'd key next to the real one
            where = get(config, draw(st.sampled_from(dict_paths(config))))
            keys = sorted(k for k in where if isinstance(k, str))
            if not keys:
                continue
            key = draw(st.sampled_from(keys))
            where[typo(key, draw(st.integers(0, 20)))] = copy.deepcopy(draw(st.sampled_from(NASTY + [1])))
    return name, config


def materialise(obj):
    """The dict form (Deep values built)."""
    if isinstance(obj, Deep):
        return obj.build()
    if isinstance(obj, dict):
        return {k: materialise(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialise(v) for v in obj]
    return obj


def to_text(obj, duplicate=None, path=()) -> str:
    """JSON text (NaN / Infinity as Python writes them); ``duplicate=(dict path, key, value)`` writes
    that key a second time in that object."""
    if isinstance(obj, Deep):
        return obj.text()
    if isinstance(obj, dict):
        items = [f"{json.dumps(k)}: {to_text(v, duplicate, path + (k,))}" for k, v in obj.items()]
        if duplicate is not None and duplicate[0] == path:
            items.append(f"{json.dumps(duplicate[1])}: {to_text(duplicate[2])}")
        return "{\n" + ",\n".join(items) + "\n}"
    if isinstance(obj, list):
        return "[" + ", ".join(to_text(v, duplicate, path + (i,)) for i, v in enumerate(obj)) + "]"
    return json.dumps(obj)


def as_hjson(text: str) -> str:
    """Quoteless keys and no commas at line ends: json.loads refuses it, the HJSON reader takes it."""
    return re.sub(r',\n', "\n", re.sub(r'^(\s*)"(\w+)":', r"\1\2:", text, flags=re.M))


BAD_BYTES = [b"\xff", b"\xfe\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82"]


# --------------------------------------------------------------------------------- harness
@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail (instead of hanging) when one config takes longer than ``seconds``."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"a config took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def judge(source, world_size, stats: Counter):
    """The ConfigError's message, or None when the config was accepted (and passed the checker)."""
    stats["total"] += 1
    started = time.perf_counter()
    with time_limit(20), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = DsplugConfig(source, world_size=world_size)
        except ConfigError as exc:
            stats["rejected"] += 1
            assert exc.issues and str(exc).startswith("invalid dsplug config")
            return str(exc)
    assert time.perf_counter() - started < 20
    stats["accepted"] += 1
    check_accepted(config)
    return None


WORLD = st.sampled_from([None, 1, 2, 8])
def fuzz_settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_base_configs_are_valid_and_pass_the_checker():
    for name, base in BASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = DsplugConfig(copy.deepcopy(base), world_size=2)
        check_accepted(config)


def test_fuzzed_values_never_crash_and_never_accept_nan_producing_numbers(tmp_path):
    stats = Counter()

    @fuzz_settings(300)
    @given(case=mutated(), world=WORLD, how=st.sampled_from(["dict", "text", "bytes", "file", "hjson"]))
    def run(case, world, how):
        _, config = case
        if how == "dict":
            source = materialise(config)
        else:
            text = to_text(config)
            if how == "text":
                source = text
            elif how == "bytes":
                source = text.encode()
            else:
                path = tmp_path / ("c.hjson" if how == "hjson" else "c.json")
                path.write_text(as_hjson(text) if how == "hjson" else text, encoding="utf-8")
                source = str(path)
        judge(source, world, stats)

    run()
    assert stats["total"] >= 300
    assert stats["accepted"] >= 30 and stats["rejected"] >= 150, stats  # both outcomes really exercised


def test_fuzzed_numbers_at_the_bounds_are_accepted_only_when_safe():
    """Only numbers changed, mostly learning rates, loss scales, step counts, ratios: many configs are
    accepted, and the checker must find nothing that trains to NaN in any of them."""
    stats = Counter()

    @fuzz_settings(300)
    @given(case=mutated(numbers_only=True), world=WORLD, how=st.sampled_from(["dict", "text"]))
    def run(case, world, how):
        _, config = case
        judge(materialise(config) if how == "dict" else to_text(config), world, stats)

    run()
    assert stats["total"] >= 300 and stats["accepted"] >= 60 and stats["rejected"] >= 60, stats


def test_fuzzed_text_never_crashes(tmp_path):
    """Duplicate keys, invalid bytes, truncation: always a ConfigError, never a duplicate silently dropped."""
    stats = Counter()

    @fuzz_settings(150)
    @given(case=mutated(), world=WORLD, data=st.data(),
           how=st.sampled_from(["duplicate", "duplicate", "bad-bytes", "bad-bytes-file", "truncate", "hjson-dup"]))
    def run(case, world, data, how):
        _, config = case
        if how in ("duplicate", "hjson-dup"):
            where = data.draw(st.sampled_from(dict_paths(config)))
            keys = sorted(get(config, where))
            if not keys:
                return
            key = data.draw(st.sampled_from(keys))
            value = data.draw(st.sampled_from([1, "x", None, math.nan, {"stage": 3}, [1]]))
            text = to_text(config, (where, key, value))
            if how == "hjson-dup":
                path = tmp_path / "dup.hjson"
                path.write_text(as_hjson(text), encoding="utf-8")
                text = str(path)
            message = judge(text, world, stats)
            assert message is not None, f"a key given twice was accepted: {key!r} in {where}"
            # (nesting is checked first; NaN / Infinity in a list are not HJSON: a syntax error there)
            if "nested more than" not in message and not (how == "hjson-dup" and "nor HJSON" in message):
                assert "given twice" in message, message
                if how == "duplicate":
                    assert re.search(r"line \d+ and line \d+", message), message
            return
        raw = to_text(config).encode()
        if how == "truncate":
            cut = data.draw(st.integers(0, max(0, len(raw) - 1)))
            judge(raw[:cut].decode("utf-8", "ignore"), world, stats)
            return
        at = data.draw(st.integers(0, len(raw)))
        raw = raw[:at] + data.draw(st.sampled_from(BAD_BYTES)) + raw[at:]
        if how == "bad-bytes-file":
            path = tmp_path / "bad.json"
            path.write_bytes(raw)
            message = judge(str(path), world, stats)
        else:
            message = judge(raw, world, stats)
        assert message is not None and "is not UTF-8 text" in message and "\n" not in message, message

    run()
    assert stats["total"] >= 120, stats
