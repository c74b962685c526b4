"""Registers ``dsplug deepspeed-alias enable | disable | status`` (entry point ``deepspeed-alias``).

Acts on the environment of the running interpreter (``sysconfig`` purelib and scripts dirs).
Cheap to import; the work is in :mod:`.install`.
"""
from __future__ import annotations

import argparse
import json
import sys

from dsplug.descriptors import ApiModule, CliCommand
from dsplug.hookspecs import hookimpl

HELP = "serve the 'deepspeed' name (import, metadata, launcher command) from dsplug in this environment (opt-in)"
DESCRIPTION = """\
Opt-in: make 'import deepspeed' (and every deepspeed.X) resolve to dsplug's own modules, report a
'deepspeed' distribution (version <DeepSpeed API>+dsplug.<dsplug version>) to importlib.metadata
and requirement checks such as transformers' / accelerate's 'deepspeed>=0.9.3', and install a
'deepspeed' command that is 'dsplug launch'. Acts on this interpreter's environment
(site-packages and scripts dir). Refuses where a real DeepSpeed is installed.

  enable   write the alias (idempotent; also updates one written by another dsplug version)
  disable  remove exactly what enable wrote (so does 'pip uninstall deepspeed')
  status   enabled or not, its files, the version it reports, whether a real DeepSpeed is present
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("action", choices=("enable", "disable", "status"))
    p.add_argument("--json", action="store_true", help="status: print a JSON object")
    # write into a plain directory (pip install --target style) instead of this environment; tests use it
    p.add_argument("--target", default=None, metavar="DIR", help=argparse.SUPPRESS)


def run(args) -> int:
    from .install import AliasError, current_target, directory_target, disable, enable, format_status, status

    target = directory_target(args.target) if args.target else current_target()
    try:
        if args.action == "status":
            info = status(target)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                print("\n".join(format_status(info)))
            return 0
        lines = enable(target) if args.action == "enable" else disable(target)
    except AliasError as exc:
        print(exc, file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"dsplug deepspeed-alias {args.action}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


COMMAND = CliCommand(name="deepspeed-alias", help=HELP, description=DESCRIPTION, add_arguments=add_arguments, run=run)


@hookimpl
def dsplug_cli_commands():
    return [COMMAND]


@hookimpl
def dsplug_api_modules():
    """DeepSpeed's ``deepspeed.git_version_info`` (:mod:`.git_version_info`)."""
    return [ApiModule("dsplug.git_version_info", "dsplug.plugins.deepspeed_alias.git_version_info")]
