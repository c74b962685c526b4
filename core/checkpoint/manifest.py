"""The manifest of a checkpoint tag: ``<tag>/manifest.json``, written last by a save.

It lists every file of the tag (``files``: plain name -> sha256 and size), the files of the save
directory the tag goes with (``save_dir_files``: ``zero_to_fp32.py``, when the ZeRO plugin wrote
it), and the save's place in its directory's history (``save_seq``, ``parent``, ``created``; see
:mod:`.retention`). Its presence marks the tag complete; loads and ``dsplug checkpoint verify``
check every file against it.

Reading is defensive: a manifest is data from disk. Its shape is validated before use, a file
name must be a plain name inside the tag directory (never a path elsewhere: such an entry is
reported, not read), and a problem is a message, never a traceback.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any, Dict, List, Optional

from . import MANIFEST, CheckpointError, atomic_write_bytes
from .tags import inside

#: files of the save directory (next to the tags) that a manifest may record
ROOT_FILES = ("zero_to_fp32.py",)
#: files only dsplug writes in a tag directory: a tag holding one but no manifest was written by
#: dsplug (and lost its manifest), not by DeepSpeed
DSPLUG_MARKERS = re.compile(r"(rng_state_rank_\d+\.pt|owner\.json)$")
_SHA256 = re.compile(r"[0-9a-f]{64}$")
_CHUNK = 1 << 22


def write_manifest(tag_dir: str, files: Dict[str, Dict[str, Any]], save_dir_files: Optional[Dict] = None,
                   **info) -> None:
    """Write ``manifest.json`` (the last file of a tag: its presence marks the tag complete)."""
    body = {"format": 1, "writer": "dsplug", "created": time.time(), **info, "files": dict(sorted(files.items()))}
    if save_dir_files:
        body["save_dir_files"] = dict(sorted(save_dir_files.items()))
    atomic_write_bytes(os.path.join(tag_dir, MANIFEST), json.dumps(body, indent=1).encode())


def file_entry(path: str) -> Dict[str, Any]:
    """A manifest entry (sha256, bytes) for the file at ``path``."""
    digest, size = _digest(path)
    return {"sha256": digest, "bytes": size}


def name_problem(name: Any) -> Optional[str]:
    """Why ``name`` is not a plain file name inside a tag directory (None: it is)."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name or os.path.isabs(name):
        return "is not a plain file name inside the tag directory"
    return None


def entry_problem(entry: Any) -> Optional[str]:
    if not isinstance(entry, dict):
        return f"has an entry of type {type(entry).__name__}, not {{'sha256': ..., 'bytes': ...}}"
    size, digest = entry.get("bytes"), entry.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"has a size {size!r:.40} that is not a byte count"
    if not isinstance(digest, str) or not _SHA256.match(digest):
        return f"has a sha256 {digest!r:.40} that is not 64 hex digits"
    return None


def manifest_problem(manifest: Any) -> Optional[str]:
    """What makes ``manifest`` (parsed JSON) unusable as a whole (None: its shape is right)."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    if not isinstance(manifest.get("files"), dict):
        return "it has no 'files' table"
    if not manifest["files"]:
        return "its 'files' table is empty (a save always writes files)"
    roots = manifest.get("save_dir_files", {})
    if not isinstance(roots, dict):
        return "its 'save_dir_files' is not a table"
    return None


def read_manifest(tag_dir: str) -> Optional[Dict[str, Any]]:
    """The parsed manifest of ``tag_dir`` (None when it has none); raises :class:`CheckpointError`
    naming the file when it is unreadable or not shaped like one."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is corrupt or unreadable: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None
    problem = manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint manifest {path} is corrupt: {problem}")
    return manifest


def _digest(path: str):
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def mismatch(path: str, data: bytes, entry: Dict[str, Any]) -> Optional[str]:
    """How ``data`` (the bytes of ``path``) differs from its manifest ``entry`` (None: it matches)."""
    if len(data) != entry.get("bytes"):
        return f"{path} has {len(data)} bytes but its manifest says {entry.get('bytes')}"
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        return f"{path} does not match its manifest (sha256 {digest[:16]}..., expected " \
               f"{str(entry.get('sha256'))[:16]}...)"
    return None


def check_file(directory: str, name: Any, entry: Any) -> Optional[str]:
    """The problem with file ``name`` of ``directory`` against its manifest ``entry`` (None: it
    matches). Reads nothing outside ``directory``: a name that is not a plain file name, or a file
    that resolves elsewhere (a symbolic link), is reported without being opened."""
    problem = name_problem(name)
    if problem:
        return f"the manifest entry {name!r:.80} {problem}; not read"
    path = os.path.join(directory, name)
    problem = entry_problem(entry)
    if problem:
        return f"the manifest entry of {path} {problem}"
    if not os.path.lexists(path):
        return f"{path} is missing"
    if not inside(directory, path):
        return f"{path} resolves to {os.path.realpath(path)}, outside {directory}; not read"
    if not os.path.isfile(path):
        return f"{path} is not a regular file"
    try:
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            return f"{path} has {size} bytes but its manifest says {entry['bytes']}"
        digest, size = _digest(path)
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    if size != entry["bytes"]:
        return f"{path} has {size} bytes but its manifest says {entry['bytes']}"
    if digest != entry["sha256"]:
        return f"{path} does not match its manifest (sha256 {digest[:16]}..., expected {entry['sha256'][:16]}...)"
    return None


def verify(tag_dir: str) -> List[str]:
    """Problems with the tag directory against its manifest (empty: every file matches). Never
    raises for what is on disk and never reads outside ``tag_dir``."""
    try:
        manifest = read_manifest(tag_dir)
    except CheckpointError as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"{tag_dir}: {exc.strerror or exc}"]
    if manifest is None:
        return [f"{tag_dir} has no {MANIFEST}: it is incomplete, or was not written by dsplug"]
    problems = [check_file(tag_dir, name, entry) for name, entry in manifest["files"].items()]
    return [p for p in problems if p]


def verify_save_dir_files(save_dir: str, manifest: Dict[str, Any]) -> List[str]:
    """Problems with the save directory's own files (``zero_to_fp32.py``) against what
    ``manifest`` (of one of its tags) recorded. Only the names in :data:`ROOT_FILES` are read."""
    problems = []
    for name, entry in (manifest.get("save_dir_files") or {}).items():
        if name not in ROOT_FILES:
            problems.append(f"the manifest records a save-directory file {name!r:.80}, which dsplug never writes; "
                            "not read")
            continue
        problem = check_file(save_dir, name, entry)
        if problem:
            problems.append(problem)
    return problems


def kind(tag_dir: str) -> str:
    """``"manifest"`` (dsplug's, with its manifest), ``"dsplug-without-manifest"`` (dsplug's files,
    the manifest gone) or ``"foreign"`` (no manifest and none of dsplug's own files: DeepSpeed's,
    or another tool's)."""
    if os.path.lexists(os.path.join(tag_dir, MANIFEST)):
        return "manifest"
    try:
        names = os.listdir(tag_dir)
    except OSError:
        return "foreign"
    return "dsplug-without-manifest" if any(DSPLUG_MARKERS.match(n) for n in names) else "foreign"


__all__ = ["DSPLUG_MARKERS", "ROOT_FILES", "check_file", "entry_problem", "file_entry", "kind",
           "manifest_problem", "mismatch", "name_problem", "read_manifest", "verify", "verify_save_dir_files",
           "write_manifest"]
