"""Which modules a ``different_groups`` entry applies to, by name pattern, as DeepSpeed matches them.

* ``modules``: regular expressions searched (``re.search``) in each module's dotted name; only
  ``nn.Linear`` and ``nn.Conv2d`` modules are candidates (the layers the methods can compress).
  ``"*"`` means every candidate. A pattern that matches no candidate is an error naming it.
* ``related_modules``: a list of pattern lists, one list per entry of ``modules`` (or a single
  list for all of them). For a selected module ``name``, each related pattern picks, among the
  modules matching it, the one whose dotted name shares the longest prefix with ``name`` (the
  one in the same block: ``blocks.3.mlp.0`` relates to ``blocks.3.mlp.2``, not ``blocks.1.mlp.2``).
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Sequence, Tuple

from torch import nn

from .layers import COMPRESSIBLE, CompressionConfigError  # noqa: F401 (re-exported)


def candidates(model: nn.Module, kinds=COMPRESSIBLE) -> Dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, kinds) and name}


def _compile(pattern: str, path: str) -> "re.Pattern":
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise CompressionConfigError(f"{path}: {pattern!r} is not a valid regular expression ({exc})") from None


def _some(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "none"


def match(model: nn.Module, patterns: Sequence[str], path: str, kinds=COMPRESSIBLE,
          excluded: Sequence[str] = ()) -> List[Tuple[str, nn.Module, int]]:
    """``[(name, module, index of the first pattern it matched)]``, in model order."""
    pool = candidates(model, kinds)
    kind_names = "/".join(k.__name__ for k in kinds)
    chosen: Dict[str, int] = {}
    for i, pattern in enumerate(patterns):
        if pattern == "*":
            hits = list(pool)
        else:
            regex = _compile(pattern, f"{path}[{i}]")
            hits = [name for name in pool if regex.search(name)]
        if not hits:
            raise CompressionConfigError(
                f"{path}[{i}]: {pattern!r} matches no {kind_names} module of the model "
                f"(its {kind_names} modules: {_some(list(pool))})")
        for name in hits:
            chosen.setdefault(name, i)
    excluded_res = [_compile(p, f"{path} excluded_modules") for p in excluded]
    return [(n, m, chosen[n]) for n, m in pool.items() if n in chosen and not any(r.search(n) for r in excluded_res)]


def related(model: nn.Module, name: str, patterns: Sequence[str], path: str) -> List[Tuple[str, nn.Module]]:
    """The module related to ``name`` by each pattern (the nearest match by shared name prefix)."""
    modules = dict(model.named_modules())
    out = []
    for i, pattern in enumerate(patterns):
        regex = _compile(pattern, f"{path}[{i}]")
        hits = [n for n in modules if n and n != name and regex.search(n)]
        if not hits:
            raise CompressionConfigError(f"{path}[{i}]: {pattern!r} matches no module of the model "
                                         f"(related to {name!r})")
        best = max(len(os.path.commonprefix([n, name])) for n in hits)
        nearest = [n for n in hits if len(os.path.commonprefix([n, name])) == best]
        if len(nearest) > 1:
            raise CompressionConfigError(f"{path}[{i}]: {pattern!r} relates {name!r} to several modules "
                                         f"({_some(nearest)}); make the pattern match one per block")
        out.append((nearest[0], modules[nearest[0]]))
    return out


def related_patterns(related_modules, index: int, count: int, path: str) -> List[str]:
    """The related pattern list for entry ``index`` of ``modules`` (``count`` entries)."""
    if not related_modules:
        return []
    if len(related_modules) == 1:
        return list(related_modules[0])
    if len(related_modules) != count:
        raise CompressionConfigError(f"{path}: {len(related_modules)} lists for {count} 'modules' patterns; "
                                     f"give one list per pattern, or a single list for all of them")
    return list(related_modules[index])
