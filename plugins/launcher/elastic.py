"""``dsplug launch --elastic_training``: DeepSpeed's elastic-launch flags on torch's elastic agent.

Each node runs ``torch.distributed.run`` with a c10d rendezvous instead of a fixed node count::

    --nnodes MIN:MAX --rdzv_backend c10d --rdzv_endpoint MASTER_ADDR:MASTER_PORT
    --rdzv_id $ELASTIC_RUN_ID --max_restarts N [--rdzv_conf KEY=VALUE,...]

The agent on each node joins the rendezvous; the job starts once ``MIN`` nodes are there (after
the rendezvous' last-call wait for more, up to ``MAX``). When a node is lost (its agent dies, or
a worker fails) every surviving agent stops its workers, rendezvous again with the nodes that
remain, and restarts the workers at the new world size; a node that starts the same command
later joins at the next restart (the running agents notice it waiting). Up to
``--max_restarts`` restarts. The training script resumes from its last checkpoint (dsplug's
checkpoints reload at any world size) and, with an ``elasticity`` config section, gets the
batch sizes of the new world size.

The agent whose host is ``MASTER_ADDR`` hosts the rendezvous store: that node must survive. In a
multi-node launch whose ``MASTER_ADDR`` is one of the hostfile's hosts, that node's agent is told
so (``is_host=1``, the others ``is_host=0``; :func:`node_rdzv_conf`) rather than left to guess from
its own addresses, which fails where two "hosts" share a machine (every agent sees a loopback
``MASTER_ADDR`` as its own).
Graceful stops (Ctrl-C, SIGTERM to an agent) end the whole job, as torch's agent closes the
rendezvous when it shuts down; losing a node means its agent disappears.
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import replace
from typing import Dict, List, Optional

from .errors import LaunchError

#: DeepSpeed's environment variable naming the elastic job (every agent of a job must share it)
RUN_ID_ENV = "ELASTIC_RUN_ID"
DEFAULT_RUN_ID = "dsplug-elastic"
#: restarts torch's agent may make (DeepSpeed's elastic agent is built with 100)
DEFAULT_MAX_RESTARTS = 100
#: rendezvous settings ``--rdzv_conf`` may give (torch's c10d rendezvous handler reads these)
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat", "keep_alive_interval",
                  "keep_alive_max_attempt", "read_timeout", "is_host", "timeout")
#: torch's agents share their rendezvous store with the workers unless this is "1"; with sharing, a
#: node that stays rank 0 across a membership change publishes no store address for the new round,
#: and a node joining a running job waits for it until it times out. Set for every elastic node.
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_RUN_ID = re.compile(r"[A-Za-z0-9._-]+\Z")
_FLAGS = ("--min_elastic_nodes", "--max_elastic_nodes", "--max_restarts", "--rdzv_conf")


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    """The elastic flags of ``dsplug launch`` (DeepSpeed's three, plus torch's restart / rendezvous knobs)."""
    g = p.add_argument_group("elastic training (torch elastic agent, c10d rendezvous)")
    g.add_argument("--elastic_training", action="store_true",
                   help="restart the workers at the new world size when nodes leave or join (resume from a checkpoint)")
    g.add_argument("--min_elastic_nodes", type=int, default=-1, metavar="N",
                   help="fewest nodes the job runs on (default 1)")
    g.add_argument("--max_elastic_nodes", type=int, default=-1, metavar="M",
                   help="most nodes the job runs on (default: the nodes launched now)")
    g.add_argument("--max_restarts", type=int, default=None, metavar="R",
                   help=f"worker-group restarts allowed (default {DEFAULT_MAX_RESTARTS})")
    g.add_argument("--rdzv_conf", default="", metavar="KEY=VALUE,...",
                   help="c10d rendezvous settings, e.g. last_call_timeout=5,keep_alive_interval=2 "
                        f"(keys: {', '.join(RDZV_CONF_KEYS)})")


def parse_rdzv_conf(text: str) -> Dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``; unknown keys and malformed pairs are LaunchErrors."""
    out: Dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise LaunchError(f"--rdzv_conf: {item!r} is not KEY=VALUE")
        if key not in RDZV_CONF_KEYS:
            raise LaunchError(f"--rdzv_conf: unknown key {key!r}; valid keys: {', '.join(RDZV_CONF_KEYS)}")
        if key in out:
            raise LaunchError(f"--rdzv_conf: {key!r} given twice")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", value):
            raise LaunchError(f"--rdzv_conf: {key}={value!r} is not a plain number or word")
        out[key] = value
    return out


def node_rdzv_conf(conf: Dict[str, str], hosts: List[str], host: str, master_addr: str) -> Dict[str, str]:
    """``conf`` for the node on ``host`` of a job on ``hosts``: with ``is_host`` added when the job
    spans several hosts, ``master_addr`` is one of them and the user did not set ``is_host``."""
    if "is_host" in conf or len(hosts) < 2 or master_addr not in hosts:
        return dict(conf)
    return {**conf, "is_host": "1" if host == master_addr else "0"}


def _given(args, name: str) -> bool:
    value = getattr(args, name, None)
    return value not in (None, -1, "")


def check_flags(args) -> None:
    """The elastic flags are used only with ``--elastic_training`` (a LaunchError names the stray one)."""
    if getattr(args, "elastic_training", False):
        return
    stray = [flag for flag in _FLAGS if _given(args, flag[2:])]
    if stray:
        raise LaunchError(f"{', '.join(stray)} {'apply' if len(stray) > 1 else 'applies'} only with --elastic_training")


def elastic_plan(plan, request, args, environ: Optional[Dict[str, str]] = None):
    """``plan`` (from :func:`~.plan.plan_launch`) with each node's torchrun turned elastic.

    Returns ``plan`` itself without ``--elastic_training`` (after :func:`check_flags`)."""
    from .plan import TORCHRUN_MODULE, _worker_target

    check_flags(args)
    if not getattr(args, "elastic_training", False):
        return plan
    environ = os.environ if environ is None else environ
    launched = len(plan.nodes)
    low = 1 if args.min_elastic_nodes == -1 else args.min_elastic_nodes
    high = launched if args.max_elastic_nodes == -1 else args.max_elastic_nodes
    if low < 1 or high < 1:
        raise LaunchError(f"--min_elastic_nodes ({low}) and --max_elastic_nodes ({high}) must be positive")
    if low > high:
        raise LaunchError(f"--min_elastic_nodes {low} is greater than --max_elastic_nodes {high}")
    if high < launched:
        raise LaunchError(f"--max_elastic_nodes {high} is less than the {launched} nodes being launched; "
                          "launch fewer nodes (--num_nodes / --include) or raise --max_elastic_nodes")
    restarts = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
    if restarts < 0:
        raise LaunchError(f"--max_restarts must be >= 0, got {restarts}")
    conf = parse_rdzv_conf(args.rdzv_conf or "")
    run_id = environ.get(RUN_ID_ENV, DEFAULT_RUN_ID)
    if not _RUN_ID.match(run_id):
        raise LaunchError(f"{RUN_ID_ENV}={run_id!r}: use letters, digits, '.', '_' and '-'")
    host = f"[{plan.master_addr}]" if ":" in plan.master_addr else plan.master_addr
    rendezvous = ["--nnodes", f"{low}:{high}", "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", f"{host}:{plan.master_port}", "--rdzv_id", run_id,
                  "--max_restarts", str(restarts)]
    target = _worker_target(request)
    hosts = [node.host for node in plan.nodes]
    nodes: List = []
    for node in plan.nodes:
        node_conf = node_rdzv_conf(conf, hosts, node.host, plan.master_addr)
        conf_args = ["--rdzv_conf", ",".join(f"{k}={v}" for k, v in node_conf.items())] if node_conf else []
        argv = (request.python, "-u", "-m", TORCHRUN_MODULE, *rendezvous, *conf_args,
                "--nproc_per_node", str(len(node.slots)), *target)
        env = dict(node.env)
        env.setdefault(NO_SHARED_STORE_ENV, environ.get(NO_SHARED_STORE_ENV, "1"))
        nodes.append(replace(node, argv=tuple(argv), env=env))
    return replace(plan, nodes=nodes)
