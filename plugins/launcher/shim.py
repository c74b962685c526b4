"""``python -m dsplug.plugins.launcher.shim [--module | --no_python] TARGET [ARGS...]``.

``torch.distributed.run`` gives each worker its rank only through the environment; DeepSpeed's
launcher also passes ``--local_rank=<n>`` on the command line, right after the script name and
before the script's own arguments, and DeepSpeed scripts parse it. This shim, run as each
worker, inserts that argument and then runs TARGET as ``__main__`` in this same process (a
script path, or a module with ``--module``), or replaces itself with TARGET (``--no_python``).

A dsplug config error raised by TARGET is printed as one line naming the rank (the same error on
every rank would otherwise print a traceback each) and the worker exits with status 1.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

MODES = ("--module", "--no_python")


def worker_argv(target: str, args: Sequence[str], local_rank: str) -> list:
    """``sys.argv`` as the user script sees it."""
    return [target, f"--local_rank={local_rank}", *args]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in MODES else None
    if not argv:
        print("usage: python -m dsplug.plugins.launcher.shim [--module | --no_python] TARGET [ARGS...]", file=sys.stderr)
        return 2
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        print(
            "dsplug.plugins.launcher.shim: LOCAL_RANK is not set; this shim is run by torch.distributed.run "
            "(via `dsplug launch`), not directly",
            file=sys.stderr,
        )
        return 2
    target, args = argv[0], argv[1:]
    new_argv = worker_argv(target, args, local_rank)
    if mode == "--no_python":
        os.execvp(target, new_argv)  # does not return
    sys.argv = new_argv
    try:
        if mode == "--module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # as `python script.py` would: the script's folder first on sys.path
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except Exception as exc:
        if not is_config_error(exc):
            _record_for_torchrun(exc)
            raise
        print(f"dsplug launch: rank {os.environ.get('RANK', local_rank)}: {one_line(exc)}", file=sys.stderr,
              flush=True)
        return 1
    return 0


def _record_for_torchrun(exc: BaseException) -> None:
    """Write this worker's error file (``TORCHELASTIC_ERROR_FILE``), as torch's ``@record`` does:
    the per-node launcher reads it to tell a rank that ended on a CommError (it lost a peer) from
    the rank that failed first. Best effort: the exception propagates either way."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception as problem:  # the worker's own error matters more than its error file
        print(f"dsplug launch: could not write the error file: {problem}", file=sys.stderr)


def is_config_error(exc: BaseException) -> bool:
    schema = sys.modules.get("dsplug.config.schema")  # not imported: the error cannot be one of its
    return schema is not None and isinstance(exc, schema.ConfigError)


def one_line(exc: BaseException) -> str:
    """The config error's message on one line (several issues joined by '; ')."""
    issues = getattr(exc, "issues", None) or []
    if len(issues) <= 1:
        return " ".join(str(exc).split("\n"))
    head = str(exc).split("\n", 1)[0]
    return f"{head}: " + "; ".join(str(issue) for issue in issues)


if __name__ == "__main__":
    sys.exit(main())
