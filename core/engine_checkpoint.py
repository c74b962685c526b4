"""Engine checkpoints: every part contributes and restores its own state through the checkpoint
hooks (``dsplug_checkpoint_state`` / ``dsplug_load_checkpoint_state``), called through the
engine's event bus; this module only writes and reads the files (:mod:`dsplug.checkpoint`).

Files of a tag (DeepSpeed's names): the shared ``mp_rank_00_model_states.pt`` holds every
``scope="model"`` contribution plus the engine's own record (counters, client_state, config);
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds rank ``r``'s ``scope="rank"``
contributions; ``rng_state_rank_<r>.pt`` its RNG states. A plugin may add files of its own
(``dsplug_checkpoint_files``, e.g. MoE experts one file each, the pipeline's layer files), written
with the others and listed in the manifest; it reads them back in ``dsplug_checkpoint_read``, before
any part loads, or -- an engine subclass loading in its own way -- after :func:`resolve_tag`, with
:func:`dsplug.checkpoint.load_file` (checked against the manifest).
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
from typing import Any, Dict, Optional, Tuple

import attrs
import torch

from . import checkpoint as ckpt
from . import comm
from .contracts.checkpoint import CheckpointView, LoadOptions, SaveOptions
from .hookspecs import hookimpl
from .logging import log_rank0

#: keys of the shared file that the engine itself writes
ENGINE_KEYS = ("client_state", "world_size", "ds_config", "dsplug_version")


@attrs.define(eq=False)
class EngineCounters:
    """The engine's step counters, a checkpoint participant like any other part."""

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0

    @staticmethod
    def field(name: str):
        """A property of the engine reading and writing ``engine.counters.<name>``."""
        return property(lambda engine: getattr(engine.counters, name),
                        lambda engine, value: setattr(engine.counters, name, value))

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        return attrs.asdict(self) if scope == "model" else None

    @hookimpl
    def dsplug_load_checkpoint_state(self, engine, checkpoint):
        if checkpoint.options.load_module_only:
            return
        for name in attrs.fields_dict(type(self)):
            if name in checkpoint.model:
                setattr(self, name, int(checkpoint.model[name]))
        # Saved at an accumulation boundary with other gradient_accumulation_steps (a resume at another
        # world size whose batch split differs, or a changed config): count the finished windows in this
        # run's steps, so the next optimizer step accumulates exactly this run's number of micro-batches.
        saved = (checkpoint.model.get("ds_config") or {}).get("gradient_accumulation_steps")
        gas = engine.gradient_accumulation_steps()
        if isinstance(saved, int) and saved > 0 and self.micro_steps % gas and self.micro_steps % saved == 0:
            self.micro_steps = self.micro_steps // saved * gas


class SchedulerState:
    """Saves and restores whatever LR scheduler the engine holds (configured or the client's)."""

    def __init__(self, engine):
        self.engine = engine

    @hookimpl
    def dsplug_checkpoint_state(self, scope):
        if scope != "model":
            return None
        scheduler = self.engine.lr_scheduler
        return {"lr_scheduler": scheduler.state_dict() if scheduler is not None else None}

    @hookimpl
    def dsplug_load_checkpoint_state(self, checkpoint):
        scheduler, saved = self.engine.lr_scheduler, checkpoint.model.get("lr_scheduler")
        options = checkpoint.options
        if scheduler is not None and saved and options.load_lr_scheduler_states and not options.load_module_only:
            scheduler.load_state_dict(saved)


def contributions(engine, hook: str, /, **kwargs):
    """``(plugin name, result)`` of every implementation of ``hook`` on the engine's bus, in
    pluggy's call order, results of None left out: each is called on its own so that what it
    returned can be attributed to it. (With a hook wrapper on the bus, the hook is called as a
    whole and the results are attributed to the implementers together.)"""
    caller = getattr(engine.events.hook, hook)
    impls = caller.get_hookimpls()
    if any(i.hookwrapper or getattr(i, "wrapper", False) for i in impls):
        names = ", ".join(i.plugin_name for i in impls)
        return [(f"one of {names}", r) for r in caller(**kwargs)]
    out = []
    for impl in reversed(impls):
        result = impl.function(*[kwargs[name] for name in impl.argnames])
        if result is not None:
            out.append((impl.plugin_name, result))
    return out


def merge(results, scope: str, owners: Dict[str, str]) -> Dict[str, Any]:
    """The ``(plugin, contribution)`` results of ``dsplug_checkpoint_state`` for ``scope``, checked
    and merged; ``owners`` gets ``key -> plugin``. A key given twice is an error naming both."""
    merged: Dict[str, Any] = {}
    for plugin, contribution in results:
        if not isinstance(contribution, dict):
            raise ckpt.CheckpointError(f"plugin {plugin!r}: dsplug_checkpoint_state returned "
                                       f"{type(contribution).__name__} for scope {scope!r}; expected a dict "
                                       "{key: state} (or nothing); nothing was saved")
        for key, value in contribution.items():
            if not isinstance(key, str):
                raise ckpt.CheckpointError(f"plugin {plugin!r}: dsplug_checkpoint_state returned the key {key!r} "
                                           f"({type(key).__name__}) for scope {scope!r}; keys are strings; nothing "
                                           "was saved")
            if key in merged or (scope == "model" and key in ENGINE_KEYS):
                first = owners.get(key, "the engine")
                raise ckpt.CheckpointError(f"checkpoint key {key!r} (scope {scope!r}) is contributed by {first!r} "
                                           f"and by plugin {plugin!r}; each participant must use its own keys; "
                                           "nothing was saved")
            merged[key], owners[key] = value, plugin
    return merged


def collect(engine, scope: str, options: SaveOptions, owners: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Every participant's contribution for ``scope``, merged (see :func:`merge`)."""
    results = contributions(engine, "dsplug_checkpoint_state", engine=engine, scope=scope, options=options)
    return merge(results, scope, {} if owners is None else owners)


def save_state(state: Dict[str, Any], path: str, owners: Dict[str, str], scope: str) -> Dict[str, Any]:
    """``ckpt.atomic_save`` of a merged state; when it cannot be pickled, the error names the key
    and the plugin that contributed it (found by saving each value alone, on the error path only)."""
    try:
        return ckpt.atomic_save(state, path)
    except (ckpt.CheckpointError, OSError):  # a write error says itself what went wrong
        raise
    except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
        for key, value in state.items():
            try:
                torch.save(value, io.BytesIO())
            except Exception as inner:  # noqa: BLE001
                who = f"plugin {owners[key]!r}" if key in owners else "the engine's own record"
                raise ckpt.CheckpointError(f"checkpoint state {key!r} (scope {scope!r}) from {who} cannot be saved: "
                                           f"{type(inner).__name__}: {_first_line(inner)}; nothing was saved") from exc
        raise ckpt.CheckpointError(f"{os.path.basename(path)} cannot be saved: {type(exc).__name__}: "
                                   f"{_first_line(exc)}; nothing was saved") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


#: names of the files the engine writes itself in a tag directory
_ENGINE_FILES = re.compile(r"(mp_rank_\d+_model_states|zero_pp_rank_\d+_mp_rank_\d+_optim_states"
                           r"|rng_state_rank_\d+)\.pt$")


def plugin_files(engine, shared: Dict[str, Any], options: SaveOptions, owners: Dict[str, str] = None) -> Dict[str, Any]:
    """This rank's files of the participants that write their own (hook ``dsplug_checkpoint_files``),
    checked: plain file names, none of the engine's, none given twice."""
    files: Dict[str, Any] = {}
    owners = {} if owners is None else owners
    for plugin, contribution in contributions(engine, "dsplug_checkpoint_files", engine=engine, shared=shared,
                                              options=options):
        if not isinstance(contribution, dict):
            raise ckpt.CheckpointError(f"plugin {plugin!r}: dsplug_checkpoint_files returned "
                                       f"{type(contribution).__name__}; expected a dict {{file name: state}}")
        for name, state in contribution.items():
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") \
                    or name in (ckpt.MANIFEST, ckpt.OWNER) or _ENGINE_FILES.match(name) or ckpt.tag_problem(name):
                raise ckpt.CheckpointError(f"plugin {plugin!r}: dsplug_checkpoint_files named a file {name!r}: a "
                                           "plugin's file needs a plain file name that is not one of the engine's "
                                           "(model / optimizer / rng states, manifest)")
            if name in files:
                raise ckpt.CheckpointError(f"checkpoint file {name!r} is contributed by plugin {owners[name]!r} and "
                                           f"by plugin {plugin!r} on this rank")
            files[name], owners[name] = state, plugin
    return files


def _save_plugin_file(state, path: str) -> Dict[str, Any]:
    """A plugin's file: ``bytes`` as they are (a JSON index, say), anything else with torch.save."""
    if isinstance(state, (bytes, bytearray)):
        data = bytes(state)
        ckpt.atomic_write_bytes(path, data)
        return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return ckpt.atomic_save(state, path)


def _implementers(engine, hook: str = "dsplug_checkpoint_state") -> str:
    return ", ".join(i.plugin_name for i in getattr(engine.events.hook, hook).get_hookimpls())


@comm.operation("save_checkpoint")  # a dead or stopped rank is named in the error
def save_checkpoint(engine, save_dir, tag, client_state, save_latest: bool, exclude_frozen_parameters: bool) -> bool:
    if save_dir is None or not os.fspath(save_dir):
        raise ValueError(f"save_checkpoint: save_dir is {save_dir!r}; give the directory to save the checkpoint in "
                         "(each save is a tag directory inside it)")
    save_dir = os.fspath(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tag = _agreed_tag(engine, tag)
    rank0 = engine.global_rank == 0

    def prepare():
        if rank0:
            removed = ckpt.reclaim_leftovers(save_dir)
            if removed:
                log_rank0(f"checkpoint: removed leftovers of crashed saves in {save_dir}: {', '.join(removed)}")
            ckpt.begin(save_dir, tag)

    _on_every_rank("preparing", prepare)
    try:
        return _save_staged(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    except BaseException:
        if rank0:  # a failed save leaves nothing behind (the previous checkpoint is untouched)
            shutil.rmtree(ckpt.partial_dir(save_dir, tag), ignore_errors=True)
        raise


def _save_staged(engine, save_dir, tag, client_state, save_latest: bool, exclude_frozen_parameters: bool) -> bool:
    rank0 = engine.global_rank == 0
    staging = ckpt.partial_dir(save_dir, tag)
    options = SaveOptions(tag=tag, save_dir=save_dir, exclude_frozen_parameters=exclude_frozen_parameters)
    owners: Dict[str, Dict[str, str]] = {"model": {}, "rank": {}, "files": {}}
    # every rank asks every participant (contributions may be collectives), then all check together
    model_results = contributions(engine, "dsplug_checkpoint_state", engine=engine, scope="model", options=options)
    rank_results = contributions(engine, "dsplug_checkpoint_state", engine=engine, scope="rank", options=options)
    shared, own = _on_every_rank("collecting", lambda: (merge(model_results, "model", owners["model"]),
                                                        merge(rank_results, "rank", owners["rank"])))[engine.global_rank]
    # files plugins write themselves (may trim ``shared``)
    extra = _on_every_rank("collecting", lambda: plugin_files(engine, shared, options, owners["files"]))[
        engine.global_rank]

    dp_rank, mp_rank = engine.context.rank, engine.context.mp_rank
    model_file = ckpt.model_file(mp_rank)

    def write_files():
        files = {}
        if dp_rank == 0:  # one shared file per model-parallel slice (rank 0 without model parallelism)
            client = dict(client_state or {})
            # the client's keys also at the top level, where DeepSpeed keeps them (the same
            # objects: pickled once); a key the checkpoint itself uses stays under client_state only
            top = {k: v for k, v in client.items() if isinstance(k, str) and k not in shared and k not in ENGINE_KEYS}
            who = {**{k: "client_state (the caller's)" for k in top}, **owners["model"],
                   "client_state": "client_state (the caller's)"}
            files[model_file] = save_state(
                {**top, **shared, "client_state": client, "world_size": engine.world_size,
                 "mp_world_size": engine.context.mp_world_size, "ds_config": engine.config.to_dict(),
                 "dsplug_version": _version()},
                os.path.join(staging, model_file), who, "model")
        optim = ckpt.optim_file(dp_rank, mp_rank)
        files[optim] = save_state({**own, "rank": dp_rank, "world_size": engine.world_size},
                                  os.path.join(staging, optim), owners["rank"], "rank")
        rng = ckpt.rng_file(engine.global_rank)
        files[rng] = ckpt.atomic_save(ckpt.rng_state(engine.accelerator), os.path.join(staging, rng))
        for name, state in extra.items():
            try:
                files[name] = _save_plugin_file(state, os.path.join(staging, name))
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
                raise ckpt.CheckpointError(f"checkpoint file {name!r} from plugin {owners['files'][name]!r} cannot be "
                                           f"saved: {type(exc).__name__}: {_first_line(exc)}; nothing was saved") from exc
        return files

    written = _on_every_rank("writing", write_files, gather=True)

    def commit():
        if not rank0:
            return
        files = {}
        for rank, per_rank in enumerate(written):
            for name, entry in per_rank.items():
                if name in files:
                    raise ckpt.CheckpointError(f"checkpoint file {name} was written by two ranks (the second: rank "
                                               f"{rank}); a plugin's own files need a name per rank")
                files[name] = entry
        history = _history(engine)
        ckpt.write_manifest(staging, files, save_dir_files=_save_dir_files(save_dir), tag=tag,
                            global_steps=engine.global_steps, world_size=engine.world_size,
                            save_latest=bool(save_latest), save_seq=ckpt.next_save_seq(save_dir),
                            parent=history.parent_in(save_dir))
        ckpt.commit(save_dir, tag, save_latest)
        keep_last = engine.config.checkpoint.keep_last
        if keep_last:
            removed = ckpt.prune(save_dir, keep_last, tag,
                                 protect=(_latest_or_none(save_dir), history.loaded_in(save_dir)))
            if removed:
                log_rank0(f"checkpoint: keep_last={keep_last}: removed {', '.join(removed)}")

    _on_every_rank("committing", commit)
    _history(engine).saved(save_dir, tag)
    return True


def resolve_tag(load_dir, tag=None):
    """The tag directory a load of ``tag`` from ``load_dir`` reads, or None when there is nothing
    to load (warned). ``tag=None``: the newest complete checkpoint (``latest``, or a complete tag
    a crashed save left newer than it), rank 0's answer on every rank (a collective); a missing
    tag directory whose ``<tag>.old`` copy is complete (a save of the same tag died while
    swapping) resolves to that copy. For engine subclasses that load in their own way, so that
    every load resolves tags alike."""
    load_dir = os.fspath(load_dir)
    if tag is None:  # rank 0 picks (it may verify whole tags), every rank gets its answer
        tag, why = _on_every_rank("finding the newest checkpoint",
                                  lambda: ckpt.resume_tag(load_dir) if comm.get_rank() == 0 else None,
                                  gather=True)[0]
        if why:
            log_rank0(f"warning: {why}", logging.WARNING)
        if tag is None:
            log_rank0(f"warning: no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a "
                      "specific checkpoint)", logging.WARNING)
            return None
    tag = str(tag)
    path = _on_every_rank("finding the checkpoint", lambda: ckpt.resolve_tag(load_dir, tag))[comm.get_rank()]
    if path.endswith(".old"):  # a save of the same tag died between swapping directories
        log_rank0(f"warning: {os.path.join(load_dir, tag)} is missing but {path} is complete; loading that",
                  logging.WARNING)
    return path


@comm.operation("load_checkpoint")  # a dead or stopped rank is named in the error
def load_checkpoint(engine, load_dir, tag=None, **flags):
    path = resolve_tag(load_dir, tag)
    if path is None:
        return None, None
    weights_only = engine.config.checkpoint.weights_only
    options = LoadOptions(**flags)

    dp_rank, mp_rank = engine.context.rank, engine.context.mp_rank
    model_file = ckpt.model_file(mp_rank)

    def read_rank(rank: int) -> dict:
        """The file of data-parallel rank ``rank`` of this rank's model-parallel slice."""
        return ckpt.load_file(os.path.join(path, ckpt.optim_file(rank, mp_rank)), weights_only)

    def read_own_files():
        # every rank reads (and verifies) its files before any part loads, so a bad file on one
        # rank fails every rank with the same error instead of a hang in the next collective.
        # A tag without a manifest that dsplug wrote is refused (unless checkpoint.require_manifest
        # is off); one DeepSpeed wrote has none: a file it lacks is read as empty, and the parts
        # that know its format read what they need from the directory themselves
        # (checkpoint.path), e.g. the ZeRO stages a DeepSpeed checkpoint.
        foreign = unverified["kind"] == "foreign"

        def read(file_name: str, reader):
            if foreign and not os.path.isfile(os.path.join(path, file_name)):
                return {}
            return reader()

        shared = read(model_file, lambda: ckpt.load_file(os.path.join(path, model_file), weights_only))
        if unverified["kind"] == "foreign" and "dsplug_version" in shared:
            unverified["kind"] = "dsplug-without-manifest"
            _refuse_without_manifest(engine, path)
        saved_mp = int(shared.get("mp_world_size", 1))
        if saved_mp != engine.context.mp_world_size:
            raise ckpt.CheckpointError(f"{path} was saved with {saved_mp} model-parallel slice(s), this run has "
                                       f"{engine.context.mp_world_size}; load it with the same model parallelism")
        saved_world = int(shared.get("world_size", 1))
        own_rank = min(dp_rank, saved_world - 1)
        own = {} if options.load_module_only else read(ckpt.optim_file(own_rank, mp_rank),
                                                       lambda: read_rank(own_rank))
        rng_path = os.path.join(path, ckpt.rng_file(engine.global_rank))
        rng = ckpt.load_file(rng_path, weights_only) if not options.load_module_only and os.path.exists(rng_path) \
            else None
        return shared, own, rng

    unverified = {"kind": ckpt.kind(path)}
    if unverified["kind"] == "dsplug-without-manifest":
        _on_every_rank("reading", lambda: _refuse_without_manifest(engine, path))
    shared, own, rng = _on_every_rank("reading", read_own_files, same_error=True)[engine.global_rank]
    if unverified["kind"] == "foreign":
        log_rank0(f"warning: checkpoint {path} has no {ckpt.MANIFEST} nor any of dsplug's files: it was written by "
                  "DeepSpeed (or another tool), so its files load unverified (a flipped or truncated byte cannot be "
                  "detected)", logging.WARNING)
    view = CheckpointView(model=shared, rank=own, saved_world_size=int(shared.get("world_size", 1)),
                          read_rank=read_rank, options=options, path=path)
    # plugins complete the view from their own files first (a failure anywhere stops every rank)
    _on_every_rank("reading", lambda: engine.events.hook.dsplug_checkpoint_read(engine=engine, checkpoint=view),
                   same_error=True)
    engine.events.hook.dsplug_load_checkpoint_state(engine=engine, checkpoint=view)
    if rng is not None:
        ckpt.set_rng_state(rng, engine.accelerator)
    _history(engine).loaded(load_dir, path)
    return path, shared.get("client_state", {})


def _refuse_without_manifest(engine, path: str) -> None:
    """A tag dsplug wrote whose manifest is gone: refused, or (``checkpoint.require_manifest``
    off) loaded with a warning."""
    manifest = os.path.join(path, ckpt.MANIFEST)
    if engine.config.checkpoint.require_manifest:
        raise ckpt.CheckpointError(
            f"checkpoint {path} was written by dsplug but {manifest} is missing, so its files cannot be verified "
            "(an interrupted copy, or deleted); restore the file, or set \"checkpoint\": {\"require_manifest\": "
            "false} in the config to load it unverified")
    log_rank0(f"warning: {manifest} is missing; loading {path} unverified (checkpoint.require_manifest is false)",
              logging.WARNING)


@attrs.define
class CheckpointHistory:
    """What this run loaded and saved (real paths), for the lineage a save records in its manifest
    (``parent``) and what retention must keep (the tag this run loaded from)."""

    loaded_from: Optional[Tuple[str, str]] = None  # (directory, tag)
    last: Optional[Tuple[str, str]] = None  # the latest tag loaded or saved: the next save's parent

    def loaded(self, load_dir: str, tag_path: str) -> None:
        tag = os.path.basename(tag_path)
        tag = tag[:-len(".old")] if tag.endswith(".old") else tag
        self.loaded_from = self.last = (os.path.realpath(load_dir), tag)

    def saved(self, save_dir: str, tag: str) -> None:
        self.last = (os.path.realpath(save_dir), tag)

    def parent_in(self, save_dir: str) -> Optional[str]:
        return self.last[1] if self.last and self.last[0] == os.path.realpath(save_dir) else None

    def loaded_in(self, save_dir: str) -> Optional[str]:
        return self.loaded_from[1] if self.loaded_from and self.loaded_from[0] == os.path.realpath(save_dir) else None


def _history(engine) -> CheckpointHistory:
    history = getattr(engine, "_checkpoint_history", None)
    if history is None:
        history = CheckpointHistory()
        engine._checkpoint_history = history
    return history


def _latest_or_none(save_dir: str) -> Optional[str]:
    try:
        return ckpt.read_latest(save_dir)
    except ckpt.CheckpointError:
        return None


def _save_dir_files(save_dir: str) -> Dict[str, Any]:
    """Manifest entries of the save directory's own files (``zero_to_fp32.py``) present now."""
    entries = {}
    for name in ckpt.ROOT_FILES:
        path = os.path.join(save_dir, name)
        if os.path.isfile(path) and not os.path.islink(path):
            entries[name] = ckpt.file_entry(path)
    return entries


def _on_every_rank(what: str, step, same_error: bool = False, gather: bool = False) -> list:
    """Run ``step`` here, then agree with every rank on whether it worked (a collective).

    Returns one result per rank when all succeeded: this rank's at its own index, and the other
    ranks' too with ``gather`` (small, picklable results only), else None there. A failure anywhere
    raises everywhere; with ``same_error`` every rank raises the same message.
    """
    error, result = None, None
    try:
        result = step()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = exc
    shared = result if gather else None
    outcomes = comm.all_gather_object((None, shared) if error is None else (f"{type(error).__name__}: {error}", None))
    failed = [(rank, text) for rank, (text, _) in enumerate(outcomes) if text]
    if failed:
        rank, text = failed[0]
        if error is not None and not same_error:
            raise error
        saving = what in ("preparing", "writing", "committing")
        raise ckpt.CheckpointError(f"checkpoint {what} failed on rank {rank}: {text}" +
                                   ("; the previous checkpoint is untouched" if saving else
                                    "; nothing was loaded on any rank")) from error
    results = [value for _, value in outcomes]
    results[comm.get_rank()] = result
    return results


def _agreed_tag(engine, tag: str) -> str:
    """The tag every rank saves under. Every rank checks the tag's name (one rule set,
    :func:`dsplug.checkpoint.check_tag`) in one exchange, which also serves DeepSpeed's
    ``checkpoint.tag_validation`` (Ignore / Warn / Fail: whether every rank passed the same tag) —
    two separate questions. Ranks that passed different tags under Warn or Ignore save together
    under rank 0's: a checkpoint's files are one tag directory (DeepSpeed would scatter them)."""
    problem = ckpt.tag_problem(tag)
    if engine.world_size == 1:
        if problem:
            ckpt.check_tag(tag)
        return tag
    gathered = comm.all_gather_object((tag, problem))
    if problem:
        ckpt.check_tag(tag)  # raises, naming the rule
    for rank, (other, other_problem) in enumerate(gathered):
        if other_problem:
            raise ckpt.CheckpointError(f"checkpoint tag {other!r} of rank {rank} is not valid: {other_problem}; "
                                       "nothing was saved")
    mode = engine.config.checkpoint.tag_validation
    tags = [t for t, _ in gathered]
    if len(set(tags)) > 1:
        message = f"checkpoint tags differ across ranks: {tags}"
        if mode == "Fail":
            raise ckpt.TagMismatchError(message + " (checkpoint.tag_validation is Fail)")
        if mode != "Ignore":
            log_rank0(f"warning: {message}; every rank saves under rank 0's tag {tags[0]!r}", logging.WARNING)
    return tags[0]


def _version() -> str:
    from . import __version__

    return __version__
