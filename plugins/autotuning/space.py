"""What the autotuner tries: the user's config and arguments -> candidate experiment configs.

The user's ``ds_config`` (found among the script's arguments) says what is tuned:

* ``zero_optimization.stage``: absent or ``"all"`` -> stages 0-3; an integer -> that stage only;
  a list -> those stages (DeepSpeed's convention).
* ``train_micro_batch_size_per_gpu``: absent or ``"auto"`` -> ``num_tuning_micro_batch_sizes``
  sizes spaced geometrically from ``min_train_micro_batch_size_per_gpu`` to the largest size that
  fits in memory (at most ``max_train_micro_batch_size_per_gpu``), both ends included; an integer
  -> that size only; a list -> those sizes.
* ``train_batch_size`` / ``gradient_accumulation_steps``: an integer ``train_batch_size`` is
  kept (the accumulation steps follow from each micro-batch size; a size that does not divide it
  is skipped); otherwise the accumulation steps are kept (default 1) and the batch follows.
* with ``autotuning.fast: false``, the stage's knobs (:data:`DEFAULT_KNOB_SPACES`): a
  ``zero_optimization`` key the user gives as a list is tuned over that list (for every stage);
  a key given as a single value is fixed; other keys of the stage's default space are tuned
  over the defaults. In fast mode a list is an error.

Every candidate becomes a full config: the user's, with the stage, knobs and batch triple set
and an ``autotuning`` section that turns on the measuring observer.
"""
from __future__ import annotations

import copy
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

ALL_STAGES = (0, 1, 2, 3)

#: the knobs tuned per ZeRO stage when ``fast`` is false; the first value of each is used while
#: the stage and micro-batch size are tuned (it is the zero_optimization default)
DEFAULT_KNOB_SPACES: Dict[int, Dict[str, List[Any]]] = {
    0: {},
    1: {"reduce_bucket_size": [500_000_000, 50_000_000], "allgather_bucket_size": [500_000_000, 50_000_000]},
    2: {"overlap_comm": [False, True], "reduce_bucket_size": [500_000_000, 50_000_000],
        "allgather_bucket_size": [500_000_000, 50_000_000]},
    3: {"overlap_comm": [False, True], "reduce_bucket_size": [500_000_000, 50_000_000],
        "stage3_prefetch_bucket_size": [50_000_000, 5_000_000]},
}

#: flags that carry the DeepSpeed config path to a script
CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")


class AutotuningError(ValueError):
    """The autotuning request cannot be carried out; the message says what to change."""


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class Candidate:
    """One point of the tuning space."""

    stage: int
    micro_batch: int
    gas: int
    train_batch: int
    knobs: Tuple[Tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        base = f"z{self.stage}_mbs{self.micro_batch}_gas{self.gas}"
        return base + "".join(f"_{_short(k)}{_value_tag(v)}" for k, v in self.knobs)

    def describe(self) -> Dict[str, Any]:
        return {"stage": self.stage, "train_micro_batch_size_per_gpu": self.micro_batch,
                "gradient_accumulation_steps": self.gas, "train_batch_size": self.train_batch,
                "knobs": dict(self.knobs)}


def _short(key: str) -> str:
    """``reduce_bucket_size`` -> ``rbs``, ``stage3_prefetch_bucket_size`` -> ``s3pbs``."""
    parts = key.split("_")
    return "".join(("s3" if p == "stage3" else p[:1]) for p in parts if p)


def _value_tag(value) -> str:
    if isinstance(value, bool):
        return "T" if value else "F"
    if isinstance(value, int) and value >= 10_000:
        mantissa, exp = f"{value:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exp)}"
    return str(value).replace(".", "p")


@dataclass
class Space:
    """Everything the user's config says about what to tune."""

    stages: List[int]
    micro_batches: Optional[List[int]]  # None: a range derived from memory
    fixed_train_batch: Optional[int]
    fixed_gas: Optional[int]
    knob_lists: Dict[str, List[Any]] = field(default_factory=dict)  # user lists (non-fast)
    knob_fixed: Dict[str, Any] = field(default_factory=dict)  # user scalars in zero_optimization


def read_space(user_config: Dict[str, Any], fast: bool) -> Space:
    """The tuning space the user's config describes; :class:`AutotuningError` names a bad key."""
    zero = user_config.get("zero_optimization", {})
    if zero is None:
        zero = {}
    if not isinstance(zero, dict):
        raise AutotuningError(f"zero_optimization must be an object, got {zero!r}")
    stages = _stages(zero.get("stage", "all"))
    micro = _micro_batches(user_config.get("train_micro_batch_size_per_gpu"))
    tbs = _int_or_auto(user_config.get("train_batch_size"), "train_batch_size")
    gas = _int_or_auto(user_config.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    lists, fixed = {}, {}
    for key, value in zero.items():
        if key == "stage":
            continue
        if isinstance(value, list):
            if fast:
                raise AutotuningError(
                    f"zero_optimization.{key} is a list {value!r}: a list is a tuning space, tuned only with "
                    f"autotuning.fast false; give one value, or set \"fast\": false")
            if not value:
                raise AutotuningError(f"zero_optimization.{key} is an empty list: give the values to try")
            lists[key] = list(value)
        else:
            fixed[key] = value
    return Space(stages, micro, tbs, gas, lists, fixed)


def _stages(value) -> List[int]:
    if value == "all" or value is None:
        return list(ALL_STAGES)
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v not in ALL_STAGES:
            raise AutotuningError(f"zero_optimization.stage: {value!r} is not a ZeRO stage to tune; give 0-3, a list "
                                  f"of them, or \"all\"")
        if v not in out:
            out.append(v)
    return sorted(out)


def _micro_batches(value) -> Optional[List[int]]:
    if value is None or value == "auto":
        return None
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise AutotuningError(f"train_micro_batch_size_per_gpu: {value!r} is not a micro-batch size to tune; give "
                                  f"a positive integer, a list of them, or \"auto\" (tune the range)")
        if v not in out:
            out.append(v)
    return sorted(out)


def _int_or_auto(value, key: str) -> Optional[int]:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutotuningError(f"{key}: {value!r} must be a positive integer or \"auto\" when autotuning")
    return value


def geometric_sizes(lo: int, hi: int, count: int) -> List[int]:
    """``count`` integers from ``lo`` to ``hi`` (both included) spaced evenly on a log scale, deduplicated."""
    if hi < lo:
        return []
    if count <= 1 or hi == lo:
        return [hi] if count <= 1 else [lo]
    out = []
    for i in range(count):
        v = int(round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (count - 1))))
        v = min(hi, max(lo, v))
        if v not in out:
            out.append(v)
    return out


def fixed_batch_sizes(space: Space, dp_world: int) -> Optional[List[int]]:
    """With a fixed ``train_batch_size``: every micro-batch size it allows on ``dp_world`` ranks
    (the divisors of ``train_batch_size / dp_world``; with a fixed ``gradient_accumulation_steps``
    the one size ``train_batch_size / (dp_world x gas)``), ascending; None when the batch is not fixed."""
    if space.fixed_train_batch is None:
        return None
    if space.fixed_train_batch % dp_world:
        return []
    per_rank = space.fixed_train_batch // dp_world
    if space.fixed_gas is not None:
        return [per_rank // space.fixed_gas] if per_rank % space.fixed_gas == 0 else []
    small = [d for d in range(1, math.isqrt(per_rank) + 1) if per_rank % d == 0]
    return sorted(set(small) | {per_rank // d for d in small})


def snap_sizes(sizes: Sequence[int], valid: Sequence[int]) -> List[int]:
    """Each size replaced by the nearest of ``valid`` on a log scale (the sizes are spaced
    geometrically; a tie goes to the smaller), deduplicated, ascending."""
    out = set()
    for size in sizes:
        out.add(min(valid, key=lambda v: (abs(math.log(v) - math.log(size)), v)))
    return sorted(out)


def batch_for(space: Space, micro: int, dp_world: int) -> Tuple[Optional[Tuple[int, int]], Optional[str]]:
    """``((gas, train_batch), None)`` for a micro-batch size, or ``(None, why not)``."""
    if space.fixed_train_batch is not None:
        per_step = micro * dp_world
        if space.fixed_train_batch % per_step:
            return None, (f"train_batch_size {space.fixed_train_batch} is not a multiple of micro-batch {micro} x "
                          f"{dp_world} data-parallel ranks")
        gas = space.fixed_train_batch // per_step
        if space.fixed_gas is not None and gas != space.fixed_gas:
            return None, (f"train_batch_size {space.fixed_train_batch} with gradient_accumulation_steps "
                          f"{space.fixed_gas} fixes the micro-batch size to "
                          f"{space.fixed_train_batch // (space.fixed_gas * dp_world)}")
        return (gas, space.fixed_train_batch), None
    gas = space.fixed_gas or 1
    return (gas, micro * gas * dp_world), None


def knob_space(space: Space, stage: int) -> Dict[str, List[Any]]:
    """The knobs tuned at ``stage`` (non-fast mode): the default space, minus keys the user fixed,
    plus the user's lists."""
    out = {k: list(v) for k, v in DEFAULT_KNOB_SPACES.get(stage, {}).items() if k not in space.knob_fixed}
    out.update({k: list(v) for k, v in space.knob_lists.items()})
    return out


def default_knobs(space: Space, stage: int, fast: bool) -> Tuple[Tuple[str, Any], ...]:
    """The knob values used while stage and micro-batch size are tuned: the first of each list."""
    if fast:
        return ()
    return tuple((k, v[0]) for k, v in sorted(knob_space(space, stage).items()))


def knob_grid(space: Space, stage: int) -> List[Tuple[Tuple[str, Any], ...]]:
    """Every combination of the stage's knob values (in key order)."""
    knobs = sorted(knob_space(space, stage).items())
    if not knobs:
        return []
    keys = [k for k, _ in knobs]
    return [tuple(zip(keys, combo)) for combo in itertools.product(*(v for _, v in knobs))]


# ------------------------------------------------------------------------------ configs
def experiment_config(user_config: Dict[str, Any], cand: Candidate, autotuning: Dict[str, Any]) -> Dict[str, Any]:
    """The full config of one experiment: the user's with the candidate's values and ``autotuning``."""
    cfg = copy.deepcopy(user_config)
    zero = dict(cfg.get("zero_optimization") or {})
    zero = {k: v for k, v in zero.items() if not isinstance(v, list)}  # tuning lists are replaced below
    zero["stage"] = cand.stage
    zero.update(dict(cand.knobs))
    cfg["zero_optimization"] = zero
    cfg["train_micro_batch_size_per_gpu"] = cand.micro_batch
    cfg["gradient_accumulation_steps"] = cand.gas
    cfg["train_batch_size"] = cand.train_batch
    cfg["autotuning"] = autotuning
    return cfg


def optimal_config(exp_config: Dict[str, Any]) -> Dict[str, Any]:
    """The config to train with: the experiment's, without the ``autotuning`` section."""
    cfg = copy.deepcopy(exp_config)
    cfg.pop("autotuning", None)
    return cfg


def get_path(config: Dict[str, Any], dotted: str):
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


# ------------------------------------------------------------------------------ script arguments
def find_config_arg(user_args: Sequence[str]) -> Tuple[int, str]:
    """``(index, path)`` of the DeepSpeed config among the script's arguments (``--deepspeed_config
    FILE``, ``--deepspeed_config=FILE``, ``--deepscale_config``, or Hugging Face's ``--deepspeed
    FILE``); ``index`` is where the path itself is."""
    args = list(user_args)
    for i, arg in enumerate(args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(args):
                return i + 1, args[i + 1]
            if arg.startswith(flag + "="):
                return i, arg[len(flag) + 1:]
        if arg == "--deepspeed" and i + 1 < len(args) and not args[i + 1].startswith("-") \
                and (args[i + 1].endswith(".json") or os.path.isfile(args[i + 1])):
            return i + 1, args[i + 1]
        if arg.startswith("--deepspeed="):
            return i, arg[len("--deepspeed="):]
    raise AutotuningError("autotuning needs the script's DeepSpeed config: pass it among the script's arguments as "
                          "--deepspeed_config FILE (or --deepspeed FILE)")


def with_config_arg(user_args: Sequence[str], index: int, path: str) -> List[str]:
    """The arguments with the config path at ``index`` (from :func:`find_config_arg`) replaced."""
    args = list(user_args)
    arg = args[index]
    if "=" in arg and arg.startswith("--"):
        args[index] = arg.split("=", 1)[0] + "=" + path
    else:
        args[index] = path
    return args


def with_mapped_args(user_args: Sequence[str], mappings: Optional[Dict[str, str]], config: Dict[str, Any]) -> List[str]:
    """``arg_mappings``: each mapped config value replaces its flag's value (or is appended)."""
    args = list(user_args)
    for key, flag in (mappings or {}).items():
        try:
            value = get_path(config, key)
        except KeyError:
            raise AutotuningError(f"autotuning.arg_mappings maps {key!r}, which the experiment config does not have; "
                                  f"map a config path such as 'train_micro_batch_size_per_gpu'") from None
        text = _arg_text(value)
        for i, arg in enumerate(args):
            if arg == flag and i + 1 < len(args):
                args[i + 1] = text
                break
            if arg.startswith(flag + "="):
                args[i] = f"{flag}={text}"
                break
        else:
            args += [flag, text]
    return args


def _arg_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
