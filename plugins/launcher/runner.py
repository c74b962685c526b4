"""DeepSpeed's ``deepspeed.launcher.runner`` functions over this plugin's parsers (the kernel's
``dsplug.launcher.runner`` forwards here): hostfile reading, ``--include`` / ``--exclude``
resource filters, the world-info encoding handed to each node, and ``main`` (``dsplug launch``).

The results have DeepSpeed's shapes (ordered ``{host: slots}`` / ``{host: [slot, ...]}`` dicts);
errors are ``ValueError`` (:class:`~.errors.LaunchError`), with the checks of ``dsplug launch``
(host-name safety, slot bounds, unknown hosts and slots named).
"""
from __future__ import annotations

import base64
import collections
import json
import logging
import os
from typing import Dict, List, Mapping, Optional, Sequence

from .errors import LaunchError
from .hostfile import DEFAULT_HOSTFILE, parse_hostfile_text, read_hostfile
from .resources import parse_resource_spec

logger = logging.getLogger("dsplug")

DLTS_HOSTFILE = DEFAULT_HOSTFILE
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
EXPORT_ENVS = ["MLFLOW", "NCCL", "PYTHON", "MV2", "UCX"]


def fetch_hostfile(hostfile_path: str) -> Optional["collections.OrderedDict[str, int]"]:
    """The resource pool ``{host: slots}`` of the hostfile at ``hostfile_path``, in file order; None
    (with a warning) when there is no such file: the job then runs on this machine only."""
    if not os.path.isfile(hostfile_path):
        logger.warning("Unable to find hostfile, will proceed with training with local resources only.")
        return None
    return collections.OrderedDict(read_hostfile(hostfile_path))


def _parse_hostfile(hostfile_lines: Sequence[str]) -> "collections.OrderedDict[str, int]":
    """``{host: slots}`` of hostfile lines (each ``<host> slots=<N>``)."""
    text = "".join(line if line.endswith("\n") else line + "\n" for line in hostfile_lines)
    return collections.OrderedDict(parse_hostfile_text(text))


def _unique(items: List[int]) -> List[int]:
    out: List[int] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def parse_resource_filter(host_info: Mapping[str, List[int]], include_str: str = "", exclude_str: str = ""
                          ) -> "collections.OrderedDict[str, List[int]]":
    """Filter ``host_info`` (``{host: [slot, ...]}``) by ``NODE_SPEC[@NODE_SPEC ...]`` with
    ``NODE_SPEC = HOST[:SLOT[,SLOT ...]]``: ``include_str`` keeps only what it names (a bare host:
    all its slots), ``exclude_str`` removes it (a bare host: the whole host). At most one of them;
    neither returns ``host_info`` as it is. Hosts keep ``host_info``'s order, each host's slots are
    in ascending order (as DeepSpeed returns them, whatever order the spec names them in); hosts left without
    slots are dropped; a host or slot ``host_info`` does not have is a ValueError."""
    if include_str and exclude_str:
        raise LaunchError("include_str and exclude_str are mutually exclusive.")
    if not include_str and not exclude_str:
        return host_info
    flag, spec = ("--include", include_str) if include_str else ("--exclude", exclude_str)
    chosen: Dict[str, List[int]] = {} if include_str else {h: list(s) for h, s in host_info.items()}
    for node in parse_resource_spec(spec, flag):
        if node.host not in host_info:
            raise LaunchError(f"Hostname '{node.host}' not found in hostfile")
        for slot in node.slots or ():
            if slot not in host_info[node.host]:
                raise LaunchError(f"No slot '{slot}' specified on host '{node.host}'")
        if include_str:
            chosen.setdefault(node.host, []).extend(host_info[node.host] if node.slots is None else node.slots)
        elif node.slots is None:
            chosen[node.host] = []
        else:
            chosen[node.host] = [s for s in chosen[node.host] if s not in node.slots]
    return collections.OrderedDict((h, sorted(_unique(chosen[h]))) for h in host_info if chosen.get(h))


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str, exclusion: str
                              ) -> "collections.OrderedDict[str, List[int]]":
    """The active resources ``{host: [slot, ...]}`` of a pool ``{host: slots}`` after the filters."""
    active = collections.OrderedDict((host, list(range(slots))) for host, slots in resource_pool.items())
    return parse_resource_filter(active, include_str=inclusion, exclude_str=exclusion)


def encode_world_info(world_info) -> str:
    """``world_info`` (``{host: [slot, ...]}``) as URL-safe base64 of its JSON, as handed to nodes."""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")


def decode_world_info(encoded: str):
    """The inverse of :func:`encode_world_info`."""
    return json.loads(base64.urlsafe_b64decode(encoded.encode("utf-8")).decode("utf-8"))


def parse_args(args: Optional[Sequence[str]] = None):
    """The ``dsplug launch`` arguments (DeepSpeed's launcher flags that dsplug supports)."""
    import argparse

    from .cli import add_arguments

    parser = argparse.ArgumentParser(prog="dsplug launch", description="DeepSpeed-style launcher")
    add_arguments(parser)
    return parser.parse_args(args=args)


def main(args: Optional[Sequence[str]] = None) -> int:
    """``dsplug launch`` with ``args`` (the command line after the program name); the exit code. A
    launch refused before anything starts raises :class:`~.errors.LaunchError` (a ValueError naming
    the flag at fault), as DeepSpeed's ``runner.main`` raises; the ``dsplug launch`` command prints it."""
    from .cli import run

    return run(parse_args(args), raise_errors=True)


__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "DLTS_HOSTFILE", "EXPORT_ENVS",
           "decode_world_info", "encode_world_info", "fetch_hostfile", "main", "parse_args",
           "parse_inclusion_exclusion", "parse_resource_filter"]
