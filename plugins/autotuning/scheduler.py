"""DeepSpeed's ``deepspeed.autotuning.scheduler.ResourceManager``: the nodes and slots experiments
may use, the results / experiments directories and the ``arg_mappings`` of an autotuning run.

dsplug's :class:`~.autotuner.Autotuner` runs its experiments itself (a ``dsplug launch`` each, see
:mod:`.runner`); scheduling DeepSpeed experiment files through a ``ResourceManager``
(``schedule_experiments`` / ``run``) is not built and says so.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Union

from .config import _arg_mappings
from .space import AutotuningError


class Node:
    """One host and its slots (``max_slots`` of them, numbered from 0)."""

    def __init__(self, host: str, max_slots: int):
        self.host = host
        self.max_slots = max_slots
        self.idle_slots: List[int] = list(range(max_slots))

    def __repr__(self) -> str:
        return f"Node({self.host!r}, max_slots={self.max_slots})"


class ResourceManager:
    """``ResourceManager(args, hosts, num_gpus_per_node, results_dir, exps_dir, arg_mappings)``.

    hosts:        comma-separated host names (``"worker-0, worker-1"``) or a list of them
    arg_mappings: config key -> the script's flag; keys and flags are stripped of spaces, and each
                  flag must be a command-line flag (starting with ``-``)
    """

    def __init__(self, args, hosts: Union[str, List[str]], num_gpus_per_node: int, results_dir: Optional[str],
                 exps_dir: Optional[str], arg_mappings: Optional[Dict[str, str]]):
        names = hosts.split(",") if isinstance(hosts, str) else list(hosts)
        names = [h.strip() for h in names if h.strip()]
        if not names:
            raise AutotuningError(f"ResourceManager: no host in hosts={hosts!r}")
        if not isinstance(num_gpus_per_node, int) or num_gpus_per_node < 1:
            raise AutotuningError(f"ResourceManager: num_gpus_per_node must be a positive int, got {num_gpus_per_node!r}")
        self.args = args
        self.results_dir = results_dir
        self.exps_dir = exps_dir
        self.num_gpus_per_node = num_gpus_per_node
        self.nodes = [Node(h, num_gpus_per_node) for h in names]
        self.arg_mappings: Dict[str, str] = {}
        for key, flag in (arg_mappings or {}).items():
            self.arg_mappings.setdefault(key.strip(), flag.strip())
        problem = _arg_mappings(self.arg_mappings)
        if problem:
            raise AutotuningError(f"ResourceManager: arg_mappings {problem}")

    def schedule_experiments(self, exp_paths) -> None:
        raise NotImplementedError("ResourceManager.schedule_experiments is not built in dsplug: the autotuner runs its "
                                  "experiments itself (Autotuner.tune(), or dsplug launch --autotuning tune|run)")

    def run(self) -> None:
        raise NotImplementedError("ResourceManager.run is not built in dsplug: the autotuner runs its experiments "
                                  "itself (Autotuner.tune(), or dsplug launch --autotuning tune|run)")


__all__ = ["Node", "ResourceManager"]
