"""``dsplug launch``: DeepSpeed's launcher surface on top of ``torch.distributed.run``.

The pieces, each usable on its own:

* :mod:`.hostfile`  -- DeepSpeed-format hostfiles (``worker-0 slots=4``) and host-name checks.
* :mod:`.resources` -- ``--include`` / ``--exclude`` (``host1@host2:0,2``), ``--num_nodes``,
  ``--num_gpus``: from the resource pool to the slots each node runs.
* :mod:`.envfile`   -- which environment variables travel to remote nodes (``.deepspeed_env``).
* :mod:`.plan`      -- a launch request to one command per node (local, or ssh with every value
  shell-quoted), and running them.
* :mod:`.torchrun`  -- runs ``torch.distributed.run`` and exits with the failed worker's own code.
* :mod:`.shim`      -- the per-process wrapper that hands the script ``--local_rank=<n>``.
* :mod:`.elastic`   -- ``--elastic_training``: each node's torchrun on a c10d rendezvous (``--nnodes MIN:MAX``).
* :mod:`.cli`       -- the ``dsplug launch`` command: its flags and what it runs.
* :mod:`.plugin`    -- registers the command (entry point ``launcher``).

The parsers and the planner are pure functions of their inputs so they are easy to test.
"""
from .errors import LaunchError
from .hostfile import DEFAULT_HOSTFILE, HostfileError, parse_hostfile_text, read_hostfile, validate_hostname
from .plan import LaunchPlan, LaunchRequest, NodeCommand, execute, plan_launch
from .resources import NodeSpec, limit_resources, parse_resource_spec, select_resources

__all__ = [
    "DEFAULT_HOSTFILE",
    "HostfileError",
    "LaunchError",
    "LaunchPlan",
    "LaunchRequest",
    "NodeCommand",
    "NodeSpec",
    "execute",
    "limit_resources",
    "parse_hostfile_text",
    "parse_resource_spec",
    "plan_launch",
    "read_hostfile",
    "select_resources",
    "validate_hostname",
]
