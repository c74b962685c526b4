"""Registers ``dsplug train``: the built-in language-model job as a command of the ``dsplug`` CLI.

Entry point: ``train = "dsplug.plugins.train.plugin"``. Importing this module is cheap (argparse
only); the job (torch, the engine) is imported when the command runs.
"""
from __future__ import annotations

import argparse

from dsplug.descriptors import CliCommand
from dsplug.hookspecs import hookimpl

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


COMMAND = CliCommand(name="train", help=HELP, description=DESCRIPTION, add_arguments=add_arguments, run=run)


@hookimpl
def dsplug_cli_commands():
    return [COMMAND]
