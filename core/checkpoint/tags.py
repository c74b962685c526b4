"""Checkpoint tags: which names are tags, and where a tag's directory is.

One rule set (:func:`tag_problem`) for the tag of a save, the tag of a load and the tag ``latest``
names: a tag is one plain directory name inside the checkpoint directory, none of the names
dsplug writes there itself, short enough to stage as ``<tag>.partial``. Whatever a load reads
resolves (symbolic links followed) inside the checkpoint directory (:func:`resolve_tag`,
:func:`inside`).

DeepSpeed's ``checkpoint.tag_validation`` (Ignore / Warn / Fail) is another question: whether
every rank passed the same tag. The engine asks both in one exchange.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

from . import LATEST, MANIFEST, OWNER, CheckpointError

#: names dsplug writes at the root of a checkpoint directory (or inside a tag): never a tag
RESERVED_NAMES = (LATEST, MANIFEST, OWNER, "zero_to_fp32.py")
#: suffixes of the staging / swap directories a save makes next to a tag
RESERVED_SUFFIXES = (".partial", ".old")
#: the longest tag: a file name is at most 255 bytes, and a save stages the tag as ``<tag>.partial``
MAX_TAG_BYTES = 255 - len(".partial")


def tag_problem(tag: Any) -> Optional[str]:
    """Which rule ``tag`` breaks (None: a valid tag). One rule set for the tags of saves and loads
    and the tag ``latest`` names: a tag is one plain directory name inside the checkpoint
    directory, none of the names dsplug writes there itself, short enough to stage as
    ``<tag>.partial``. (DeepSpeed's ``checkpoint.tag_validation`` is another matter: whether every
    rank passed the same tag.)"""
    if not isinstance(tag, str):
        return f"it is a {type(tag).__name__}, not a string"
    if not tag:
        return "it is empty"
    if not tag.strip():
        return "it is only whitespace"
    if tag != tag.strip():
        return "it starts or ends with whitespace (the 'latest' file could not hold it exactly)"
    if any(ord(c) < 32 or ord(c) == 127 or 0x80 <= ord(c) < 0xA0 for c in tag):
        return "it holds a control character (NUL, newline, tab, ...)"
    if os.path.isabs(tag) or tag.startswith(("/", "\\")):
        return "it is an absolute path"
    if tag in (".", "..") or any(part == ".." for part in re.split(r"[/\\]", tag)):
        return "it is '.' or holds '..'"
    if "/" in tag or "\\" in tag or (os.altsep and os.altsep in tag):
        return "it holds a path separator ('/' or '\\')"
    if tag.startswith("-"):
        return "it starts with '-' (it would read as an option on a command line)"
    if tag.casefold() in {n.casefold() for n in RESERVED_NAMES}:
        return f"{tag!r} is a name dsplug writes in the checkpoint directory ({', '.join(RESERVED_NAMES)})"
    if tag.endswith(RESERVED_SUFFIXES) or ".tmp-" in tag:
        return "it ends in .partial or .old or holds '.tmp-' (the names of a save's own temporary files)"
    try:
        size = len(tag.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid Unicode (a lone surrogate)"
    if size > MAX_TAG_BYTES:
        return f"it is {size} bytes long (UTF-8); at most {MAX_TAG_BYTES} bytes (255, the file-name limit, less " \
               "the '.partial' a save stages it under)"
    return None


def check_tag(tag: Any) -> str:
    """``tag`` when valid, else a one-line :class:`CheckpointError` naming the rule it breaks."""
    problem = tag_problem(tag)
    if problem:
        raise CheckpointError(f"checkpoint tag {_short_repr(tag)} is not valid: {problem}; a tag is a plain "
                              "directory name inside the checkpoint directory")
    return tag


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + "...'" + f" ({len(str(value))} characters)"


def inside(root: str, path: str) -> bool:
    """``path`` resolves (symlinks followed) to ``root`` or somewhere below it."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    try:
        return os.path.commonpath([real_root, real]) == real_root
    except ValueError:  # different drives
        return False


def resolve_tag(load_dir: str, tag: Any) -> str:
    """The directory of ``tag`` in ``load_dir`` to load from, checked: a valid tag whose directory
    (symlinks resolved) lies inside ``load_dir``. A save of the same tag that died between swapping
    directories leaves only ``<tag>.old``, which is complete: that one is returned then."""
    from .manifest import read_manifest

    check_tag(tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path) and os.path.isdir(path + ".old") and read_manifest(path + ".old") is not None:
        path += ".old"
    if not os.path.lexists(path):
        tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))
                      and not d.endswith(RESERVED_SUFFIXES)) if os.path.isdir(load_dir) else []
        raise CheckpointError(f"checkpoint {path} does not exist" + (f"; tags in {load_dir}: {', '.join(tags)}"
                                                                    if tags else ""))
    if not inside(load_dir, path) or os.path.realpath(path) == os.path.realpath(load_dir):
        raise CheckpointError(f"checkpoint tag {tag!r} in {load_dir} resolves to {os.path.realpath(path)}, outside the "
                              "checkpoint directory (a symbolic link?); only a tag inside it is loaded")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is not a directory")
    return path


def read_latest(load_dir: str) -> Optional[str]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        tag = f.read().decode("utf-8", errors="replace").strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; it should hold the tag of the newest checkpoint")
    problem = tag_problem(tag)
    if problem:
        raise CheckpointError(f"{path} names {_short_repr(tag)}, which is not a tag directory inside {load_dir} "
                              f"({problem}); 'latest' must hold a plain tag name")
    return tag
