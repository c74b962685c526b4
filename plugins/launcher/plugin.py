"""Registers ``dsplug launch``: start a script on one or more nodes, DeepSpeed-launcher style.

Same flags as the ``deepspeed`` launcher for what it supports; processes are started by
``torch.distributed.run`` on each node (over ssh for several nodes).

Entry point: ``launcher = "dsplug.plugins.launcher.plugin"``. Importing this module is cheap;
the planner is imported when the command runs.
"""
from __future__ import annotations

from dsplug.descriptors import ApiModule, CliCommand
from dsplug.hookspecs import hookimpl

from . import cli


@hookimpl
def dsplug_cli_commands():
    return [CliCommand(name="launch", help=cli.HELP, description=cli.DESCRIPTION,
                       add_arguments=cli.add_arguments, run=cli.run)]


@hookimpl
def dsplug_api_modules():
    """DeepSpeed's ``deepspeed.launcher.runner`` functions (:mod:`.runner`), its runner classes
    ``deepspeed.launcher.multinode_runner`` (:mod:`.multinode_runner`), its per-node launcher
    ``deepspeed.launcher.launch`` (:mod:`.launch`) and ``deepspeed.utils.numa``'s core-list parser
    (:mod:`.numa`)."""
    return [ApiModule("dsplug.launcher.runner", "dsplug.plugins.launcher.runner"),
            ApiModule("dsplug.launcher.multinode_runner", "dsplug.plugins.launcher.multinode_runner"),
            ApiModule("dsplug.launcher.launch", "dsplug.plugins.launcher.launch"),
            ApiModule("dsplug.utils.numa", "dsplug.plugins.launcher.numa")]
