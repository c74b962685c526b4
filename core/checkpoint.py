"""Checkpoint files: layout, crash-safe writes, safe loads.

Layout (DeepSpeed-like)::

    save_dir/latest                                  the tag of the newest complete checkpoint
    save_dir/<tag>/mp_rank_00_model_states.pt        module, counters, scheduler, client_state
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   optimizer / precision state of rank r
    save_dir/<tag>/rng_state_rank_<r>.pt             RNG states of rank r

A save writes the whole tag into ``save_dir/<tag>.partial`` (each file to a temp name, fsynced,
renamed), then swaps the directory in and rewrites ``latest`` last. A crash at any point leaves
the previous checkpoint and ``latest`` untouched.
"""
from __future__ import annotations

import io
import os
import shutil
from typing import Any, Optional

import torch

LATEST = "latest"
MODEL_FILE = "mp_rank_00_model_states.pt"


class CheckpointError(RuntimeError):
    pass


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


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


def atomic_save(obj: Any, path: str) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def partial_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f"{tag}.partial")


def begin(save_dir: str, tag: str) -> str:
    """(rank 0) fresh staging directory for ``tag``."""
    check_tag(tag)
    os.makedirs(save_dir, exist_ok=True)
    staging = partial_dir(save_dir, tag)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def commit(save_dir: str, tag: str, save_latest: bool) -> str:
    """(rank 0, after every rank wrote) move the staged tag in place, then point ``latest`` at it."""
    staging = partial_dir(save_dir, tag)
    final = os.path.join(save_dir, tag)
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
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise CheckpointError(f"{path} is empty; it should hold the tag of the newest checkpoint")
    return tag


def load_file(path: str, weights_only: bool = True) -> Any:
    """``torch.load`` with clear errors naming the file."""
    if not os.path.isfile(path):
        directory = os.path.dirname(path)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise CheckpointError(f"checkpoint file {path} is missing" +
                              (f" (the directory holds: {', '.join(present)})" if present else
                               " (its directory does not exist)"))
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
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
