"""Registers ``dsplug train``: the built-in language-model job as a command of the ``dsplug`` CLI.

Entry point: ``train = "dsplug.plugins.train.plugin"``. Importing this module is cheap (argparse
only); the job (torch, the engine) is imported when the command runs.
"""
from __future__ import annotations

from dsplug.descriptors import CliCommand
from dsplug.hookspecs import hookimpl

from . import cli


@hookimpl
def dsplug_cli_commands():
    return [CliCommand(name="train", help=cli.HELP, description=cli.DESCRIPTION,
                       add_arguments=cli.add_arguments, run=cli.run)]
