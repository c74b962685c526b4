"""From the resource pool (``{host: slot count}``) to the slots each node runs.

DeepSpeed's filter syntax: ``NODE_SPEC[@NODE_SPEC...]`` with ``NODE_SPEC = HOST[:SLOT[,SLOT...]]``.
``--include`` keeps only what it names (a bare host means all its slots); ``--exclude`` removes
what it names (a bare host removes the host). A host may appear more than once; its slots are
merged. The result keeps the pool's host order (that order decides node ranks) with sorted slots,
and drops hosts left without slots. Naming a host or slot the pool does not have is an error.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

from .errors import LaunchError
from .hostfile import MAX_SLOTS, validate_hostname

NODE_SEP = "@"
SLOT_LIST_START = ":"
SLOT_SEP = ","
_SYNTAX = "expected HOST[:SLOT[,SLOT...]][@HOST[:SLOT...]...], e.g. 'worker-0@worker-1:0,2'"
_SLOT = re.compile(r"[0-9]+\Z")

Resources = Dict[str, List[int]]


@dataclass(frozen=True)
class NodeSpec:
    """One ``HOST[:SLOTS]`` element of a filter; ``slots is None`` means the whole host."""

    host: str
    slots: Optional[Tuple[int, ...]] = None


def parse_resource_spec(spec: str, flag: str = "--include") -> List[NodeSpec]:
    """Parse a filter string into :class:`NodeSpec` items (syntax only, no pool checks)."""
    if not spec or not spec.strip():
        raise LaunchError(f"{flag} is empty; {_SYNTAX}")
    nodes = []
    for part in spec.split(NODE_SEP):
        host, has_slots, slot_text = part.partition(SLOT_LIST_START)
        if not host:
            raise LaunchError(f"{flag} {spec!r}: element {part!r} names no host; {_SYNTAX}")
        validate_hostname(host, f"{flag} {spec!r}")
        if not has_slots:
            nodes.append(NodeSpec(host))
            continue
        slots = []
        for token in slot_text.split(SLOT_SEP):
            if not _SLOT.match(token):
                raise LaunchError(
                    f"{flag} {spec!r}: slot {token!r} of host {host!r} is not a non-negative integer; {_SYNTAX}"
                )
            digits = token.lstrip("0") or "0"
            if len(digits) > len(str(MAX_SLOTS)) or int(digits) >= MAX_SLOTS:
                shown = token if len(token) <= 20 else f"{token[:8]}...{token[-8:]} ({len(token)} digits)"
                raise LaunchError(
                    f"{flag} {spec!r}: slot {shown} of host {host!r} is out of range (slots are numbered "
                    f"0..{MAX_SLOTS - 1} at most)"
                )
            slots.append(int(digits))
        nodes.append(NodeSpec(host, tuple(slots)))
    return nodes


def _unknown_host(flag: str, spec: str, host: str, pool: Mapping[str, int], source: str) -> LaunchError:
    close = difflib.get_close_matches(host, list(pool), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return LaunchError(
        f"{flag} {spec!r} names host {host!r}, which {source} does not list "
        f"(hosts: {', '.join(pool)}){hint}"
    )


def select_resources(
    pool: Mapping[str, int], include: str = "", exclude: str = "", source: str = "the hostfile"
) -> Resources:
    """Apply ``--include`` or ``--exclude`` to ``pool``; returns ``{host: [slot, ...]}``."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; give one of them")
    if not include and not exclude:
        return {host: list(range(count)) for host, count in pool.items()}
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    nodes = parse_resource_spec(spec, flag)
    for node in nodes:
        if node.host not in pool:
            raise _unknown_host(flag, spec, node.host, pool, source)
        for slot in node.slots or ():
            if slot >= pool[node.host]:
                raise LaunchError(
                    f"{flag} {spec!r} names slot {slot} of host {node.host!r}, which has slots "
                    f"0..{pool[node.host] - 1} (slots={pool[node.host]} in {source})"
                )
    if include:
        chosen = {host: set() for host in pool}
        for node in nodes:
            chosen[node.host].update(range(pool[node.host]) if node.slots is None else node.slots)
    else:
        chosen = {host: set(range(count)) for host, count in pool.items()}
        for node in nodes:
            if node.slots is None:
                chosen[node.host].clear()
            else:
                chosen[node.host].difference_update(node.slots)
    result = {host: sorted(chosen[host]) for host in pool if chosen[host]}
    if not result:
        raise LaunchError(f"{flag} {spec!r} leaves no slots to run on in {source}")
    return result


def check_procs_per_node(procs_per_node: int) -> int:
    """``--num_gpus/--num_procs``: a positive integer no larger than :data:`MAX_SLOTS`."""
    if procs_per_node < 1:
        raise LaunchError(f"--num_gpus/--num_procs must be a positive integer, got {procs_per_node}")
    if procs_per_node > MAX_SLOTS:
        shown = str(procs_per_node) if procs_per_node < 10**20 else "a number of more than 20 digits,"
        raise LaunchError(f"--num_gpus/--num_procs {shown} is more processes than a node can run "
                          f"(at most {MAX_SLOTS})")
    return procs_per_node


def limit_resources(
    resources: Mapping[str, List[int]],
    num_nodes: Optional[int] = None,
    procs_per_node: Optional[int] = None,
    source: str = "the hostfile",
) -> Resources:
    """``--num_nodes N`` keeps the first N hosts; ``--num_gpus/--num_procs P`` runs slots 0..P-1 on each."""
    hosts = list(resources)
    if num_nodes is not None:
        if num_nodes < 1:
            raise LaunchError(f"--num_nodes must be a positive integer, got {num_nodes}")
        if num_nodes > len(hosts):
            raise LaunchError(
                f"--num_nodes {num_nodes} asks for more nodes than {source} provides "
                f"({len(hosts)}: {', '.join(hosts)})"
            )
        hosts = hosts[:num_nodes]
    if procs_per_node is not None:
        check_procs_per_node(procs_per_node)
        return {host: list(range(procs_per_node)) for host in hosts}
    return {host: list(resources[host]) for host in hosts}
