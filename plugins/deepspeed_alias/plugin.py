"""Registers ``dsplug deepspeed-alias enable | disable | status`` (entry point ``deepspeed-alias``).

Acts on the environment of the running interpreter (``sysconfig`` purelib and scripts dirs).
Cheap to import; the work is in :mod:`.install`.
"""
from __future__ import annotations

from dsplug.descriptors import CliCommand
from dsplug.hookspecs import hookimpl

from . import cli


@hookimpl
def dsplug_cli_commands():
    return [CliCommand(name="deepspeed-alias", help=cli.HELP, description=cli.DESCRIPTION,
                       add_arguments=cli.add_arguments, run=cli.run)]
