"""Command-line options of ``dsplug train`` (also parsed by ``python -m dsplug.plugins.train`` workers)."""
from __future__ import annotations

import argparse
import os
import shlex
from typing import List

from dsplug.cli.argtypes import positive_int, non_negative_int

DEFAULT_STEPS = 400
DEFAULT_SAVE_INTERVAL = 100
DEFAULT_SAMPLE_CHARS = 100
RUNS_DIR = "dsplug_runs"

#: model options: (flag, dest, default); None in the parsed args means "not given"
MODEL_OPTIONS = (
    ("--seq-len", "seq_len", 64, "characters of context (window length)"),
    ("--d-model", "d_model", 128, "width of the transformer"),
    ("--layers", "n_layers", 2, "transformer blocks"),
    ("--heads", "n_heads", 4, "attention heads (must divide --d-model)"),
)

EPILOG = f"""\
what it does:
  trains a small character-level transformer language model on a ~48 KB corpus shipped with
  dsplug, through dsplug.initialize and a DeepSpeed-format config (default: the built-in
  AdamW + WarmupCosineLR config with gradient clipping and CSV / TensorBoard monitors).
  Output, all under --output-dir (default ./{RUNS_DIR}/run-<date>-<time>):
    checkpoints/     engine.save_checkpoint every --save-interval steps and at the end
    csv_monitor/     CSV monitor files (the loss, lr, ... per step)
    tensorboard/     TensorBoard event files
    ds_config.json   the config the engine ran with
  In a config you give, an empty or relative monitor output_path is taken inside --output-dir,
  and scheduler.params.total_num_steps / warmup_num_steps may be "auto" (filled from --steps).
  Ctrl-C finishes the current step, saves a checkpoint there (every process at the same step)
  and prints the `dsplug train ... --resume` command that continues the run (exit status 130);
  a second Ctrl-C quits at once, without that checkpoint.

examples:
  dsplug train                                  default run (~{DEFAULT_STEPS} steps, about a minute on 2 CPU cores)
  dsplug train --resume                         continue the newest run in ./{RUNS_DIR}
  dsplug train --resume --steps 400             ... and extend it to step 400
  dsplug train --nproc 2                        2 processes (gloo on CPU), data sharded by rank
  dsplug train my_ds_config.json --output-dir runs/a --steps 500 --d-model 256 --layers 6
  dsplug train --config my_ds_config.json       the same config option, DeepSpeed-style
  A config with curriculum_learning (curriculum_type "seqlen") or progressive_layer_drop trains
  the built-in model with them: it takes curriculum_seqlen (shorter sequences) and pld_theta.
"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                        help="DeepSpeed-format JSON config (default: the built-in default_config.json)")
    parser.add_argument("--config", dest="config_file", default=None, metavar="FILE",
                        help="the same as CONFIG, DeepSpeed-style (giving both is an error unless they name "
                             "the same file)")
    parser.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                        help="train on N processes on this machine, started through the dsplug launcher")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="S",
                        help=f"train until optimizer step S (default {DEFAULT_STEPS}; with --resume: the resumed "
                             f"run's own, so an interrupted run finishes where it meant to)")
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help=f"where checkpoints and monitor logs go (default ./{RUNS_DIR}/run-<date>-<time>; "
                             f"with --resume: the newest run in ./{RUNS_DIR})")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in the output directory")
    parser.add_argument("--seed", type=int, default=None, metavar="K",
                        help="seed of the model's initial weights and of the data order (overrides the config's seed)")
    parser.add_argument("--save-interval", type=positive_int, default=DEFAULT_SAVE_INTERVAL, metavar="N",
                        help=f"save a checkpoint every N steps (and always at the end; default {DEFAULT_SAVE_INTERVAL})")
    model = parser.add_argument_group("model (on --resume: taken from the checkpoint)")
    for flag, dest, default, text in MODEL_OPTIONS:
        model.add_argument(flag, dest=dest, type=positive_int, default=None, metavar="N",
                           help=f"{text} (default {default})")
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="CPU threads per process for torch's operators (default: 1 on CPU, unless "
                             "OMP_NUM_THREADS is set: the model is small, so more threads gain little, and "
                             "they lose a lot when other work shares the cores)")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="train on this UTF-8 text file instead of the built-in corpus")
    parser.add_argument("--sample-chars", type=non_negative_int, default=DEFAULT_SAMPLE_CHARS, metavar="N",
                        help=f"characters of greedy sample printed at the end (0: none; default {DEFAULT_SAMPLE_CHARS})")
    parser.add_argument("--master-port", type=positive_int, default=None, metavar="PORT",
                        help="rendezvous port with --nproc (default: a free port)")
    # the launcher's shim hands each worker --local_rank=<n>; the rank is read from the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def resolve_config_option(args: argparse.Namespace) -> None:
    """Merge ``--config FILE`` into ``args.config`` (the positional CONFIG). Raises ValueError
    when both are given and name different files."""
    option = getattr(args, "config_file", None)
    if option is None:
        return
    if args.config is not None and os.path.abspath(args.config) != os.path.abspath(option):
        raise ValueError(f"the config is given twice, as CONFIG {args.config!r} and --config {option!r}; "
                         f"give one of them")
    args.config = option
    args.config_file = None


def worker_argv(args: argparse.Namespace, output_dir: str, steps: int) -> List[str]:
    """The options each launched worker gets: the parent's, with the output directory and steps
    resolved (every worker must agree on them) and without ``--nproc``."""
    argv = [] if args.config is None else [args.config]
    argv += ["--output-dir", output_dir, "--steps", str(steps), "--save-interval", str(args.save_interval),
             "--sample-chars", str(args.sample_chars)]
    if args.resume:
        argv.append("--resume")
    if args.seed is not None:
        argv += ["--seed", str(args.seed)]
    for flag, dest, _default, _text in MODEL_OPTIONS:
        if getattr(args, dest) is not None:
            argv += [flag, str(getattr(args, dest))]
    if args.text is not None:
        argv += ["--text", args.text]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if args.master_port is not None:  # unused by a worker; kept so it can print the resume command
        argv += ["--master-port", str(args.master_port)]
    return argv


def resume_command(args: argparse.Namespace, output_dir: str, steps: int, nproc: int) -> str:
    """The ``dsplug train ... --resume`` line (shell-quoted) that continues this run with the same
    options: the run's own output directory and step target, paths made absolute (so the line
    works from any directory), ``--nproc`` as run."""
    words = ["dsplug", "train"]
    if args.config is not None:
        words.append(os.path.abspath(args.config))
    if nproc > 1:
        words += ["--nproc", str(nproc)]
    words += ["--output-dir", output_dir, "--steps", str(steps)]
    if args.save_interval != DEFAULT_SAVE_INTERVAL:
        words += ["--save-interval", str(args.save_interval)]
    if args.seed is not None:
        words += ["--seed", str(args.seed)]
    for flag, dest, _default, _text in MODEL_OPTIONS:
        if getattr(args, dest) is not None:
            words += [flag, str(getattr(args, dest))]
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    if args.text is not None:
        words += ["--text", os.path.abspath(args.text)]
    if args.sample_chars != DEFAULT_SAMPLE_CHARS:
        words += ["--sample-chars", str(args.sample_chars)]
    if args.master_port is not None and nproc > 1:
        words += ["--master-port", str(args.master_port)]
    words.append("--resume")
    return shlex.join(words)
