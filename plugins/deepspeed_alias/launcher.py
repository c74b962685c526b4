"""The commands the alias installs: DeepSpeed's console scripts that are a dsplug command.

``deepspeed [launcher args] script.py [script args]`` parses the same arguments and runs the same
function as ``dsplug launch``: the ``launch`` command is looked up in the registry (so
``DSPLUG_BLOCK_PLUGINS`` and a replacement launcher plugin apply exactly as for ``dsplug launch``)
and its ``add_arguments`` / ``run`` are called with ``deepspeed`` as the program name.

The others (:data:`COMMAND_SCRIPTS`: ``ds_report``, ``ds_nvme_tune``, ``ds_elastic`` ...) run their
dsplug command through :func:`run_command`, with the script's name as the program name.
DeepSpeed's ``ds_ssh``, ``ds_bench`` and ``ds_io`` have no dsplug command and are not installed.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

COMMAND = "launch"

#: DeepSpeed's console scripts -> the dsplug command each one is
COMMAND_SCRIPTS = {
    "deepspeed": "launch",
    "deepspeed.pt": "launch",
    "ds": "launch",
    "ds_report": "report",
    "dsr": "report",
    "ds_nvme_tune": "nvme-tune",
    "ds_elastic": "elastic",
}


def build_parser(registry=None) -> Optional[tuple]:
    """``(parser, command)`` for the ``launch`` command, or None when no plugin provides it."""
    if registry is None:
        from dsplug.registry import get_registry

        registry = get_registry()
    for command, _origin in registry.cli_commands():
        if command.name == COMMAND:
            parser = argparse.ArgumentParser(prog="deepspeed", description=command.description or command.help)
            command.add_arguments(parser)
            return parser, command
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    built = build_parser()
    if built is None:
        print("deepspeed: no plugin provides 'dsplug launch' (the launcher plugin is not installed, or blocked by "
              "DSPLUG_BLOCK_PLUGINS); 'dsplug list' shows why", file=sys.stderr)
        return 2
    parser, command = built
    args = parser.parse_args(argv)
    try:
        return int(command.run(args) or 0)
    except KeyboardInterrupt:
        return 130


def ds_report() -> int:
    """``ds_report`` / ``dsr``: ``dsplug report``."""
    return run_command("ds_report")


def ds_nvme_tune() -> int:
    """``ds_nvme_tune``: ``dsplug nvme-tune``."""
    return run_command("ds_nvme_tune")


def ds_elastic() -> int:
    """``ds_elastic``: ``dsplug elastic``."""
    return run_command("ds_elastic")


#: the console-script entry point of each script (``entry_points.txt``; ``pip uninstall`` reads it)
ENTRY_POINTS = {"deepspeed": "main", "deepspeed.pt": "main", "ds": "main", "ds_report": "ds_report",
                "dsr": "ds_report", "ds_nvme_tune": "ds_nvme_tune", "ds_elastic": "ds_elastic"}


def run_command(script: str, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``dsplug <COMMAND_SCRIPTS[script]> argv`` with ``script`` as the program name."""
    if script == "deepspeed":
        return main(argv)
    command = COMMAND_SCRIPTS[script]
    from dsplug.cli import build_parser as dsplug_parser

    commands = next(a for a in dsplug_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    if command not in commands:
        print(f"{script}: no plugin provides 'dsplug {command}' (not installed, or blocked by DSPLUG_BLOCK_PLUGINS); "
              "'dsplug list' shows why", file=sys.stderr)
        return 2
    parser = commands[command]
    parser.prog = script
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
