"""``dsplug zero-to-fp32``: consolidate a partitioned ZeRO checkpoint into one fp32 state dict."""
from __future__ import annotations

import sys


def add_parser(subparsers):
    p = subparsers.add_parser(
        "zero-to-fp32", help="rebuild full fp32 weights from a ZeRO stage 1-3 checkpoint (offline)",
        description="Merge every rank's partition of a ZeRO stage 1-3 checkpoint into one fp32 state dict "
                    "saved with torch.save (no config, no process group needed).")
    p.add_argument("checkpoint_dir", help="the save_checkpoint directory (holding 'latest'), or a tag directory")
    p.add_argument("output", help="output file (torch.save); an existing directory gets pytorch_model.bin")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    p.set_defaults(func=run)


def run(args) -> int:
    from dsplug.checkpoint import CheckpointError
    from dsplug.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output, tag=args.tag, progress=print)
    except CheckpointError as exc:
        print(f"dsplug zero-to-fp32: {exc}", file=sys.stderr)
        return 1
    return 0
