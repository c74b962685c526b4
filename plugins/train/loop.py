"""The ``dsplug train`` job: settings, the training loop, checkpoints, the closing report.

One process, or each worker of ``--nproc N`` (``python -m dsplug.plugins.train``, started by the
launcher with RANK / WORLD_SIZE / LOCAL_RANK set), runs :func:`train`. The parent of an
``--nproc`` run resolves the output directory and checks the config first, so a bad config
fails once, before any worker starts.

Step numbers are optimizer steps (``engine.global_steps``); ``--steps S`` trains until step S.
A checkpoint records the model's shape, the vocabulary and S in ``client_state``, so
``--resume`` rebuilds the same model, continues the step counter and the LR schedule, and
replays the data order from the step it stopped at (:func:`dsplug.plugins.train.data.batches_from`).

Ctrl-C (:mod:`.interrupt`) stops the run after the current step, on every rank at the same step,
saves a checkpoint there and prints the ``dsplug train ... --resume`` line that continues it; the
exit status is then 130. A second Ctrl-C quits at once, without that checkpoint.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .interrupt import EXIT_INTERRUPTED, Interrupt
from .options import DEFAULT_STEPS, MODEL_OPTIONS, RUNS_DIR, resolve_config_option, resume_command, worker_argv

CHECKPOINT_SUBDIR = "checkpoints"
CLIENT_KEY = "dsplug_train"
SAMPLE_PROMPT = "The "


class TrainError(Exception):
    """A problem with the command line or the run's directory, reported without a traceback."""


@dataclass
class TrainJobSettings:
    output_dir: str
    steps: int
    model: Dict[str, int]  # seq_len, d_model, n_layers, n_heads
    text: Optional[str]
    vocab: Optional[str]  # from the checkpoint on --resume
    resume_tag: Optional[str]


# ------------------------------------------------------------------------------ entry points
def main(args) -> int:
    """``dsplug train`` and ``python -m dsplug.plugins.train``; returns the exit status."""
    started = time.perf_counter()
    worker = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if worker else args.nproc
    rank = int(os.environ.get("RANK", "0")) if worker else 0
    try:
        try:
            resolve_config_option(args)
        except ValueError as exc:
            raise TrainError(str(exc)) from None
        if rank == 0:  # the first of the multi-second steps before training (reading a saved run imports it)
            print("dsplug train: loading torch ...", flush=True)
        settings = resolve_settings(args, launched_worker=worker and world_size > 1)
        raw, where, notes = checked_config(args.config, settings, args.seed, world_size)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except TrainError as exc:
        if rank == 0:
            print(f"dsplug train: error: {exc}", file=sys.stderr)
        return 2
    except ConfigProblem as exc:
        if rank == 0:
            print(str(exc), file=sys.stderr)
        return 1
    if not worker and args.nproc > 1:
        from .launch import launch_workers

        return launch_workers(args.nproc, worker_argv(args, settings.output_dir, settings.steps), args.master_port,
                              args.threads)
    try:
        return train(settings, raw, where, notes, args, started)
    except TrainError as exc:
        if rank == 0:
            print(f"dsplug train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (or one before training started)
        if rank == 0:
            print("\ndsplug train: stopped by Ctrl-C; no checkpoint was saved for the step in progress",
                  file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


# ------------------------------------------------------------------------------ settings
def default_output_dir(base: str = RUNS_DIR, now: Optional[datetime.datetime] = None) -> str:
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    path = os.path.abspath(os.path.join(base, f"run-{stamp}"))
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def newest_resumable_run(base: str = RUNS_DIR) -> Optional[str]:
    """The run directory under ``base`` whose latest checkpoint was written last."""
    from dsplug.checkpoint import LATEST

    if not os.path.isdir(base):
        return None
    found = []
    for name in os.listdir(base):
        latest = os.path.join(base, name, CHECKPOINT_SUBDIR, LATEST)
        if os.path.isfile(latest):
            found.append((os.path.getmtime(latest), name))
    return os.path.abspath(os.path.join(base, max(found)[1])) if found else None


def read_saved_run(checkpoint_dir: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``(tag, what the job stored in client_state)`` of the latest checkpoint, or None."""
    from dsplug import checkpoint as ckpt

    tag = ckpt.read_latest(checkpoint_dir) if os.path.isdir(checkpoint_dir) else None
    if tag is None:
        return None
    path = os.path.join(checkpoint_dir, tag, ckpt.MODEL_FILE)
    if not os.path.isfile(path):
        raise TrainError(f"{checkpoint_dir}/latest names {tag!r} but {path} does not exist")
    state = ckpt.load_file(path, True)
    stored = (state.get("client_state") or {}).get(CLIENT_KEY)
    if not isinstance(stored, dict):
        raise TrainError(f"the checkpoint {os.path.join(checkpoint_dir, tag)} was not written by `dsplug train` "
                         f"(its client_state has no {CLIENT_KEY!r} entry), so it cannot be resumed by it")
    return tag, stored


def resolve_settings(args, launched_worker: bool = False) -> TrainJobSettings:
    if args.output_dir is not None:
        output_dir = os.path.abspath(args.output_dir)
    elif launched_worker:
        raise TrainError("workers of a multi-process run need an explicit --output-dir (every rank must use the "
                         "same one); `dsplug train --nproc N` passes it for you")
    elif args.resume:
        output_dir = newest_resumable_run()
        if output_dir is None:
            raise TrainError(f"--resume: no run with a checkpoint under ./{RUNS_DIR}; give --output-dir DIR "
                             f"of the run to continue")
    else:
        output_dir = default_output_dir()
    checkpoint_dir = os.path.join(output_dir, CHECKPOINT_SUBDIR)
    saved = read_saved_run(checkpoint_dir)
    if args.resume and saved is None:
        raise TrainError(f"--resume: no checkpoint in {checkpoint_dir} (no 'latest' file); nothing to resume")
    if not args.resume and saved is not None:
        raise TrainError(f"{output_dir} already holds a run (latest checkpoint: {saved[0]}); pass --resume to "
                         f"continue it, or choose another --output-dir")
    model: Dict[str, int] = {}
    stored = saved[1] if saved else {}
    for flag, dest, default, _text in MODEL_OPTIONS:
        given = getattr(args, dest)
        if saved is not None:
            previous = stored["model"][dest]
            if given is not None and given != previous:
                raise TrainError(f"{flag} {given} differs from the checkpoint's {previous} ({saved[0]}); "
                                 f"a resumed run keeps its model (leave {flag} out)")
            model[dest] = previous
        else:
            model[dest] = given if given is not None else default
    text = args.text
    if saved is not None and text is None:
        text = stored.get("text_path")
    steps = args.steps or (int(stored["steps"]) if saved else DEFAULT_STEPS)
    return TrainJobSettings(output_dir=output_dir, steps=steps, model=model, text=text,
                    vocab=stored.get("vocab") if saved else None, resume_tag=saved[0] if saved else None)


class ConfigProblem(Exception):
    """The config cannot be used; ``str()`` is the whole listing to print."""


def checked_config(path: Optional[str], settings: TrainJobSettings, seed: Optional[int],
                   world_size: int) -> Tuple[Dict[str, Any], str, List[str]]:
    """The job's config dict, validated against ``world_size`` (every error listed)."""
    from dsplug.config import ConfigError, DsplugConfig

    from .job_config import format_config_error, prepare_config

    where = path or "built-in config"
    try:
        raw, where, notes = prepare_config(path, steps=settings.steps, output_dir=settings.output_dir, seed=seed)
        DsplugConfig(raw, world_size=world_size, strict_auto=True)
        if not isinstance(raw.get("optimizer"), dict):
            raise ConfigProblem(f"{where}: `dsplug train` needs an 'optimizer' section, e.g. "
                                f"\"optimizer\": {{\"type\": \"AdamW\", \"params\": {{\"lr\": 0.006}}}}")
    except ConfigError as exc:
        raise ConfigProblem(format_config_error(exc, where)) from None
    except (OSError, TypeError) as exc:
        raise ConfigProblem(f"{where}: {exc}") from None
    return raw, where, notes


# ------------------------------------------------------------------------------ training
def train(settings: TrainJobSettings, raw_config: Dict[str, Any], where: str, notes: List[str], args,
          started: float) -> int:
    rank = int(os.environ.get("RANK", "0"))
    say = _printer(rank)
    interrupt = Interrupt(announce=rank == 0).install()
    try:
        return _train(settings, raw_config, where, notes, args, started, rank, say, interrupt)
    finally:
        interrupt.uninstall()


def _train(settings: TrainJobSettings, raw_config: Dict[str, Any], where: str, notes: List[str], args, started: float,
           rank: int, say, interrupt: Interrupt) -> int:
    import torch  # imported already: main() said so

    import dsplug
    from dsplug import comm

    from .data import CharVocab, CharWindows, batches_from, held_out_loss, read_text, split_tokens
    from .model import CharTransformer, ModelConfig, generate_greedy, next_token_loss
    from .progress import ProgressBar

    _set_threads(args.threads)
    for note in notes:
        say(f"note: {note}")
    try:
        text, text_name = read_text(settings.text)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    vocab = CharVocab(settings.vocab) if settings.vocab else CharVocab.of_text(text)
    try:
        tokens = torch.tensor(vocab.encode(text), dtype=torch.long)
        model_config = ModelConfig(vocab_size=len(vocab), **settings.model)
        train_tokens, held_tokens = split_tokens(tokens, model_config.seq_len)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    dataset = CharWindows(train_tokens, model_config.seq_len)

    seed = raw_config.get("seed")
    torch.manual_seed(seed if seed is not None else 0)
    model = CharTransformer(model_config)
    # seconds: torch's first optimizer imports torch._dynamo
    say("dsplug train: building the engine (dsplug.initialize) ...")
    engine, _, loader, _ = dsplug.initialize(model=model, training_data=dataset, config=raw_config)
    if engine.random_ltd_enabled():  # data_efficiency.data_routing.random_ltd: token dropping in the blocks
        _convert_blocks_to_random_ltd(engine)
    checkpoint_dir = os.path.join(settings.output_dir, CHECKPOINT_SUBDIR)
    loaded = None
    if settings.resume_tag is not None:
        loaded, _client = engine.load_checkpoint(checkpoint_dir)
    first_step = engine.global_steps + 1
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    tokens_per_step = engine.train_batch_size() * model_config.seq_len
    if rank == 0:
        os.makedirs(settings.output_dir, exist_ok=True)
        with open(os.path.join(settings.output_dir, "ds_config.json"), "w", encoding="utf-8") as f:
            json.dump(engine.config.to_dict(), f, indent=2, default=str)
    say(f"dsplug train: {model.num_parameters() / 1e6:.2f}M-parameter character transformer "
        f"({model_config.n_layers} layers, d_model {model_config.d_model}, {model_config.n_heads} heads, "
        f"context {model_config.seq_len}), vocabulary {len(vocab)}, {len(text) / 1000:.0f} KB of text ({text_name})")
    say(f"  config: {where}; {engine.world_size} process{'es' if engine.world_size > 1 else ''}, "
        f"{micro} sequences x {gas} accumulation x {engine.world_size} = {engine.train_batch_size()} per step; "
        f"output: {settings.output_dir}")
    if loaded is not None:
        say(f"  resumed from {loaded} at step {engine.global_steps}")
    if first_step > settings.steps:
        say(f"  the run is already at step {engine.global_steps} (>= --steps {settings.steps}); nothing to train")
    else:
        say(f"  training steps {first_step}..{settings.steps}")

    # the micro-batches this rank consumed before, counted in today's world: the data order
    # continues exactly when the world size is unchanged
    consumed = engine.global_samples // (micro * engine.world_size)
    batches = batches_from(loader, consumed)
    losses: List[Tuple[int, float]] = []
    last_saved = engine.global_steps if settings.resume_tag is not None else None
    client_state = {CLIENT_KEY: {"model": {k: v for k, v in model_config.to_dict().items() if k != "vocab_size"},
                                 "vocab": vocab.chars, "steps": settings.steps,
                                 "text_path": os.path.abspath(settings.text) if settings.text else None}}
    bar = ProgressBar(first_step, settings.steps, tokens_per_step, every=engine.steps_per_print()) \
        if rank == 0 and first_step <= settings.steps else None
    loop_start = time.perf_counter()
    try:
        stopped = interrupt.agreed(engine)  # a Ctrl-C while the engine was being built
        engine.train()
        while not stopped and engine.global_steps < settings.steps:
            step_loss = 0.0
            for _ in range(gas):
                x, y = next(batches)
                x, y = x.to(engine.device), y.to(engine.device)
                logits = engine(x)  # fewer positions under curriculum_learning's curriculum_seqlen
                loss = next_token_loss(logits, y[:, :logits.shape[1]])
                engine.backward(loss)
                engine.step()
                step_loss += float(loss.detach()) / gas
            losses.append((engine.global_steps, step_loss))
            if bar is not None:
                bar.update(engine.global_steps, step_loss, engine.get_lr()[0],
                           engine.precision.step_metrics().get("loss_scale"))
            if engine.global_steps % args.save_interval == 0:
                if bar is not None:
                    bar.clear_line()
                engine.save_checkpoint(checkpoint_dir, client_state=client_state)
                last_saved = engine.global_steps
            stopped = interrupt.agreed(engine)  # every rank stops after the same step
    except BaseException:
        _close_quietly(engine)  # keep what the monitors logged so far
        raise
    finally:
        if bar is not None:
            bar.close()
    loop_seconds = time.perf_counter() - loop_start
    if stopped and rank == 0 and last_saved != engine.global_steps:
        print(f"dsplug train: interrupted: saving a checkpoint at step {engine.global_steps}", file=sys.stderr,
              flush=True)
    if last_saved != engine.global_steps:
        engine.save_checkpoint(checkpoint_dir, client_state=client_state)
    # a Ctrl-C during the last step or the final save: stop here too (no held-out loss, no sample)
    stopped = stopped or interrupt.agreed(engine)
    interrupt.uninstall()  # from here on Ctrl-C quits at once: the checkpoint is written
    if stopped:
        engine.destroy()
        if rank == 0:
            _report_interrupted(settings, engine, args, checkpoint_dir, len(losses), loop_seconds)
        comm.destroy_process_group()
        return EXIT_INTERRUPTED
    monitor_dirs = [(o.section, o.log_dir) for o in engine.observers if getattr(o, "log_dir", None)]
    full_weights = not engine.stage.traits.partitions_parameters  # stage 3 keeps only a slice on each rank
    engine.destroy()  # closes (flushes) the monitors' files
    if rank == 0:
        held, sample = None, None
        if full_weights:
            held = held_out_loss(engine.module, held_tokens, model_config.seq_len, micro)
        else:
            say("note: ZeRO stage 3 partitions the weights, so the held-out loss and the sample are skipped")
        if args.sample_chars and full_weights:
            prompt = SAMPLE_PROMPT if all(c in vocab.chars for c in SAMPLE_PROMPT) else text[:4]
            sample = (prompt, vocab.decode(generate_greedy(engine.module, vocab.encode(prompt), args.sample_chars)))
        _report(say, settings, engine, losses, held, sample, checkpoint_dir, monitor_dirs, tokens_per_step,
                loop_seconds, time.perf_counter() - started)
    comm.destroy_process_group()
    return 0


def _report(say, settings, engine, losses, held, sample, checkpoint_dir, monitor_dirs, tokens_per_step,
            loop_seconds, total_seconds) -> None:
    from dsplug import checkpoint as ckpt

    trained = len(losses)
    rate = trained * tokens_per_step / loop_seconds if loop_seconds > 0 else 0.0
    say("")
    say(f"done: {trained} step{'s' if trained != 1 else ''} in {loop_seconds:.1f} s "
        f"({rate:,.0f} tokens/s); wall time {total_seconds:.1f} s")
    if losses:
        (s0, l0), (s1, l1) = losses[0], losses[-1]
        tail = [l for _, l in losses[-10:]]
        say(f"loss: {l0:.4f} at step {s0} -> {l1:.4f} at step {s1} (mean of the last {len(tail)}: "
            f"{sum(tail) / len(tail):.4f})" + (f"; held-out loss {held:.4f}" if held is not None else ""))
    elif held is not None:
        say(f"held-out loss {held:.4f}")
    say(f"checkpoints: {checkpoint_dir} (latest: {ckpt.read_latest(checkpoint_dir)})")
    for section, log_dir in monitor_dirs:
        say(f"{section}: {log_dir}")
    say(f"config: {os.path.join(settings.output_dir, 'ds_config.json')}")
    if sample is not None:
        prompt, text = sample
        say(f"sample (greedy, {len(text) - len(prompt)} characters after {prompt!r}):")
        say(text)
    say(f"continue this run with: dsplug train --resume --output-dir {settings.output_dir} --steps N")


def _report_interrupted(settings, engine, args, checkpoint_dir, trained, loop_seconds) -> None:
    from dsplug import checkpoint as ckpt

    step = engine.global_steps
    tag = ckpt.read_latest(checkpoint_dir)
    command = resume_command(args, settings.output_dir, settings.steps, engine.world_size)
    plural = "s" if trained != 1 else ""
    lines = [f"dsplug train: interrupted at step {step} of {settings.steps} ({trained} step{plural} trained in "
             f"{loop_seconds:.1f} s); checkpoint: {os.path.join(checkpoint_dir, tag or '?')}"]
    lines += ["resume this run with:", f"  {command}"]
    if step >= settings.steps:
        lines.append(f"(it had reached its last step, {settings.steps}: give a larger --steps to train further)")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _convert_blocks_to_random_ltd(engine) -> None:
    """Wrap the built-in model's blocks with random-LTD (DeepSpeed's ``convert_to_random_ltd``, as
    the method the data efficiency plugin gives the engine, which also configures them). The blocks
    take ``[batch, seq, d_model]``; with ``hidden_state_order: seq_batch_dim`` (Megatron GPT's
    order, as in DeepSpeed's example) each wrapper is shown ``[seq, batch, d_model]`` and its block
    still gets ``[batch, seq, d_model]``."""
    from .model import Block

    if engine.random_ltd_config().get("hidden_state_order") != "seq_batch_dim":
        engine.convert_to_random_ltd(Block)
        return
    swap = _swap_batch_seq_class()
    blocks = engine.module.blocks
    for i, block in enumerate(blocks):
        blocks[i] = swap(block)
    engine.convert_to_random_ltd(swap)  # wraps exactly those (in module order)
    for i, wrapped in enumerate(blocks):
        blocks[i] = swap(wrapped)


@functools.lru_cache(maxsize=None)
def _swap_batch_seq_class():
    from torch import nn

    class SwapBatchSeq(nn.Module):
        """Runs ``layer`` with the first two dims of the hidden states swapped (and swaps back)."""

        def __init__(self, layer: nn.Module):
            super().__init__()
            self.layer = layer

        def forward(self, x, *args, **kwargs):
            return self.layer(x.transpose(0, 1), *args, **kwargs).transpose(0, 1)

    return SwapBatchSeq


def _close_quietly(engine) -> None:
    try:
        engine.destroy()
    except Exception:  # noqa: BLE001 - the original error is the one to report
        pass


def _set_threads(threads: Optional[int]) -> None:
    """``--threads``, else one thread per process on CPU unless OMP_NUM_THREADS says otherwise.

    The model is small: its matrix products gain little from a second thread, while a thread
    team that shares its cores with other processes loses a lot (on a busy 2-core machine one
    step of the default model took 0.37 s with 1 thread and 2.8 s with 2).
    """
    import torch

    from dsplug.accelerator import get_accelerator

    if threads is not None:
        torch.set_num_threads(threads)
    elif get_accelerator().name == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _printer(rank: int):
    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)
    return say
