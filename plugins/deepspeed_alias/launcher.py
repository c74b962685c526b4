"""The ``deepspeed`` command the alias installs: ``dsplug launch`` under DeepSpeed's name.

``deepspeed [launcher args] script.py [script args]`` parses the same arguments and runs the same
function as ``dsplug launch``: the ``launch`` command is looked up in the registry (so
``DSPLUG_BLOCK_PLUGINS`` and a replacement launcher plugin apply exactly as for ``dsplug launch``)
and its ``add_arguments`` / ``run`` are called with ``deepspeed`` as the program name.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

COMMAND = "launch"


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
