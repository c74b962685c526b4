"""``python -m dsplug.plugins.launcher.launch --world_info=B64 --node_rank=N ... script [args]``: one node's
part of a multi-node job (DeepSpeed's ``deepspeed.launcher.launch``; also ``dsplug.launcher.launch``).

pdsh runs this on every host of the job (``--node_rank=%n``). It reads which slots this node runs
from the world info (``{host: [slot, ...]}`` as URL-safe base64 JSON, in node-rank order), then runs
``torch.distributed.run`` for them (:mod:`.torchrun`): static rendezvous at ``--master_addr:--master_port``,
or with ``--enable_elastic_training`` a c10d rendezvous for ``--min_elastic_nodes:--max_elastic_nodes``
nodes. A failed worker is reported with this node's rank and host name, and when the connection to
the launching machine closes (pdsh / ssh stopped) the node stops its workers.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from .elastic import (DEFAULT_MAX_RESTARTS, DEFAULT_RUN_ID, NO_SHARED_STORE_ENV, RUN_ID_ENV, node_rdzv_conf,
                      parse_rdzv_conf)
from .plan import SHIM_MODULE
from .runner import decode_world_info
from .torchrun import NODE_ENV, WATCH_ENV

#: where ``--save_pid`` writes ``<pid>.deepspeed`` (DeepSpeed's place)
PID_FILE_BASEPATH = "/tmp"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dsplug.plugins.launcher.launch", allow_abbrev=False,
                                description="one node of a multi-node dsplug launch (started by pdsh)")
    p.add_argument("--world_info", required=True, help="base64 JSON {host: [slot, ...]} of the whole job")
    p.add_argument("--node_rank", type=int, required=True, help="this node's index in the world info")
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--save_pid", type=int, default=0, metavar="PID",
                   help=f"write this launcher's pid to {PID_FILE_BASEPATH}/PID.deepspeed while it runs")
    p.add_argument("--enable_elastic_training", action="store_true")
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    p.add_argument("--rdzv_conf", default="", help="c10d rendezvous settings KEY=VALUE,... (elastic)")
    p.add_argument("--watch_stdout", choices=("yes", "no"), default="yes",
                   help="stop the workers when stdout's reader goes away (the ssh connection closed)")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def torchrun_argv(args: argparse.Namespace, hosts: List[str], slots: List[int]) -> List[str]:
    """The :mod:`.torchrun` arguments that run this node's slots."""
    if args.enable_elastic_training:
        low = 1 if args.min_elastic_nodes == -1 else args.min_elastic_nodes
        high = len(hosts) if args.max_elastic_nodes == -1 else args.max_elastic_nodes
        host = f"[{args.master_addr}]" if ":" in args.master_addr else args.master_addr
        nodes = ["--nnodes", f"{low}:{high}", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                 f"{host}:{args.master_port}", "--rdzv_id", os.environ.get(RUN_ID_ENV, DEFAULT_RUN_ID),
                 "--max_restarts", str(args.max_restarts)]
        conf = node_rdzv_conf(parse_rdzv_conf(args.rdzv_conf), hosts, hosts[args.node_rank], args.master_addr)
        if conf:
            nodes += ["--rdzv_conf", ",".join(f"{k}={v}" for k, v in conf.items())]
    else:
        nodes = ["--nnodes", str(len(hosts)), "--node_rank", str(args.node_rank),
                 "--master_addr", args.master_addr, "--master_port", str(args.master_port)]
    if args.no_local_rank:
        mode = ["--no-python"] if args.no_python else ["-m"] if args.module else []
        target = [*mode, args.user_script, *args.user_args]
    else:
        mode = ["--module"] if args.module else ["--no_python"] if args.no_python else []
        target = ["-m", SHIM_MODULE, *mode, args.user_script, *args.user_args]
    return [*nodes, "--nproc_per_node", str(len(slots)), *target]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import torchrun
    from dsplug.accelerator import get_accelerator

    args = parse_args(argv)
    world = decode_world_info(args.world_info)
    hosts = list(world)
    if not 0 <= args.node_rank < len(hosts):
        print(f"dsplug launch: --node_rank {args.node_rank} is not a node of the job ({len(hosts)} nodes: "
              f"{', '.join(hosts)})", file=sys.stderr)
        return 2
    host = hosts[args.node_rank]
    slots = [int(s) for s in world[host]]
    os.environ.setdefault(NODE_ENV, f"node {args.node_rank} ({host})")
    if args.watch_stdout == "yes":
        os.environ[WATCH_ENV] = "1"
    if args.enable_elastic_training:
        os.environ.setdefault(NO_SHARED_STORE_ENV, "1")
    if slots != list(range(len(slots))):  # a subset of this node's devices: make only those visible
        name = getattr(get_accelerator(), "visible_devices_env", None) or "CUDA_VISIBLE_DEVICES"
        os.environ[name] = ",".join(map(str, slots))
    pid_file = None
    if args.save_pid:
        pid_file = os.path.join(PID_FILE_BASEPATH, f"{args.save_pid}.deepspeed")
        if os.path.exists(pid_file):  # another node of the job on this host (shared /tmp)
            pid_file = os.path.join(PID_FILE_BASEPATH, f"{args.save_pid}.{args.node_rank}.deepspeed")
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    try:
        return torchrun.main(torchrun_argv(args, hosts, slots))
    finally:
        if pid_file:
            try:
                os.unlink(pid_file)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
