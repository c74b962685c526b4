"""Which checkpoints a directory keeps (``checkpoint.keep_last``) and which one a resume loads.

Every manifest records the save's place in its directory's history: ``save_seq`` (1 + the highest
``save_seq`` among the complete tags when it was committed), ``created`` (wall-clock time) and
``parent`` (the tag this run last loaded or saved in the same directory: the state it trained on
from). "Most recently saved" is the highest ``(save_seq, created)``, never the highest step: after
a rollback (load ``global_step10``, train to 15, save) ``global_step15`` is the newest although
``global_step30`` has the higher step.

Retention (:func:`prune`, after a save is complete) never deletes the new tag, the tag ``latest``
names or the tag this run loaded from. Beyond those it deletes, oldest saved first, the tags off
the new tag's lineage (its chain of parents: a branch a rollback abandoned) before the lineage's
own older tags.

Resume (:func:`resume_tag`) follows ``latest`` whenever it names a complete tag whose files match
its manifest (or one DeepSpeed wrote, which has none). Otherwise it takes the most recently saved
complete, verified tag and says which and why.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from . import CheckpointError
from .manifest import kind, read_manifest, verify
from .tags import read_latest, tag_problem


def save_order(manifest: Dict[str, Any]) -> Tuple[int, float]:
    """Sort key of a tag by when it was saved (``save_seq``; ``created`` breaks ties and orders
    tags of dsplug versions that wrote no ``save_seq``)."""
    seq, created = manifest.get("save_seq", 0), manifest.get("created", 0.0)
    return (seq if isinstance(seq, int) and not isinstance(seq, bool) else 0,
            float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else 0.0)


def complete_tags(save_dir: str) -> List[Tuple[str, Dict[str, Any]]]:
    """``(tag, manifest)`` of every complete tag saved in ``save_dir`` (real directories with a
    valid name and a readable manifest; a symbolic link is an alias, not a save), oldest saved
    first."""
    found = []
    if not os.path.isdir(save_dir):
        return found
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if tag_problem(name) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest is not None:
            found.append((name, manifest))
    return sorted(found, key=lambda t: save_order(t[1]))


def next_save_seq(save_dir: str) -> int:
    """The ``save_seq`` of the next save into ``save_dir``."""
    return 1 + max((save_order(m)[0] for _, m in complete_tags(save_dir)), default=0)


def lineage(tag: str, manifests: Dict[str, Dict[str, Any]]) -> List[str]:
    """``tag`` and its chain of parents present in ``manifests``, newest first."""
    chain, seen = [], set()
    while isinstance(tag, str) and tag in manifests and tag not in seen:
        chain.append(tag)
        seen.add(tag)
        tag = manifests[tag].get("parent")
    return chain


def prune(save_dir: str, keep_last: int, new_tag: str, protect: Iterable[Optional[str]] = ()) -> List[str]:
    """(rank 0, after ``new_tag`` is complete) delete complete tags beyond ``keep_last``: never
    ``new_tag`` nor a tag in ``protect`` (``latest``'s, the one this run loaded); first the tags off
    ``new_tag``'s lineage, then its older ancestors, oldest saved first. Returns what went."""
    tags = complete_tags(save_dir)
    excess = len(tags) - keep_last
    if excess <= 0:
        return []
    manifests = dict(tags)
    line: Set[str] = set(lineage(new_tag, manifests))
    kept = {new_tag, *(t for t in protect if t)}
    order = [t for t, _ in tags if t not in line] + [t for t, _ in tags if t in line]
    doomed = [t for t in order if t not in kept][:excess]
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag))
    return doomed


def _unusable(load_dir: str, tag: str) -> Optional[str]:
    """Why tag ``tag`` of ``load_dir`` cannot be resumed from (None: it can; a DeepSpeed tag,
    without a manifest, can too: the load warns that it is unverified)."""
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path + ".old") and not os.path.isdir(path):
        path += ".old"
    if not os.path.isdir(path):
        return "it does not exist"
    state = kind(path)
    if state == "foreign":
        return None
    if state == "dsplug-without-manifest":
        return "its manifest.json is missing (an interrupted save, or deleted)"
    problems = verify(path)
    if problems:
        return f"it fails verification ({problems[0]}{f'; and {len(problems) - 1} more' if len(problems) > 1 else ''})"
    return None


def resume_tag(load_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """The tag an automatic resume loads from ``load_dir`` and, when that is not simply the one
    ``latest`` names, a warning saying which and why. ``(None, None)``: nothing to resume from."""
    latest = read_latest(load_dir)
    candidates = [(t, m) for t, m in complete_tags(load_dir) if m.get("save_latest", True)]
    order = {t: i for i, (t, _) in enumerate(candidates)}
    if latest is not None:
        problem = _unusable(load_dir, latest)
        if problem is None:
            later = [t for t, _ in candidates if latest in order and order[t] > order[latest]]
            if later:
                return latest, (f"'latest' in {load_dir} names {latest!r}, which is loaded; {later[-1]!r} was saved "
                                "after it but 'latest' never moved to it (a save that died just before updating "
                                f"'latest'?): pass tag={later[-1]!r} to load that one")
            return latest, None
    else:
        problem = None
    for tag, manifest in reversed(candidates):
        if tag == latest:
            continue
        if _unusable(load_dir, tag) is None:
            what = f"'latest' in {load_dir} names {latest!r}, but {problem}" if latest is not None else \
                f"no 'latest' file in {load_dir} (a save died before writing it?)"
            return tag, (f"{what}; loading {tag!r} (step {manifest.get('global_steps', '?')}), the most recently saved "
                         "complete checkpoint that verifies")
    return latest, None  # nothing better: the load names what is wrong with 'latest'


#: the name dsplug used before resume_tag
newest_tag = resume_tag

__all__ = ["complete_tags", "lineage", "newest_tag", "next_save_seq", "prune", "resume_tag", "save_order"]
