"""``dsplug checkpoint verify``: check a saved checkpoint against its manifest, offline."""
from __future__ import annotations

import os
import sys


def add_parser(subparsers):
    p = subparsers.add_parser("checkpoint", help="inspect saved checkpoints (verify)")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    sub.required = True
    v = sub.add_parser("verify", help="check every file of a checkpoint against its manifest (sha256, size)",
                       description="Check the files of a checkpoint tag against the manifest written when it was "
                                   "saved. DIR is a tag directory, or a save directory (then the tag 'latest' "
                                   "names, or --tag, or every complete tag with --all). Exit status 1 on any mismatch.")
    v.add_argument("dir", help="a tag directory or the save_checkpoint directory")
    v.add_argument("--tag", default=None, help="the tag inside DIR to check")
    v.add_argument("--all", action="store_true", help="check every complete tag in DIR")
    v.set_defaults(func=run_verify)


def run_verify(args) -> int:
    from dsplug import checkpoint as ckpt

    try:
        targets = _targets(args, ckpt)
        problems = {t: ckpt.verify(t) for t in targets}
    except ckpt.CheckpointError as exc:
        print(f"dsplug checkpoint verify: {exc}", file=sys.stderr)
        return 1
    bad = 0
    for target, found in problems.items():
        if found:
            bad += 1
            print(f"FAILED {target}")
            for line in found:
                print(f"  {line}")
        else:
            files = ckpt.read_manifest(target)["files"]
            print(f"OK     {target} ({len(files)} files, {sum(e['bytes'] for e in files.values())} bytes)")
    return 1 if bad else 0


def _targets(args, ckpt):
    directory = os.fspath(args.dir)
    if not os.path.isdir(directory):
        raise ckpt.CheckpointError(f"{directory} is not a directory")
    if os.path.isfile(os.path.join(directory, ckpt.MANIFEST)) and not args.tag and not args.all:
        return [directory]
    if args.all:
        tags = [t for t, _ in ckpt.complete_tags(directory)]
        if not tags:
            raise ckpt.CheckpointError(f"{directory} holds no complete checkpoint tag (none has a {ckpt.MANIFEST})")
        return [os.path.join(directory, t) for t in tags]
    tag = args.tag or ckpt.read_latest(directory)
    if tag is None:
        raise ckpt.CheckpointError(f"{directory} has no 'latest' file and no {ckpt.MANIFEST}; pass --tag or --all")
    return [os.path.join(directory, tag)]
