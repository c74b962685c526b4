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
import logging
import os
import re
from typing import Any, Dict

import attrs

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


def collect(engine, scope: str, options: SaveOptions) -> Dict[str, Any]:
    """Every participant's contribution for ``scope``, merged; a key given twice is an error."""
    merged: Dict[str, Any] = {}
    for contribution in engine.events.hook.dsplug_checkpoint_state(engine=engine, scope=scope, options=options):
        if not isinstance(contribution, dict):
            raise ckpt.CheckpointError(f"a dsplug_checkpoint_state implementation returned {type(contribution).__name__}"
                                       f" for scope {scope!r}; expected a dict {{key: state}} (or return nothing) "
                                       f"(implementers: {_implementers(engine)})")
        for key, value in contribution.items():
            if key in merged or (scope == "model" and key in ENGINE_KEYS):
                raise ckpt.CheckpointError(f"checkpoint key {key!r} (scope {scope!r}) is contributed twice; each "
                                           f"participant must use its own keys (implementers: {_implementers(engine)})")
            merged[key] = value
    return merged


#: names of the files the engine writes itself in a tag directory
_ENGINE_FILES = re.compile(r"(mp_rank_\d+_model_states|zero_pp_rank_\d+_mp_rank_\d+_optim_states"
                           r"|rng_state_rank_\d+)\.pt$")


def plugin_files(engine, shared: Dict[str, Any], options: SaveOptions) -> Dict[str, Any]:
    """This rank's files of the participants that write their own (hook ``dsplug_checkpoint_files``),
    checked: plain file names, none of the engine's, none given twice."""
    files: Dict[str, Any] = {}
    for contribution in engine.events.hook.dsplug_checkpoint_files(engine=engine, shared=shared, options=options):
        if contribution is None:
            continue
        if not isinstance(contribution, dict):
            raise ckpt.CheckpointError(f"a dsplug_checkpoint_files implementation returned "
                                       f"{type(contribution).__name__}; expected a dict {{file name: state}}")
        for name, state in contribution.items():
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") \
                    or name in (ckpt.MANIFEST, ckpt.OWNER) or _ENGINE_FILES.match(name):
                raise ckpt.CheckpointError(f"a dsplug_checkpoint_files implementation named a file {name!r}: a "
                                           "plugin's file needs a plain file name that is not one of the engine's "
                                           "(model / optimizer / rng states, manifest)")
            if name in files:
                raise ckpt.CheckpointError(f"checkpoint file {name!r} is contributed twice on this rank "
                                           f"(implementers: {_implementers(engine, 'dsplug_checkpoint_files')})")
            files[name] = state
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
    save_dir = os.fspath(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    ckpt.check_tag(tag)
    _validate_tag(engine, tag)
    rank0 = engine.global_rank == 0

    def prepare():
        if rank0:
            removed = ckpt.reclaim_leftovers(save_dir)
            if removed:
                log_rank0(f"checkpoint: removed leftovers of crashed saves in {save_dir}: {', '.join(removed)}")
            ckpt.begin(save_dir, tag)

    _on_every_rank("preparing", prepare)
    staging = ckpt.partial_dir(save_dir, tag)
    options = SaveOptions(tag=tag, save_dir=save_dir, exclude_frozen_parameters=exclude_frozen_parameters)
    shared = collect(engine, "model", options)  # every rank: contributions may be collectives
    own = collect(engine, "rank", options)
    extra = plugin_files(engine, shared, options)  # files plugins write themselves (may trim ``shared``)

    dp_rank, mp_rank = engine.context.rank, engine.context.mp_rank
    model_file = ckpt.model_file(mp_rank)

    def write_files():
        files = {}
        if dp_rank == 0:  # one shared file per model-parallel slice (rank 0 without model parallelism)
            client = dict(client_state or {})
            # the client's keys also at the top level, where DeepSpeed keeps them (the same
            # objects: pickled once); a key the checkpoint itself uses stays under client_state only
            top = {k: v for k, v in client.items() if isinstance(k, str) and k not in shared and k not in ENGINE_KEYS}
            files[model_file] = ckpt.atomic_save(
                {**top, **shared, "client_state": client, "world_size": engine.world_size,
                 "mp_world_size": engine.context.mp_world_size, "ds_config": engine.config.to_dict(),
                 "dsplug_version": _version()},
                os.path.join(staging, model_file))
        optim = ckpt.optim_file(dp_rank, mp_rank)
        files[optim] = ckpt.atomic_save({**own, "rank": dp_rank, "world_size": engine.world_size},
                                        os.path.join(staging, optim))
        rng = ckpt.rng_file(engine.global_rank)
        files[rng] = ckpt.atomic_save(ckpt.rng_state(engine.accelerator), os.path.join(staging, rng))
        for name, state in extra.items():
            files[name] = _save_plugin_file(state, os.path.join(staging, name))
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
        ckpt.write_manifest(staging, files, tag=tag, global_steps=engine.global_steps, world_size=engine.world_size,
                            save_latest=bool(save_latest))
        ckpt.commit(save_dir, tag, save_latest)
        keep_last = engine.config.checkpoint.keep_last
        if keep_last:
            removed = ckpt.prune(save_dir, keep_last, keep=(tag, ckpt.read_latest(save_dir) or tag))
            if removed:
                log_rank0(f"checkpoint: keep_last={keep_last}: removed {', '.join(removed)}")

    _on_every_rank("committing", commit)
    return True


def resolve_tag(load_dir, tag=None):
    """The tag directory a load of ``tag`` from ``load_dir`` reads, or None when there is nothing
    to load (warned). ``tag=None``: the newest complete checkpoint (``latest``, or a complete tag
    a crashed save left newer than it), rank 0's answer on every rank (a collective); a missing
    tag directory whose ``<tag>.old`` copy is complete (a save of the same tag died while
    swapping) resolves to that copy. For engine subclasses that load in their own way, so that
    every load resolves tags alike."""
    load_dir = os.fspath(load_dir)
    if tag is None:
        tag, why = _on_every_rank("finding the newest checkpoint", lambda: ckpt.newest_tag(load_dir), gather=True)[0]
        if why:
            log_rank0(f"warning: {why}", logging.WARNING)
        if tag is None:
            log_rank0(f"warning: no 'latest' file in {load_dir}: nothing loaded (pass tag= to load a "
                      "specific checkpoint)", logging.WARNING)
            return None
    return _tag_dir(load_dir, str(tag))


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
        # A tag without a manifest was not written by dsplug (or by an older one): a file it lacks
        # is read as empty, and the parts that know its format read what they need from the
        # directory themselves (checkpoint.path), e.g. the ZeRO stages a DeepSpeed checkpoint.
        foreign = ckpt.read_manifest(path) is None

        def read(file_name: str, reader):
            if foreign and not os.path.isfile(os.path.join(path, file_name)):
                return {}
            return reader()

        shared = read(model_file, lambda: ckpt.load_file(os.path.join(path, model_file), weights_only))
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

    shared, own, rng = _on_every_rank("reading", read_own_files, same_error=True)[engine.global_rank]
    view = CheckpointView(model=shared, rank=own, saved_world_size=int(shared.get("world_size", 1)),
                          read_rank=read_rank, options=options, path=path)
    # plugins complete the view from their own files first (a failure anywhere stops every rank)
    _on_every_rank("reading", lambda: engine.events.hook.dsplug_checkpoint_read(engine=engine, checkpoint=view),
                   same_error=True)
    engine.events.hook.dsplug_load_checkpoint_state(engine=engine, checkpoint=view)
    if rng is not None:
        ckpt.set_rng_state(rng, engine.accelerator)
    return path, shared.get("client_state", {})


def _tag_dir(load_dir: str, tag: str) -> str:
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        # a save of the same tag died between swapping directories: the old copy is complete
        log_rank0(f"warning: {path} is missing but {path}.old is complete; loading that", logging.WARNING)
        return path + ".old"
    if not os.path.isdir(path):
        tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))) \
            if os.path.isdir(load_dir) else []
        raise ckpt.CheckpointError(f"checkpoint {path} does not exist" +
                                   (f"; tags in {load_dir}: {', '.join(tags)}" if tags else ""))
    return path


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


def _validate_tag(engine, tag: str) -> None:
    mode = engine.config.checkpoint.tag_validation
    if mode == "Ignore" or engine.world_size == 1:
        return
    tags = comm.all_gather_object(tag)
    if len(set(tags)) > 1:
        message = f"checkpoint tags differ across ranks: {tags}"
        if mode == "Fail":
            raise ckpt.CheckpointError(message + " (checkpoint.tag_validation is Fail)")
        log_rank0("warning: " + message, logging.WARNING)


def _version() -> str:
    from . import __version__

    return __version__
