"""``python -m dsplug.plugins.train [options]``: what each worker of ``dsplug train --nproc N`` runs
(``dsplug launch --num_procs N -m dsplug.plugins.train ...`` works the same way)."""
import argparse
import sys

from .loop import main
from .options import EPILOG, add_arguments


def _parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="python -m dsplug.plugins.train", description="train the built-in character-level transformer",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))


if __name__ == "__main__":
    try:
        sys.exit(main(_parser().parse_args()))
    except KeyboardInterrupt:  # before the job's own handling started
        sys.exit(130)
