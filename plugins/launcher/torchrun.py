"""``python -m dsplug.plugins.launcher.torchrun [torch.distributed.run arguments]``.

Runs ``torch.distributed.run`` unchanged, except for the exit status: torchrun exits with 1
whatever its workers returned; this exits with the status of the first worker that failed
(128 + N for a worker killed by signal N), like DeepSpeed's launcher does. Its options are
matched exactly (no abbreviations), so a script's own ``--log`` reaches the script instead of
failing as an ambiguous abbreviation of torchrun's ``--log-dir`` / ``--logs-specs``.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    from .plan import exit_status

    parser = torch_run.get_args_parser()
    parser.allow_abbrev = False  # a script option such as --log is not an abbreviation of torchrun's --log-dir
    try:
        record(torch_run.run)(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as failed:
        _rank, failure = failed.get_first_failure()
        return exit_status(failure.exitcode) or 1
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
