"""``dsplug zero-to-fp32``: consolidate a partitioned ZeRO checkpoint into one fp32 state dict.

Contributed to the ``dsplug`` command by :func:`dsplug.plugins.zero.plugin.dsplug_cli_commands`. Cheap to
import: torch is imported when the command runs.
"""
from __future__ import annotations

import sys

from dsplug.descriptors import CliCommand


def add_arguments(p) -> None:
    p.add_argument("checkpoint_dir", help="the save_checkpoint directory (holding 'latest'), or a tag directory")
    p.add_argument("output", help="output file (torch.save); an existing directory gets pytorch_model.bin")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")


def run(args) -> int:
    from dsplug.checkpoint import CheckpointError

    from .checkpoint.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output, tag=args.tag, progress=print)
    except CheckpointError as exc:
        print(f"dsplug zero-to-fp32: {exc}", file=sys.stderr)
        return 1
    return 0


ZERO_TO_FP32 = CliCommand(
    name="zero-to-fp32",
    help="rebuild full fp32 weights from a ZeRO stage 1-3 checkpoint (offline)",
    add_arguments=add_arguments,
    run=run,
    description="Merge every rank's partition of a ZeRO stage 1-3 checkpoint into one fp32 state dict saved with "
                "torch.save (no config, no process group needed).",
)
