"""Checkpoint files: layout, crash-safe writes, safe loads (tags: :mod:`.tags`, manifests:
:mod:`.manifest`, retention and resume: :mod:`.retention`).

Layout (DeepSpeed-like)::

    save_dir/latest                                  the tag of the newest complete checkpoint
    save_dir/<tag>/mp_rank_00_model_states.pt        module, counters, scheduler, client_state
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   optimizer / precision state of rank r
    save_dir/<tag>/rng_state_rank_<r>.pt             RNG states of rank r
    save_dir/<tag>/manifest.json                     sha256 and size of every file above (dsplug)

A save writes the whole tag into ``save_dir/<tag>.partial`` (each file to a temp name, fsynced,
renamed), writes the manifest last, then swaps the directory in and rewrites ``latest``. A crash
at any point leaves the previous checkpoint and ``latest`` untouched; a tag directory with a
manifest is complete. Every load checks the file it reads against the manifest; a tag dsplug
wrote that lost its manifest is refused (``checkpoint.require_manifest``), one DeepSpeed wrote
(no manifest, none of dsplug's own files) loads with a warning that it is unverified.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import time
from typing import Any, Dict, List

import torch

LATEST = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"
MANIFEST = "manifest.json"
OWNER = "owner.json"  # in a .partial directory: who is writing it


class CheckpointError(RuntimeError):
    pass


class TagMismatchError(CheckpointError, AssertionError):
    """The ranks passed different checkpoint tags while ``checkpoint.tag_validation`` is ``Fail``.
    Also an ``AssertionError``: DeepSpeed asserts the tags agree, and code (its tests among it)
    catches that."""


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


def make_executable(path: str) -> bool:
    """Add the owner's execute bit to ``path`` (``zero_to_fp32.py`` beside the checkpoints, so that
    ``./zero_to_fp32.py`` runs). A file system that keeps no permissions (a cloud file share) or a
    file that is gone is no error: the script still runs as ``python zero_to_fp32.py``, and the
    log says so at info level. Returns whether the bit is set."""
    import stat

    from dsplug.logging import logger

    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        return True
    except OSError as exc:
        logger.info("could not make %s executable (%s: %s); run it as `python %s`", path,
                    type(exc).__name__, exc.strerror or exc, os.path.basename(path))
        return False


def atomic_save(obj: Any, path: str) -> Dict[str, Any]:
    """``torch.save`` to ``path`` crash-safely; returns its manifest entry (sha256, bytes)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    atomic_write_bytes(path, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


# the parts (they use the names above): tag rules, manifests, retention and resume
from .tags import MAX_TAG_BYTES, RESERVED_NAMES, check_tag, inside, read_latest, resolve_tag, tag_problem  # noqa: E402
from .manifest import (ROOT_FILES, file_entry, kind, read_manifest, verify, verify_save_dir_files,  # noqa: E402
                       write_manifest)
from .manifest import mismatch as _mismatch  # noqa: E402
from .retention import complete_tags, lineage, newest_tag, next_save_seq, prune, resume_tag  # noqa: E402


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
            try:
                stale = os.path.isdir(path[:-len(".old")]) and read_manifest(path[:-len(".old")]) is not None
            except CheckpointError:
                stale = False
        if stale:
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
            removed.append(name)
    return removed


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


def read_file_bytes(path: str) -> bytes:
    """The bytes of a checkpoint file, checked against the tag's manifest when there is one (a
    flipped byte is named, never returned); errors name the file."""
    if not os.path.isfile(path):
        directory = os.path.dirname(path)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise CheckpointError(f"checkpoint file {path} is missing" +
                              (f" (the directory holds: {', '.join(present)})" if present else
                               " (its directory does not exist)"))
    tag_dir = os.path.dirname(path) or "."
    root = os.path.dirname(os.path.abspath(tag_dir))
    if not inside(root, path):
        raise CheckpointError(f"checkpoint file {path} resolves to {os.path.realpath(path)}, outside the checkpoint "
                              f"directory {root} (a symbolic link?); it is not loaded")
    with open(path, "rb") as f:
        data = f.read()
    manifest = read_manifest(tag_dir)
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
