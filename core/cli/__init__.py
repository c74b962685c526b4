"""The ``dsplug`` command line.

The kernel's own commands (``list``, ``config``, ``report``, ``build-ops``, ``checkpoint``) are the modules named
in :data:`KERNEL_COMMANDS`; each defines ``add_parser(subparsers)``, which adds its parser and
sets ``func`` (``args -> exit code``). Every other command comes from a plugin through the
``dsplug_cli_commands`` hook (:class:`dsplug.descriptors.CliCommand`). Commands import heavy
things (torch) when they run, so ``dsplug --help`` stays instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: the kernel's commands, by module under dsplug.cli
KERNEL_COMMANDS = ("cmd_list", "cmd_config", "cmd_report", "cmd_build_ops", "cmd_checkpoint")


class Parser(argparse.ArgumentParser):
    """argparse with a did-you-mean for a mistyped command (``dsplug trian``, ``dsplug config chek``)."""

    def _check_value(self, action, value):
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            from dsplug.registry import suggest

            guess = suggest(value, action.choices)
            hint = f"; did you mean {guess!r}?" if guess else ""
            raise argparse.ArgumentError(action, f"unknown command {value!r}{hint} (commands: "
                                                 f"{', '.join(sorted(action.choices))})")
        super()._check_value(action, value)


def build_parser(registry=None) -> argparse.ArgumentParser:
    parser = Parser(prog="dsplug", description="DeepSpeed-compatible training engine with plugins")
    from dsplug import __version__

    parser.add_argument("--version", action="version", version=f"dsplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    taken = set()
    for module in KERNEL_COMMANDS:
        importlib.import_module(f"{__name__}.{module}").add_parser(sub)
    taken.update(sub.choices)
    if registry is None:
        from dsplug.registry import get_registry

        registry = get_registry()
    for command, origin in sorted(registry.cli_commands(), key=lambda c: c[0].name):
        if command.name in taken:
            registry._broken(origin[2], origin[0], ValueError(f"'dsplug {command.name}' is a kernel command"))
            continue
        p = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # no need to discover the plugins
        from dsplug import __version__

        print(f"dsplug {__version__}")
        return 0
    try:
        parser = build_parser()  # loads the plugins: a Ctrl-C there ends the command like one later
        args = parser.parse_args(argv)
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
