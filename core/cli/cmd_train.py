"""``dsplug train``: train the built-in character-level transformer language model."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    from dsplug.train.options import EPILOG, add_arguments

    p = subparsers.add_parser(
        "train",
        help="train a small built-in transformer language model (checkpoints, monitors, --resume, --nproc)",
        description="Train a small character-level transformer language model on the built-in corpus "
                    "with a DeepSpeed-format config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsplug.train.loop import main

    return main(args)
