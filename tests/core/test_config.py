"""The kernel's strict config rules, asserted by message content."""
from __future__ import annotations

import json
import typing
import warnings
from typing import Any, Dict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsplug.config.schema import field as schema_field, schema as schema_decorator
from dsplug.config import ConfigError, DsplugConfig, DsplugDeprecationWarning, fill_auto, infer_batch, parse, to_dict
from dsplug.config.batch import BatchError
from dsplug.config.kernel_schema import KernelConfig
from dsplug.config.schema import Report, field, schema
from dsplug.plugins.zero.config import ZeroConfig


def errors_of(config, world_size=1, **kw):
    with pytest.raises(ConfigError) as err:
        DsplugConfig(config, world_size=world_size, **kw)
    return [str(i) for i in err.value.issues]


# ---------------------------------------------------------------------------- loading
def test_loads_path_dict_json_text_and_hjson(tmp_path):
    data = {"train_batch_size": 8, "steps_per_print": 5}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    hjson_path = tmp_path / "ds.hjson"
    hjson_path.write_text("{\n  # comment\n  train_batch_size: 8\n  steps_per_print: 5\n}\n")
    for source in (data, json.dumps(data), str(path), path, str(hjson_path)):
        config = DsplugConfig(source, world_size=2)
        assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.steps_per_print) == (8, 4, 5)
    assert DsplugConfig(str(path), world_size=1).source == str(path)


def test_bad_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,,\n}')
    with pytest.raises(ConfigError, match=r"broken\.json is not valid JSON: .* line 2 column"):
        DsplugConfig(str(path), world_size=1)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        DsplugConfig(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------------------- unknown keys
def test_unknown_nested_key_names_json_path_and_closest_key():
    errors = errors_of({"train_batch_size": 4, "zero_optimization": {"stage": 0, "overlap_com": True}})
    assert any(e.startswith("zero_optimization.overlap_com: unknown key; did you mean "
                            "'zero_optimization.overlap_comm'?") for e in errors), errors


def test_unknown_top_level_key_differs_from_documented_but_missing_section():
    errors = errors_of({"train_batch_size": 4, "steps_per_prnt": 1, "nebula": {"enabled": True}})
    typo = next(e for e in errors if e.startswith("steps_per_prnt"))
    missing = next(e for e in errors if e.startswith("nebula"))
    assert "unknown top-level key; did you mean 'steps_per_print'?" in typo
    assert "DeepSpeed's Nebula checkpointing service section, but no installed dsplug plugin provides it (yet)" in missing
    assert "unknown" not in missing


def test_every_error_is_reported_not_only_the_first():
    errors = errors_of({
        "train_batch_size": 0,
        "gradient_clipping": "big",
        "wall_clock_breakdown": "yes",
        "communication_data_type": "fp8",
        "checkpoint": {"tag_validation": "Sometimes"},
    })
    joined = "\n".join(errors)
    assert "train_batch_size: 0 is not valid: must be >= 1" in joined
    assert "gradient_clipping: 'big' is not valid: expected a number" in joined
    assert "wall_clock_breakdown: 'yes' is not valid: expected a boolean" in joined
    assert "communication_data_type: 'fp8' is not valid: must be one of 'fp32', 'fp16', 'bf16'" in joined
    assert "checkpoint.tag_validation: 'Sometimes' is not valid" in joined and "'Ignore', 'Warn', 'Fail'" in joined


def test_integral_floats_are_integers_like_deepspeed_but_fractions_are_not():
    config = DsplugConfig({"train_batch_size": 4, "zero_optimization": {"reduce_bucket_size": 5e8}}, world_size=1)
    assert config.section("zero_optimization").reduce_bucket_size == 500_000_000
    assert isinstance(config.section("zero_optimization").reduce_bucket_size, int)
    report = Report()
    parse(ZeroConfig, {"reduce_bucket_size": 2.5}, "zero_optimization", report)
    assert str(report.errors[0]) == "zero_optimization.reduce_bucket_size: 2.5 is not valid: expected an integer"


def test_case_insensitive_choices_store_canonical_spelling():
    config = DsplugConfig({"train_batch_size": 2, "checkpoint": {"tag_validation": "fail"}}, world_size=1)
    assert config.checkpoint.tag_validation == "Fail"


def test_kernel_rule_communication_dtype():
    errors = errors_of({"train_batch_size": 2, "fp32_allreduce": True, "communication_data_type": "bf16"})
    assert any("communication_data_type: 'bf16' contradicts fp32_allreduce=true" in e for e in errors)


# ---------------------------------------------------------------------------- batch sizes
def test_batch_triple_inconsistent_with_world_size():
    errors = errors_of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2}, world_size=3)
    assert any("train_batch_size=32 is not train_micro_batch_size_per_gpu=4 × gradient_accumulation_steps=2 × "
               "world size 3 (= 24)" in e for e in errors)


def test_batch_needs_something():
    errors = errors_of({"gradient_accumulation_steps": 2}, world_size=1)
    assert any("set train_batch_size or train_micro_batch_size_per_gpu" in e for e in errors)


def test_batch_without_world_size_checks_the_triple_implies_one():
    DsplugConfig({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    errors = errors_of({"train_batch_size": 25, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2}, world_size=None)
    assert any("no world size fits" in e for e in errors)


@settings(max_examples=200, deadline=None)
@given(mb=st.integers(1, 64), gas=st.integers(1, 16), world=st.integers(1, 64),
       which=st.sampled_from(["tb+mb", "tb+gas", "mb+gas", "all"]))
def test_batch_inference_recovers_the_missing_member(mb, gas, world, which):
    tb = mb * gas * world
    given_ = {"tb+mb": (tb, mb, None), "tb+gas": (tb, None, gas), "mb+gas": (None, mb, gas), "all": (tb, mb, gas)}
    assert infer_batch(*given_[which], world) == (tb, mb, gas)


@settings(max_examples=200, deadline=None)
@given(tb=st.integers(1, 4096), mb=st.integers(1, 64), gas=st.integers(1, 16), world=st.integers(1, 64))
def test_batch_inference_never_returns_an_inconsistent_triple(tb, mb, gas, world):
    for args in ((tb, mb, None), (tb, None, gas), (tb, mb, gas), (tb, None, None)):
        try:
            got = infer_batch(*args, world)
        except BatchError as exc:
            assert "train_batch_size" in str(exc)
            continue
        assert got[0] == got[1] * got[2] * world
        assert all(given_v is None or given_v == v for given_v, v in zip(args, got))


# ---------------------------------------------------------------------------- round trips
kernel_values = st.fixed_dictionaries({}, optional={
    "gradient_clipping": st.floats(0, 10, allow_nan=False),
    "steps_per_print": st.integers(1, 1000),
    "wall_clock_breakdown": st.booleans(),
    "prescale_gradients": st.booleans(),
    "gradient_predivide_factor": st.floats(0.5, 8, allow_nan=False),
    "communication_data_type": st.sampled_from([None, "fp32", "fp16", "bf16"]),
    "checkpoint": st.fixed_dictionaries({}, optional={"tag_validation": st.sampled_from(["Ignore", "Warn", "Fail"]),
                                                      "load_universal": st.booleans()}),
    "data_types": st.fixed_dictionaries({}, optional={"grad_accum_dtype": st.sampled_from(["fp32", "bf16"])}),
})


@settings(max_examples=100, deadline=None)
@given(values=kernel_values)
def test_kernel_config_round_trips(values):
    first = parse(KernelConfig, values)
    again = parse(KernelConfig, json.loads(json.dumps(to_dict(first))))
    assert again == first


@settings(max_examples=60, deadline=None)
@given(stage=st.integers(0, 3), bucket=st.integers(1, 10**9), overlap=st.booleans(),
       device=st.sampled_from(["none", "cpu", "nvme"]), ratio=st.floats(0, 1, allow_nan=False))
def test_zero_section_round_trips(stage, bucket, overlap, device, ratio):
    data = {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": overlap,
            "offload_optimizer": {"device": device, "ratio": ratio}}
    first = parse(ZeroConfig, data)
    assert parse(ZeroConfig, json.loads(json.dumps(to_dict(first)))) == first


# ---------------------------------------------------------------------------- "auto"
def test_auto_batch_sizes_resolve_from_the_other_two_and_world():
    config = DsplugConfig({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 2}, world_size=3, strict_auto=True)
    assert config.train_batch_size == 24


def test_fill_auto_by_path_by_key_and_from_hidden_size():
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}},
           "zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "gradient_clipping": "auto"}
    out = fill_auto(raw, {"optimizer.params.lr": 3e-4, "eps": 1e-6, "gradient_clipping": 1.0}, hidden_size=1024)
    assert out["optimizer"]["params"] == {"lr": 3e-4, "eps": 1e-6}
    assert out["zero_optimization"] == {"reduce_bucket_size": 1024 * 1024,
                                        "stage3_prefetch_bucket_size": int(0.9 * 1024 * 1024),
                                        "stage3_param_persistence_threshold": 10 * 1024}
    assert out["gradient_clipping"] == 1.0
    assert raw["gradient_clipping"] == "auto"  # the input is not modified


def test_unresolvable_auto_is_an_error_naming_it():
    errors = errors_of({"train_batch_size": 4, "gradient_clipping": "auto"}, strict_auto=True)
    assert any(e.startswith('gradient_clipping: "auto" is not resolved') and "fill_auto" in e for e in errors)
    # the same config is valid for `config check`, like a Hugging Face template
    DsplugConfig({"train_batch_size": 4, "gradient_clipping": "auto"}, world_size=1)


def test_auto_only_where_accepted():
    errors = errors_of({"train_batch_size": 4, "steps_per_print": "auto"})
    assert any(e == 'steps_per_print: "auto" is not accepted here; give a concrete value' for e in errors)


# ---------------------------------------------------------------------------- legacy forms
def test_legacy_zero_true_becomes_stage_one_with_modern_form_in_warning():
    report = Report()
    zero = parse(ZeroConfig, True, "zero_optimization", report)
    assert zero.stage == 1
    assert str(report.warnings[0]) == ('zero_optimization: "zero_optimization": true is deprecated; write '
                                       '"zero_optimization": {"stage": 1}')


def test_legacy_cpu_offload_becomes_offload_optimizer():
    report = Report()
    zero = parse(ZeroConfig, {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True},
                 "zero_optimization", report)
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert 'write "offload_optimizer": {"device": "cpu", "pin_memory": true}' in str(report.warnings[0])


def test_legacy_warning_is_emitted_through_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DsplugConfig({"train_batch_size": 2, "bfloat16": {"enabled": True}}, world_size=1)
    assert config.section("bf16").enabled is True
    assert any(issubclass(w.category, DsplugDeprecationWarning) and 'write "bf16": {...} instead' in str(w.message)
               for w in caught)


def test_zeropp_keys_need_stage_3():
    errors = errors_of({"train_batch_size": 2, "zero_optimization": {"zero_quantized_weights": True}})
    assert any(e == "zero_optimization.zero_quantized_weights: ZeRO++ (zero_quantized_weights) needs ZeRO stage 3, "
                    "as in DeepSpeed (zero_optimization.stage is 0, zero_quantized_weights is true); set stage 3 or "
                    "leave it at false" for e in errors), errors


def test_offload_param_needs_stage_3_and_known_device():
    errors = errors_of({"train_batch_size": 2, "zero_optimization": {
        "stage": 0, "offload_param": {"device": "cpux"}}})
    joined = "\n".join(errors)
    assert "zero_optimization.offload_param.device" in joined and "no offload_device plugin named 'cpux'" in joined
    assert "offloading parameters needs stage 3" in joined


def test_accepted_but_inert_keys_warn_instead_of_being_silently_ignored():
    from dsplug.config import DsplugConfigWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DsplugConfig({"train_batch_size": 2, "sparse_gradients": True,
                      "zero_optimization": {"elastic_checkpoint": False}}, world_size=1)
    notes = [str(w.message) for w in caught if issubclass(w.category, DsplugConfigWarning)]
    assert notes == ["sparse_gradients: true has no effect in dsplug (embedding gradients are reduced densely); "
                     "the setting is ignored"]  # elastic_checkpoint at its default says nothing


# ---------------------------------------------------------------------------- no NaN-producing config
NAN, INF = float("nan"), float("inf")


def adam(**params):
    return {"optimizer": {"type": "Adam", "params": params}}


def warmup(**params):
    return {"scheduler": {"type": "WarmupLR", "params": params}}


@pytest.mark.parametrize("extra,expected", [
    (adam(lr=INF), "optimizer.params.lr: Infinity is not valid: must be a finite number, not NaN or ±Infinity"),
    (adam(lr=1e308), "optimizer.params.lr: 1e+308 is not valid: must be <= 1000000.0"),
    (adam(lr=10 ** 400), "optimizer.params.lr: 1000000000"),  # ... out of range: too large for a floating-point number
    (adam(betas=[0.9, NAN]), "optimizer.params.betas[1]: NaN is not valid: must be a finite number"),
    ({"optimizer": {"type": "RMSprop", "params": {"lr": 1e308}}},  # a schema derived from torch: the kernel rule
     "optimizer.params.lr: 1e+308 is not valid: must be <= 1000000.0 (a learning rate)"),
    (warmup(warmup_max_lr=NAN), "scheduler.params.warmup_max_lr: NaN is not valid: must be a finite number"),
    (warmup(warmup_min_lr=INF), "scheduler.params.warmup_min_lr: Infinity is not valid: must be a finite number"),
    (warmup(warmup_max_lr=[1e-3, -INF]), "scheduler.params.warmup_max_lr[1]: -Infinity is not valid"),
    (warmup(warmup_max_lr=[1e-3, 1e9]),
     "scheduler.params.warmup_max_lr: [0.001, 1000000000.0] is not valid: must be <= 1000000.0 (got 1000000000.0 at index 1)"),
    ({"fp16": {"enabled": True, "min_loss_scale": INF}}, "fp16.min_loss_scale: Infinity is not valid: must be a finite number"),
    ({"fp16": {"enabled": True, "min_loss_scale": 1e300}}, "fp16.min_loss_scale: 1e+300 is not valid: must be <= 2**127"),
    ({"fp16": {"enabled": True, "loss_scale": 1e-300}},
     "fp16.loss_scale: 1e-300 is not valid: must be 0 (dynamic loss scaling) or a static scale between 2**-126 and 2**127"),
    ({"fp16": {"enabled": True, "hysteresis": 1e308}},
     "fp16.hysteresis: 1e+308 is not valid: out of range: must be a 64-bit integer (-2**63 .. 2**63 - 1)"),
    ({"fp16": {"enabled": True, "initial_scale_power": 128}}, "fp16.initial_scale_power: 128 is not valid: must be <= 127"),
    ({"amp": {"enabled": True, "max_loss_scale": INF}}, "amp.max_loss_scale: Infinity is not valid"),
    ({"gradient_clipping": NAN}, "gradient_clipping: NaN is not valid: must be a finite number"),
    ({"steps_per_print": 1e308}, "steps_per_print: 1e+308 is not valid: out of range: must be a 64-bit integer"),
    ({"steps_per_print": -INF}, "steps_per_print: -Infinity is not valid: must be a finite number"),
    ({"steps_per_print": NAN}, "steps_per_print: NaN is not valid: must be a finite number"),
    ({"gradient_predivide_factor": 1e308}, "gradient_predivide_factor: 1e+308 is not valid: must be <= 1000000.0"),
    ({"train_micro_batch_size_per_gpu": 2 ** 62}, "train_micro_batch_size_per_gpu: 4611686018427387904 is not valid: "
                                                  "must be <= 2**24"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 1e308}}},
     "scheduler.params.cos_min_ratio: 1e+308 is not valid: must be <= 1.0"),
    ({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_rate": 1e308}}},
     "scheduler.params.lr_range_test_step_rate: 1e+308 is not valid: must be <= 1000000.0"),
])
@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "json-text"])
def test_nan_producing_numbers_are_errors_naming_key_and_value(extra, expected, as_text):
    config = {"train_batch_size": 2, **extra}
    errors = errors_of(json.dumps(config) if as_text else config)  # json writes NaN / Infinity
    assert any(e.startswith(expected) for e in errors), errors


def test_non_finite_numbers_are_refused_in_free_form_values_and_extra_keys_too():
    @schema(extra_keys=True)
    class Free:
        anything: Any = field(None)
        table: Dict[str, Any] = field(factory=dict)

    report = Report()
    parse(Free, {"anything": {"a": [1, NAN]}, "table": {"x": 2 ** 70}, "other": {"b": -INF}}, "free", report)
    assert sorted(map(str, report.errors)) == [
        "free.anything.a[1]: NaN is not valid: must be a finite number, not NaN or ±Infinity (a JSON number beyond "
        "±1.8e308 reads as Infinity)",
        "free.other.b: -Infinity is not valid: must be a finite number, not NaN or ±Infinity (a JSON number beyond "
        "±1.8e308 reads as Infinity)",
        "free.table.x: 1180591620717411303424 is not valid: out of range: must be a 64-bit integer (-2**63 .. 2**63 - 1)",
    ]


def test_fields_opt_out_of_finiteness_or_give_infinity_a_meaning():
    @schema
    class Opts:
        limit: float = field(1.0, finite=False, doc="inf = no limit")
        every: int = field(1, ge=1, infinity=-7, doc="Infinity = never")
        count: int = field(1)

    got = parse(Opts, {"limit": INF, "every": INF, "count": 8.0})
    assert (got.limit, got.every, got.count) == (INF, -7, 8)  # an integral float is still an integer
    report = Report()
    parse(Opts, {"every": -INF, "count": 2 ** 63}, "", report)
    assert [str(e) for e in report.errors] == [
        "every: -Infinity is not valid: must be a finite number, not NaN or ±Infinity (a JSON number beyond ±1.8e308 "
        "reads as Infinity)",
        "count: 9223372036854775808 is not valid: out of range: must be a 64-bit integer (-2**63 .. 2**63 - 1)"]


def test_steps_per_print_infinity_as_accelerate_writes_it_means_never(capsys):
    import torch

    import dsplug
    from dsplug.config.kernel_schema import NEVER

    for source in ({"train_batch_size": 2, "steps_per_print": INF}, '{"train_batch_size": 2, "steps_per_print": Infinity}'):
        config = DsplugConfig(source, world_size=1)
        assert config.steps_per_print == NEVER == 2 ** 63 - 1 and isinstance(config.steps_per_print, int)
        assert all(step % config.steps_per_print for step in (1, 10, 10 ** 12))
        assert DsplugConfig(config.to_dict(), world_size=1).steps_per_print == NEVER  # round trip
    engine, _, _, _ = dsplug.initialize(model=torch.nn.Linear(4, 2),
                                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                        config='{"train_batch_size": 2, "steps_per_print": Infinity}')
    capsys.readouterr()
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    assert engine.steps_per_print() == NEVER
    assert "[dsplug] step=" not in capsys.readouterr().out


def test_duplicate_keys_name_the_key_and_both_lines(tmp_path):
    text = ('{\n  "train_batch_size": 2,\n  "fp16": {\n    "enabled": true,\n    "loss_scale": 0,\n'
            '    "enabled": false\n  },\n  "train_batch_size": 4\n}\n')
    errors = errors_of(text)
    assert errors == [
        "fp16.enabled: key given twice in JSON text (line 4 and line 6); JSON would silently keep only the last value: "
        "keep one",
        "train_batch_size: key given twice in JSON text (line 2 and line 8); JSON would silently keep only the last "
        "value: keep one"]
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 2,\n "optimizer": {"type": "Adam", "params": {"lr": 1e-3,\n "lr": 1e-2}}}')
    assert errors_of(str(path)) == [f"optimizer.params.lr: key given twice in {path} (line 2 and line 3); JSON would "
                                    "silently keep only the last value: keep one"]
    # the same key in different objects, and "a key" inside a string, are not duplicates
    DsplugConfig('{"train_batch_size": 2, "fp16": {"enabled": false}, "bf16": {"enabled": false},'
                 ' "csv_monitor": {"job_name": "\\"enabled\\": x, {\\"a\\": 1, \\"a\\": 2}"}}', world_size=1)
    hjson_path = tmp_path / "ds.hjson"
    hjson_path.write_text("{\n  train_batch_size: 2\n  fp16: {\n    enabled: true\n    enabled: false\n  }\n}\n")
    assert errors_of(str(hjson_path)) == [f"enabled: key given twice in {hjson_path} (line 4 and line 5); JSON would "
                                          "silently keep only the last value: keep one"]


def test_a_file_that_is_not_utf8_is_a_one_line_error_naming_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{\n  "train_batch_size": 2,\n  "csv_monitor": {"job_name": "caf\xe9"}\n}')
    with pytest.raises(ConfigError) as err:
        DsplugConfig(str(path), world_size=1)
    assert str(err.value) == (f"invalid dsplug config: {path} is not UTF-8 text: byte 0xe9 at line 3 column 35 cannot "
                              "be decoded (invalid continuation byte); save the file as UTF-8")
    path.write_bytes('{"train_batch_size": 2}'.encode("utf-16"))
    assert "starts with a UTF-16 byte-order mark" in errors_of(str(path))[0]
    path.write_bytes(b'\xef\xbb\xbf{"train_batch_size": 2}')  # a UTF-8 byte-order mark is fine
    assert DsplugConfig(str(path), world_size=1).train_batch_size == 2
    assert DsplugConfig(b'{"train_batch_size": 2}', world_size=1).train_batch_size == 2
    assert errors_of(b'{"train_batch_size": "\xff"}')[0].startswith("config bytes is not UTF-8 text: byte 0xff")


def deep(levels: int, kind: str = "dict"):
    value = 1
    for _ in range(levels):
        value = {"a": value} if kind == "dict" else [value]
    return value


def test_deep_nesting_is_a_one_line_error_never_a_recursion_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"x": 1}}})
                    .replace('{"x": 1}', '{"x": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}"))
    cyclic = {"train_batch_size": 2}
    cyclic["self"] = cyclic
    for source, where in [(str(path), str(path)), ("[" * 5000 + "]" * 5000, "JSON text"),
                          ('{"a": ' * 5000 + "1" + "}" * 5000, "JSON text"),
                          ({"train_batch_size": 2, "x": deep(5000, "list")}, "dict"), (cyclic, "dict")]:
        with pytest.raises(ConfigError) as err:
            DsplugConfig(source, world_size=1)
        message = str(err.value)
        assert f"{where} is nested more than 100 levels deep" in message and "\n" not in message, message
    assert "(under optimizer.params.x.a.a.a" in errors_of(str(path))[0]
    hjson_path = tmp_path / "deep.hjson"
    hjson_path.write_text("{\n  a: " + "[" * 3000 + "]" * 3000 + "\n}")
    assert "deep.hjson is nested more than 100 levels deep" in errors_of(str(hjson_path))[0]
    # up to the limit it is parsed like anything else (here: an unknown key)
    errors = errors_of({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"x": deep(95)}}})
    assert errors[0].startswith("optimizer.params.x: unknown key")


def test_the_loader_turns_every_bad_input_into_a_config_error(tmp_path):
    assert errors_of({"train_batch_size": 2, 3: "x"}) == ["dict: key 3 (int) is not a string; JSON object keys are strings"]
    assert errors_of({"train_batch_size": 2, "fp16": {("a",): 1}}) == [
        "fp16: dict: key ('a',) (tuple) is not a string; JSON object keys are strings"]
    assert errors_of("[1, 2]") == ["JSON text: the config must be a JSON object, got list"]
    assert errors_of("  ") == ["the config is empty: give a path, a dict or JSON text ('{...}')"]
    assert errors_of('{"train_batch_size": ' + "1" * 5000 + "}")[0].startswith("JSON text is not valid JSON: Exceeds the limit")
    assert errors_of('{"train_batch_size": ' + "1" * 400 + "}")[0].startswith("train_batch_size: 1111")
    assert errors_of(str(tmp_path)) == [f"cannot read config file {tmp_path}: Is a directory"]
    with pytest.raises(TypeError, match="config must be a path, a dict or JSON text, got int"):
        DsplugConfig(5)


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_nvme_offload_without_nvme_path_is_an_error_naming_the_key(key):
    errors = errors_of({"train_batch_size": 2, "zero_optimization": {"stage": 3, key: {"device": "nvme"}}})
    assert errors == [f"zero_optimization.{key}.nvme_path: device 'nvme' needs nvme_path: the directory for the swap "
                      "files"]
    DsplugConfig({"train_batch_size": 2, "zero_optimization": {"stage": 3, key: {"device": "nvme",
                                                                                 "nvme_path": "/local_nvme"}}},
                 world_size=1)


@schema_decorator
class _Inner:
    steps: int = schema_field(1, ge=1)


@schema_decorator
class _Outer:
    inner: typing.Optional[_Inner] = schema_field(None)


def test_an_optional_nested_schema_reports_the_key_inside_it():
    from dsplug.config.schema import ConfigError, parse

    assert parse(_Outer, {"inner": None}).inner is None
    assert parse(_Outer, {"inner": {"steps": 3}}).inner.steps == 3
    with pytest.raises(ConfigError) as info:
        parse(_Outer, {"inner": {"stepz": 3}}, "section")
    assert "section.inner.stepz: unknown key; did you mean 'section.inner.steps'?" in str(info.value)


# ---------------------------------------------------------------------------- DeepSpeed's leniencies
def test_a_json_file_with_comments_reads_as_hjson_as_deepspeed_reads_it(tmp_path):
    path = tmp_path / "ds_config.json"  # DeepSpeed's documented configs carry comments in .json files
    path.write_text('{\n  // the batch\n  "train_batch_size": 8,\n  "fp16": {"enabled": true}  # loss scaling\n}\n')
    config = DsplugConfig(str(path), world_size=2)
    assert (config.train_batch_size, config["fp16"]["enabled"]) == (8, True)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": [8,\n}')
    assert errors_of(str(bad))[0].startswith(f"{bad} is not valid JSON: ")


def test_dependencies_include_numpy_and_hjson():
    import pathlib
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
    names = {d.split(">")[0].split("=")[0].split(";")[0].strip() for d in pyproject["project"]["dependencies"]}
    assert {"numpy", "hjson"} <= names


@pytest.mark.parametrize("text, flag", [("true", True), ("false", False), ("False", False), ("TRUE", True),
                                        ("tRuE", True)])
def test_true_false_strings_read_as_booleans_with_a_warning_showing_json(text, flag):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DsplugConfig({"train_batch_size": 8, "fp16": {"enabled": text},
                               "aio": {"single_submit": text}}, world_size=1)
    assert config["fp16"]["enabled"] is flag and config["aio"]["single_submit"] is flag
    assert config.section("fp16").enabled is flag
    json_form = "true" if flag else "false"
    messages = [str(w.message) for w in caught if issubclass(w.category, DsplugDeprecationWarning)]
    assert f"fp16.enabled: {text!r} is a string; read as the JSON boolean {json_form} (write {json_form} " \
           "without quotes)" in messages
    assert any(m.startswith(f"aio.single_submit: {text!r} is a string") for m in messages)


def test_true_false_strings_in_optional_and_legacy_boolean_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DsplugConfig({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1,
                               "foreach": "false"}}, "zero_allow_untested_optimizer": "true",
                               "zero_optimization": {"stage": 2, "cpu_offload": "True"}},
                              world_size=1)
    assert config.optimizer.params.foreach is False
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize("text", ["yes", "1", "", " true", "truee", "on"])
def test_other_strings_for_a_boolean_stay_errors(text):
    assert errors_of({"train_batch_size": 8, "fp16": {"enabled": text}}) == [
        f"fp16.enabled: {text!r} is not valid: expected a boolean"]
    assert errors_of({"train_batch_size": 8, "zero_optimization": {"cpu_offload": text}}) == [
        f"zero_optimization.cpu_offload: {text!r} is not valid: expected a boolean (legacy key; use offload_optimizer)"]


def test_a_string_member_of_a_union_keeps_true_as_a_string():
    @schema_decorator
    class Either:
        value: typing.Union[bool, str] = schema_field(False)

    assert parse(Either, {"value": "true"}).value == "true"
    assert parse(Either, {"value": True}).value is True


@pytest.mark.parametrize("number,flag", [(1, True), (0, False)])
def test_one_and_zero_for_a_boolean_read_as_true_and_false_with_a_warning(number, flag):
    """DeepSpeed's config models take 1 / 0 for a boolean (its own tests write
    ``"zero_allow_untested_optimizer": 1``): dsplug reads them too, and says how to write it."""
    text = "true" if flag else "false"
    raw = {"train_batch_size": 8, "zero_allow_untested_optimizer": number, "fp16": {"enabled": number},
           "zero_optimization": {"stage": 2, "cpu_offload": number}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DsplugConfig(raw, world_size=1)
    assert config.kernel.zero_allow_untested_optimizer is flag and config["fp16"]["enabled"] is flag
    assert config["zero_optimization"]["offload_optimizer"]["device"] == ("cpu" if flag else "none")
    messages = [str(w.message) for w in caught if issubclass(w.category, DsplugDeprecationWarning)]
    assert f"zero_allow_untested_optimizer: {number} is a number; read as the JSON boolean {text} (write {text})" \
        in messages


@pytest.mark.parametrize("value", [2, -1, 1.0, 0.5])
def test_other_numbers_for_a_boolean_stay_errors(value):
    assert errors_of({"train_batch_size": 8, "fp16": {"enabled": value}}) == [
        f"fp16.enabled: {value!r} is not valid: expected a boolean"]


def test_a_number_member_of_a_union_keeps_one_as_a_number():
    @schema_decorator
    class Either:
        value: typing.Union[bool, int] = schema_field(False)

    assert parse(Either, {"value": 1}).value == 1 and parse(Either, {"value": 1}).value is not True
    assert parse(Either, {"value": True}).value is True
