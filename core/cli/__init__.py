"""The ``dsplug`` command line.

Every ``dsplug/cli/cmd_<name>.py`` module is a subcommand: it defines ``add_parser(subparsers)``
which adds its parser and sets ``func`` (``args -> exit code``) as a default. Subcommand
modules import heavy things (torch) inside ``func``, so ``dsplug --help`` stays instant.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsplug", description="DeepSpeed-compatible training engine with plugins")
    from dsplug import __version__

    parser.add_argument("--version", action="version", version=f"dsplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    package = importlib.import_module(__name__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"{__name__}.{info.name}").add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
