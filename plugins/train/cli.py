"""The ``dsplug train`` command: its arguments and what it runs (registered by :mod:`.plugin`)."""
from __future__ import annotations

import argparse

HELP = "train a small built-in transformer language model (checkpoints, monitors, --resume, --nproc)"
DESCRIPTION = ("Train a small character-level transformer language model on the built-in corpus "
               "with a DeepSpeed-format config.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import EPILOG, add_arguments as add_train_arguments

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_train_arguments(parser)


def run(args) -> int:
    from .loop import main

    return main(args)
