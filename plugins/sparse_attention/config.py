"""The ``sparse_attention`` config section and the sparsity config it describes.

Keys and defaults are DeepSpeed's::

    "sparse_attention": {
        "mode": "fixed",                    # dense | fixed | variable | bigbird | bslongformer
        "block": 16,
        "different_layout_per_head": false,
        "num_local_blocks": 4,              # fixed
        "num_global_blocks": 1,             # fixed, bigbird
        "attention": "bidirectional",       # fixed, variable, bigbird, bslongformer
        "horizontal_global_attention": false,   # fixed, variable
        "num_different_global_patterns": 1, # fixed
        "num_random_blocks": 0,             # variable, bigbird
        "local_window_blocks": [4],         # variable
        "global_block_indices": [0],        # variable, bslongformer
        "global_block_end_indices": null,   # variable, bslongformer
        "num_sliding_window_blocks": 3      # bigbird, bslongformer
    }

The chosen mode's keys are filled with their defaults when parsed (``dsplug config explain``
shows the values in effect); a key the chosen mode does not use is accepted (DeepSpeed's documented example lists every key
with ``mode: fixed``) and reported as a config warning naming the modes that use it; an unknown
key is an error. Settings that cannot work (``num_local_blocks`` not a multiple of
``num_global_blocks``, ``num_different_global_patterns > 1`` with one layout for all heads,
``horizontal_global_attention`` with unidirectional attention, mismatched global ranges) are
errors naming the key, found when the config is parsed.

DeepSpeed leaves building the layout to the model (its BERT example reads the section and picks
the class by ``mode``); :func:`sparsity_config_from_section` does that, and the engine method
``engine.sparse_attention_config(num_heads)`` returns it for the engine's config (``None``
without the section).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from dsplug.config.schema import field, schema

MODES = ("dense", "fixed", "variable", "bigbird", "bslongformer")

#: mode -> the keys it uses beyond mode / block / different_layout_per_head, with the defaults
#: of DeepSpeed's config section (``num_random_blocks`` defaults to 0 in the section, also for
#: bigbird, whose class defaults to 1).
MODE_KEYS: Dict[str, Dict[str, Any]] = {
    "dense": {},
    "fixed": {"num_local_blocks": 4, "num_global_blocks": 1, "attention": "bidirectional",
              "horizontal_global_attention": False, "num_different_global_patterns": 1},
    "variable": {"num_random_blocks": 0, "local_window_blocks": [4], "global_block_indices": [0],
                 "global_block_end_indices": None, "attention": "bidirectional",
                 "horizontal_global_attention": False},
    "bigbird": {"num_random_blocks": 0, "num_sliding_window_blocks": 3, "num_global_blocks": 1,
                "attention": "bidirectional"},
    "bslongformer": {"num_sliding_window_blocks": 3, "global_block_indices": [0], "global_block_end_indices": None,
                     "attention": "bidirectional"},
}

_USED_BY: Dict[str, List[str]] = {}
for _mode, _keys in MODE_KEYS.items():
    for _key in _keys:
        _USED_BY.setdefault(_key, []).append(_mode)


def _modes(key: str) -> str:
    return ", ".join(_USED_BY[key])


def _sparsity_rule(values: Dict[str, Any]):
    """Build the config once (one head) so that settings that cannot work are errors at parse time."""
    from .sparsity_config import SparsityConfigError

    try:
        sparsity_config_from_section(values, num_heads=1)
    except SparsityConfigError as exc:
        key = exc.key.split("[")[0]
        return key if key in values else "mode", str(exc)
    return None


@schema
class SparseAttentionConfig:
    mode: str = field("fixed", choices=MODES, doc="sparsity structure: dense, fixed, variable, bigbird or bslongformer")
    block: int = field(16, ge=1, doc="tokens per side of a block; sequences must be a multiple of it")
    different_layout_per_head: bool = field(False, doc="each head gets its own layout (random blocks, global "
                                                       "patterns); else head 0's is shared")
    num_local_blocks: Optional[int] = field(None, ge=1, doc=f"blocks per local window ({_modes('num_local_blocks')}; "
                                                            f"default 4)")
    num_global_blocks: Optional[int] = field(None, ge=1, doc=f"global blocks per window (fixed) / at the start "
                                                             f"(bigbird) ({_modes('num_global_blocks')}; default 1)")
    attention: Optional[str] = field(None, choices=("bidirectional", "unidirectional"),
                                     doc=f"unidirectional: causal (autoregressive) ({_modes('attention')}; default "
                                         f"bidirectional)")
    horizontal_global_attention: Optional[bool] = field(
        None, doc=f"global blocks also attend to every block, bidirectional only "
                  f"({_modes('horizontal_global_attention')}; default false)")
    num_different_global_patterns: Optional[int] = field(
        None, ge=1, doc=f"heads cycle through this many global positions per window, needs "
                        f"different_layout_per_head ({_modes('num_different_global_patterns')}; default 1)")
    num_random_blocks: Optional[int] = field(None, ge=0, doc=f"random blocks per block-row "
                                                             f"({_modes('num_random_blocks')}; default 0)")
    local_window_blocks: Optional[List[int]] = field(None, ge=1, doc=f"sizes of the local windows, the last repeating "
                                                                     f"({_modes('local_window_blocks')}; default [4])")
    global_block_indices: Optional[List[int]] = field(
        None, ge=0, doc=f"global blocks (or range starts) ({_modes('global_block_indices')}; default [0])")
    global_block_end_indices: Optional[List[int]] = field(
        None, ge=1, doc=f"exclusive ends of the global ranges, one per start ({_modes('global_block_end_indices')}; "
                        f"default null: single blocks)")
    num_sliding_window_blocks: Optional[int] = field(None, ge=1, doc=f"blocks in the sliding window "
                                                                     f"({_modes('num_sliding_window_blocks')}; "
                                                                     f"default 3)")

    __rules__ = (_sparsity_rule,)

    @staticmethod
    def __legacy__(data, path, report):
        """Fill in the chosen mode's defaults (so the parsed section and ``config explain`` show the
        values in effect); keys of other modes stay None unless given."""
        if not isinstance(data, dict):
            return data
        mode = data.get("mode", "fixed")
        defaults = MODE_KEYS.get(mode) if isinstance(mode, str) else None
        if defaults is None:
            return data  # an invalid mode: parsing reports it
        filled = dict(data)
        for key, value in defaults.items():
            if filled.get(key) is None:
                filled[key] = list(value) if isinstance(value, list) else value
        return filled


def resolved_keys(section) -> Dict[str, Any]:
    """The section as the keyword arguments of its mode's class (DeepSpeed's defaults filled in)."""
    values = section if isinstance(section, Mapping) else _as_dict(section)
    mode = values.get("mode") or "fixed"
    if mode not in MODE_KEYS:
        raise ValueError(f"sparse_attention.mode={mode!r} is not valid: choose one of {', '.join(MODES)}")

    def given(key, default):
        value = values.get(key)
        return default if value is None else value

    out = {"block": given("block", 16), "different_layout_per_head": given("different_layout_per_head", False)}
    out.update({key: given(key, default) for key, default in MODE_KEYS[mode].items()})
    return out


def _as_dict(section) -> Dict[str, Any]:
    from dsplug.config.schema import to_dict

    return to_dict(section)


def unused_keys(section) -> List[str]:
    """Keys the section sets that its mode does not use."""
    values = section if isinstance(section, Mapping) else _as_dict(section)
    mode = values.get("mode") or "fixed"
    return [k for k in _USED_BY if values.get(k) is not None and k not in MODE_KEYS.get(mode, {})]


def sparsity_config_from_section(section, num_heads: int, *, seed: Optional[int] = None):
    """The :class:`~.sparsity_config.SparsityConfig` a ``sparse_attention`` section describes, for a
    layer of ``num_heads`` heads (``section``: the parsed section or its JSON dict). ``seed`` fixes
    the random blocks of variable / bigbird."""
    from . import sparsity_config as sc

    values = section if isinstance(section, Mapping) else _as_dict(section)
    mode = values.get("mode") or "fixed"
    kwargs = resolved_keys(values)
    if mode == "dense":
        return sc.DenseSparsityConfig(num_heads, **kwargs)
    if mode == "fixed":
        return sc.FixedSparsityConfig(num_heads, **kwargs)
    if mode == "variable":
        return sc.VariableSparsityConfig(num_heads, **kwargs, seed=seed)
    if mode == "bigbird":
        return sc.BigBirdSparsityConfig(num_heads, **kwargs, seed=seed)
    return sc.BSLongformerSparsityConfig(num_heads, **kwargs)


def warn_unused_keys(config, report) -> None:
    """Config rule: a key the chosen mode does not use is reported (not silently ignored)."""
    section = config.sections.get("sparse_attention") if hasattr(config, "sections") else None
    if section is None:
        return
    for key in unused_keys(section):
        report.notice(f"sparse_attention.{key}", f"has no effect with mode {section.mode!r}; it is used by "
                                                 f"mode {_modes(key)}")
