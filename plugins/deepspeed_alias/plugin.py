"""Registers ``dsplug deepspeed-alias enable | disable | status`` (entry point ``deepspeed-alias``).

Acts on the environment of the running interpreter (``sysconfig`` purelib and scripts dirs).
Cheap to import; the work is in :mod:`.install`.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, CliCommand
from dsplug.hookspecs import hookimpl

from . import cli


@hookimpl
def dsplug_cli_commands():
    return [CliCommand(name="deepspeed-alias", help=cli.HELP, description=cli.DESCRIPTION,
                       add_arguments=cli.add_arguments, run=cli.run)]


@hookimpl
def dsplug_api_modules():
    """DeepSpeed's ``deepspeed.git_version_info`` (:mod:`.git_version_info`)."""
    return [ApiModule("dsplug.git_version_info", "dsplug.plugins.deepspeed_alias.git_version_info")]
