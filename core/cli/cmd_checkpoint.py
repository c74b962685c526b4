"""``dsplug checkpoint verify``: check a saved checkpoint against its manifest, offline.

It reads nothing outside the directories it checks: a manifest entry naming a path elsewhere (or
a file that is a symbolic link out of the tag) is reported, not opened, and a manifest of any
shape gives a message, never a traceback.
"""
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
                                   "names, or --tag, or every complete tag with --all, and the save directory's "
                                   "zero_to_fp32.py against the newest manifest that records it). Exit status 1 on "
                                   "any mismatch.")
    v.add_argument("dir", help="a tag directory or the save_checkpoint directory")
    v.add_argument("--tag", default=None, help="the tag inside DIR to check")
    v.add_argument("--all", action="store_true", help="check every complete tag in DIR")
    v.set_defaults(func=run_verify)


def run_verify(args) -> int:
    from dsplug import checkpoint as ckpt

    try:
        targets, save_dir = _targets(args, ckpt)
    except ckpt.CheckpointError as exc:
        print(f"dsplug checkpoint verify: {exc}", file=sys.stderr)
        return 1
    bad = 0
    for target in targets:
        found = ckpt.verify(target)
        if found:
            bad += 1
            _report_failure(target, found)
        else:
            files = ckpt.read_manifest(target)["files"]  # verify() found it well-formed
            print(f"OK     {target} ({len(files)} files, {sum(e['bytes'] for e in files.values())} bytes)")
    if save_dir is not None:
        bad += _verify_save_dir_files(save_dir, ckpt)
    return 1 if bad else 0


def _report_failure(target: str, problems) -> None:
    print(f"FAILED {target}")
    for line in problems:
        print(f"  {line}")


def _verify_save_dir_files(save_dir: str, ckpt) -> int:
    """The save directory's own files (zero_to_fp32.py) against the most recently saved tag that
    records them; returns 1 on a mismatch."""
    recorded = [m for _, m in ckpt.complete_tags(save_dir) if m.get("save_dir_files")]
    if not recorded:
        return 0
    problems = ckpt.verify_save_dir_files(save_dir, recorded[-1])
    names = ", ".join(sorted(recorded[-1]["save_dir_files"]))
    if problems:
        _report_failure(f"{save_dir} ({names})", problems)
        return 1
    print(f"OK     {save_dir} ({names})")
    return 0


def _targets(args, ckpt):
    """(tag directories to check, the save directory or None when DIR is a tag directory)."""
    directory = os.fspath(args.dir)
    if not os.path.isdir(directory):
        raise ckpt.CheckpointError(f"{directory} is not a directory")
    if os.path.lexists(os.path.join(directory, ckpt.MANIFEST)) and not args.tag and not args.all:
        return [directory], None
    if args.all:
        tags = [t for t, _ in ckpt.complete_tags(directory)]
        if not tags:
            raise ckpt.CheckpointError(f"{directory} holds no complete checkpoint tag (none has a readable "
                                       f"{ckpt.MANIFEST})")
        return [os.path.join(directory, t) for t in tags], directory
    tag = args.tag or ckpt.read_latest(directory)
    if tag is None:
        raise ckpt.CheckpointError(f"{directory} has no 'latest' file and no {ckpt.MANIFEST}; pass --tag or --all")
    return [ckpt.resolve_tag(directory, tag)], directory
