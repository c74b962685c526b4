"""Checkpoint files: layout, crash-safe writes, safe loads.

Layout (DeepSpeed-like)::

    save_dir/latest                                  the tag of the newest complete checkpoint
    save_dir/<tag>/mp_rank_00_model_states.pt        module, counters, scheduler, client_state
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   optimizer / precision state of rank r
    save_dir/<tag>/rng_state_rank_<r>.pt             RNG states of rank r
    save_dir/<tag>/manifest.json                     sha256 and size of every file above (dsplug)

A save writes the whole tag into ``save_dir/<tag>.partial`` (each file to a temp name, fsynced,
renamed), writes the manifest last, then swaps the directory in and rewrites ``latest``. A crash
at any point leaves the previous checkpoint and ``latest`` untouched; a tag directory with a
manifest is complete. Every load checks the file it reads against the manifest.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

LATEST = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"
MANIFEST = "manifest.json"
OWNER = "owner.json"  # in a .partial directory: who is writing it


class CheckpointError(RuntimeError):
    pass


def optim_file(rank: int, mp_rank: int = 0) -> str:
    """The file of data-parallel rank ``rank`` of model-parallel slice ``mp_rank``."""
    return f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_file(mp_rank: int = 0) -> str:
    """The shared (module, counters, client state) file of model-parallel slice ``mp_rank``."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_rank_{rank}.pt"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def atomic_save(obj: Any, path: str) -> Dict[str, Any]:
    """``torch.save`` to ``path`` crash-safely; returns its manifest entry (sha256, bytes)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(path, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def write_manifest(tag_dir: str, files: Dict[str, Dict[str, Any]], **info) -> None:
    """Write ``manifest.json`` (the last file of a tag: its presence marks the tag complete)."""
    body = {"format": 1, "created": time.time(), **info, "files": dict(sorted(files.items()))}
    atomic_write_bytes(os.path.join(tag_dir, MANIFEST), json.dumps(body, indent=1).encode())


def read_manifest(tag_dir: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is corrupt or unreadable: {exc}") from exc
    return manifest


def verify(tag_dir: str) -> List[str]:
    """Problems with the tag directory against its manifest (empty: every file matches)."""
    manifest = read_manifest(tag_dir)
    if manifest is None:
        return [f"{tag_dir} has no {MANIFEST}: it is incomplete, or was not written by dsplug"]
    problems = []
    for name, entry in manifest["files"].items():
        path = os.path.join(tag_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
            continue
        with open(path, "rb") as f:
            problem = _mismatch(path, f.read(), entry)
        if problem:
            problems.append(problem)
    return problems


def _mismatch(path: str, data: bytes, entry: Dict[str, Any]) -> Optional[str]:
    if len(data) != entry.get("bytes"):
        return f"{path} has {len(data)} bytes but its manifest says {entry.get('bytes')}"
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        return f"{path} does not match its manifest (sha256 {digest[:16]}..., expected {str(entry.get('sha256'))[:16]}...)"
    return None


def partial_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f"{tag}.partial")


def begin(save_dir: str, tag: str) -> str:
    """(rank 0) fresh staging directory for ``tag``, marked with this process as its owner."""
    check_tag(tag)
    os.makedirs(save_dir, exist_ok=True)
    staging = partial_dir(save_dir, tag)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    atomic_write_bytes(os.path.join(staging, OWNER),
                       json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    return staging


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_owner(owner: Dict[str, Any]) -> bool:
    return owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) \
        and owner["pid"] != os.getpid() and not _pid_alive(owner["pid"])


def reclaim_leftovers(save_dir: str) -> List[str]:
    """(rank 0, before a save) remove what crashed saves of dead processes on this host left:
    ``<tag>.partial`` staging dirs, ``*.tmp-<pid>`` files, and ``<tag>.old`` copies whose tag is
    complete again. Returns what was removed."""
    removed = []
    if not os.path.isdir(save_dir):
        return removed
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        stale = False
        if name.endswith(".partial") and os.path.isdir(path):
            try:
                with open(os.path.join(path, OWNER)) as f:
                    stale = _dead_owner(json.load(f))
            except (OSError, ValueError):
                stale = False  # no owner record: not ours to judge
        elif ".tmp-" in name and os.path.isfile(path):
            pid = name.rsplit(".tmp-", 1)[1]
            stale = pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))
        elif name.endswith(".old") and os.path.isdir(path):
            stale = read_manifest(path[:-len(".old")]) is not None if os.path.isdir(path[:-len(".old")]) else False
        if stale:
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            removed.append(name)
    return removed


def complete_tags(save_dir: str) -> List[Tuple[str, Dict[str, Any]]]:
    """``(tag, manifest)`` of every complete tag in ``save_dir``, oldest first."""
    found = []
    if not os.path.isdir(save_dir):
        return found
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.endswith((".partial", ".old")) or not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest is not None:
            found.append((name, manifest))
    return sorted(found, key=lambda t: (t[1].get("global_steps", 0), t[1].get("created", 0.0)))


def prune(save_dir: str, keep_last: int, keep: Tuple[str, ...] = ()) -> List[str]:
    """(rank 0, after a complete save) delete the oldest complete tags beyond ``keep_last``."""
    tags = [t for t, _ in complete_tags(save_dir)]
    doomed = [t for t in tags[:max(0, len(tags) - keep_last)] if t not in keep]
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag))
    return doomed


def commit(save_dir: str, tag: str, save_latest: bool) -> str:
    """(rank 0, after every rank wrote) move the staged tag in place, then point ``latest`` at it."""
    staging = partial_dir(save_dir, tag)
    final = os.path.join(save_dir, tag)
    owner = os.path.join(staging, OWNER)
    if os.path.exists(owner):
        os.unlink(owner)
    _fsync_dir(staging)
    if os.path.exists(final):
        old = os.path.join(save_dir, f"{tag}.old")
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _fsync_dir(save_dir)
    if save_latest:
        atomic_write_bytes(os.path.join(save_dir, LATEST), tag.encode())
    return final


def check_tag(tag: str) -> None:
    if not tag or "/" in tag or tag in (".", "..") or tag.endswith((".partial", ".old")):
        raise CheckpointError(f"checkpoint tag {tag!r} is not valid: use a plain name without '/', "
                              "not ending in .partial or .old")


def read_latest(load_dir: str) -> Optional[str]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        tag = f.read().decode("utf-8", errors="replace").strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; it should hold the tag of the newest checkpoint")
    try:
        check_tag(tag)
    except CheckpointError:
        raise CheckpointError(f"{path} names {tag!r}, which is not a tag directory inside {load_dir}; "
                              "'latest' must hold a plain tag name") from None
    return tag


def newest_tag(load_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """The tag to resume from and, when it is not the one ``latest`` names, why.

    A save that died after its tag was complete but before ``latest`` moved leaves a complete tag
    newer than ``latest`` (saved with ``save_latest``): that one is picked, and the reason says so.
    """
    latest = read_latest(load_dir)
    candidates = [(t, m) for t, m in complete_tags(load_dir) if m.get("save_latest", True)]
    newest = candidates[-1][0] if candidates else None
    if newest is None or newest == latest:
        return latest, None
    if latest is None:
        return newest, f"no 'latest' file in {load_dir}, but tag {newest!r} is complete (a save died before " \
                       "writing 'latest'); loading it"
    ranked = [t for t, _ in candidates]
    if latest in ranked and ranked.index(latest) > ranked.index(newest):
        return latest, None
    return newest, f"'latest' in {load_dir} names {latest!r}, but {newest!r} is newer and complete (a save died " \
                   "before updating 'latest'); loading it"


def read_file_bytes(path: str) -> bytes:
    """The bytes of a checkpoint file, checked against the tag's manifest when there is one (a
    flipped byte is named, never returned); errors name the file."""
    if not os.path.isfile(path):
        directory = os.path.dirname(path)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise CheckpointError(f"checkpoint file {path} is missing" +
                              (f" (the directory holds: {', '.join(present)})" if present else
                               " (its directory does not exist)"))
    with open(path, "rb") as f:
        data = f.read()
    manifest = read_manifest(os.path.dirname(path) or ".")
    entry = manifest["files"].get(os.path.basename(path)) if manifest is not None else None
    if manifest is not None and entry is None:
        raise CheckpointError(f"checkpoint file {path} is not listed in its tag's {MANIFEST}; it was not part "
                              "of the save")
    if entry is not None:
        problem = _mismatch(path, data, entry)
        if problem:
            raise CheckpointError(f"checkpoint file {problem}: it is corrupt or was changed after saving "
                                  "(`dsplug checkpoint verify` checks a whole checkpoint)")
    return data


def load_file(path: str, weights_only: bool = True) -> Any:
    """``torch.load`` with clear errors naming the file, checked against the tag's manifest when
    there is one (a flipped byte is named, never loaded)."""
    data = read_file_bytes(path)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        if weights_only and "This file can still be loaded" in str(exc):  # a real pickle with other globals
            raise CheckpointError(
                f"checkpoint file {path} holds objects that torch.load(weights_only=True) refuses "
                f"({type(exc).__name__}). If you trust the file, set \"checkpoint\": {{\"weights_only\": false}} "
                "in the config") from exc
        raise CheckpointError(f"checkpoint file {path} is corrupt or unreadable: {type(exc).__name__}: {exc}") from exc


def rng_state(accelerator=None) -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "python": _py_state_to_plain(random.getstate())}
    device_state = accelerator.rng_state() if accelerator is not None else None
    if device_state is not None:
        state["accelerator"] = device_state
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    except ImportError:
        pass
    return state


def set_rng_state(state: dict, accelerator=None) -> None:
    import random

    torch.set_rng_state(state["torch"])
    if accelerator is not None and state.get("accelerator") is not None:
        accelerator.set_rng_state(state["accelerator"])
    random.setstate(_plain_to_py_state(state["python"]))
    if "numpy" in state:
        try:
            import numpy as np

            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
        except ImportError:
            pass


def _py_state_to_plain(state):
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _plain_to_py_state(state):
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


# DeepSpeed's submodules of ``deepspeed.checkpoint`` (``utils``, ``constants``), imported on first use
_SUBMODULES = {"utils", "constants"}


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
