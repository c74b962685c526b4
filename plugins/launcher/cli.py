"""The ``dsplug launch`` command: its arguments and what it runs (registered by :mod:`.plugin`)."""
from __future__ import annotations

import argparse

from dsplug.cli.argtypes import positive_int

from .elastic import add_elastic_arguments

HELP = "run a training script on local / remote processes (like the deepspeed launcher)"
DESCRIPTION = """\
``dsplug launch``: start a script on one or more nodes, DeepSpeed-launcher style.

Same flags as the ``deepspeed`` launcher for what it supports; processes are started by
``torch.distributed.run`` on each node (over ssh for several nodes).
"""

EPILOG = """\
examples:
  dsplug launch --num_gpus 2 train.py --deepspeed_config ds.json
  dsplug launch --num_procs 4 train.py                       (CPU: 4 processes, gloo)
  dsplug launch --hostfile hosts --include 'worker-0@worker-1:0,2' train.py
  dsplug launch --hostfile hosts --num_nodes 2 --print_only train.py
  dsplug launch --hostfile hosts --launcher openmpi --launcher_args='--allow-run-as-root' train.py
  dsplug launch --hostfile hosts --launcher slurm train.py    (srun, inside a Slurm allocation)
  dsplug launch --elastic_training --min_elastic_nodes 1 --max_elastic_nodes 4 --master_addr HOST train.py
                                                             (elastic: run on each node; nodes may leave / join)

hostfile lines: '<hostname> slots=<N>'; default hostfile: /job/hostfile (absent: this machine).
several hosts: pdsh (default), ssh, openmpi, mvapich, mpich, impi or slurm start them (--launcher);
docs/multi-node.md shows each.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    count = p.add_mutually_exclusive_group()
    count.add_argument("--num_gpus", "--num_accelerators", type=positive_int, default=None, metavar="N",
                       help="processes per node, using devices 0..N-1 (on CPU: N processes)")
    count.add_argument("--num_procs", type=positive_int, default=None, metavar="N",
                       help="processes per node; the CPU spelling of --num_gpus")
    p.add_argument("--num_nodes", type=positive_int, default=None, metavar="K",
                   help="use the first K hosts of the hostfile")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hostfile", default=None, metavar="FILE",
                       help="hostfile ('<host> slots=<N>' lines); default /job/hostfile if it exists")
    hosts.add_argument("--no_hostfile", action="store_true",
                       help="this machine only, even when /job/hostfile exists (dsplug's)")
    filt = p.add_mutually_exclusive_group()
    filt.add_argument("-i", "--include", default="", metavar="SPEC",
                      help="hosts/slots to use: HOST[:SLOT[,SLOT...]][@HOST...], e.g. 'worker-0@worker-1:0,2'")
    filt.add_argument("-e", "--exclude", default="", metavar="SPEC",
                      help="hosts/slots not to use, same syntax as --include")
    p.add_argument("--master_addr", default=None, help="address of node 0 (default: 127.0.0.1 on one node, "
                   "else the first host)")
    p.add_argument("--master_port", type=int, default=None, help="rendezvous port (default 29500)")
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank=<n> to the script (LOCAL_RANK is always in its environment)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--module", action="store_true", help="run the target as a module, like 'python -m'")
    mode.add_argument("--no_python", action="store_true", help="execute the target directly, without python")
    p.add_argument("--force_multi", action="store_true",
                   help="use ssh even for a single node (e.g. one remote host)")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for remote nodes")
    p.add_argument("--launcher", default=None, metavar="NAME", type=str.lower,
                   help="what starts the processes of a multi-node job: pdsh (default when installed), ssh "
                        "(dsplug: one ssh per node; default without pdsh), openmpi, mvapich, mpich, impi, slurm")
    p.add_argument("--launcher_args", default="", metavar="ARGS",
                   help="more arguments for the launcher command (pdsh / mpirun / srun options; ssh options with "
                        "--launcher ssh), one shell-quoted string, e.g. --launcher_args='-F ~/.ssh/cluster_config'")
    p.add_argument("--no_ssh_check", action="store_true",
                   help="do not check that every host answers over ssh before a pdsh / ssh launch")
    p.add_argument("--save_pid", action="store_true",
                   help="write the launcher's pid to /tmp/<pid>.deepspeed while the job runs (on each node with pdsh)")
    p.add_argument("--autotuning", default="", choices=["tune", "run"],
                   help="tune the config's ZeRO stage and micro-batch size with real experiments first "
                        "(docs/autotuning.md); 'run' then trains with the best config")
    p.add_argument("--print_only", "--dry_run", dest="print_only", action="store_true",
                   help="print the command for each node instead of running it")
    add_elastic_arguments(p)
    p.add_argument("user_script", metavar="script", help="the training script (or module / program)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def run(args, raise_errors: bool = False) -> int:
    """``dsplug launch``: the exit status. A launch refused before anything starts prints one error
    line and returns 2, or with ``raise_errors`` raises the :class:`LaunchError` (a ValueError), as
    DeepSpeed's ``deepspeed.launcher.runner.main`` does."""
    import sys

    from . import LaunchError, LaunchRequest, execute, plan_launch
    from .elastic import elastic_plan
    from .plan import DEFAULT_MASTER_PORT

    procs_per_node = args.num_gpus if args.num_gpus is not None else args.num_procs
    try:
        if args.launcher is not None:
            from .multinode import choose_launcher

            choose_launcher(args.launcher)  # a misspelt name is an error even where one node runs locally
        request = LaunchRequest(
            script=args.user_script,
            script_args=tuple(args.user_args),
            hostfile=args.hostfile,
            include=args.include,
            exclude=args.exclude,
            num_nodes=args.num_nodes,
            procs_per_node=procs_per_node,
            master_addr=args.master_addr,
            master_port=DEFAULT_MASTER_PORT if args.master_port is None else args.master_port,
            local_rank_arg=not args.no_local_rank,
            module=args.module,
            no_python=args.no_python,
            force_multi=args.force_multi,
            ssh_port=args.ssh_port,
            local_devices=lambda: max(1, int(_accelerator().device_count())),
            visible_devices_env=lambda: getattr(_accelerator(), "visible_devices_env", None) or "CUDA_VISIBLE_DEVICES",
            **({"default_hostfile": ""} if args.no_hostfile else {}),
        )
        plan = elastic_plan(plan_launch(request), request, args)
    except LaunchError as exc:
        if raise_errors:
            raise
        print(f"dsplug launch: error: {exc}", file=sys.stderr)
        return 2
    overridden = _launch_override(args, plan.resources)
    if overridden is not None:
        return overridden
    if plan.multi_node:
        return _run_multi_node(args, request, plan, raise_errors)
    if args.print_only:
        for node in plan.nodes:
            print(node.display())
        return 0
    with _pid_file(args):
        return execute(plan)


def _run_multi_node(args, request, plan, raise_errors: bool = False) -> int:
    """Start the job on several hosts through ``--launcher`` (:mod:`.multinode`)."""
    import os
    import shlex
    import sys

    from . import LaunchError, execute, multinode

    try:
        launcher = multinode.choose_launcher(args.launcher)
        if args.elastic_training and launcher not in (multinode.PDSH, multinode.SSH):
            raise LaunchError(f"--elastic_training needs --launcher pdsh or ssh (each node runs an elastic agent); "
                              f"--launcher {launcher} starts the ranks itself")
        hosts = list(plan.resources)
        if launcher == multinode.SSH:
            plan = multinode.ssh_plan(plan, args)
            if args.print_only:
                for node in plan.nodes:
                    print(node.display())
                return 0
            if not args.no_ssh_check:
                multinode.check_ssh_hosts(hosts, args.ssh_port, plan.nodes[0].ssh_args, os.environ)
            with _pid_file(args):
                return execute(plan, stop_others_after=None if args.elastic_training else multinode.STOP_GRACE_S,
                               elastic=args.elastic_training)
        hostfile = args.hostfile or request.default_hostfile
        cmd, env = multinode.build_command(launcher, args, plan, hostfile, os.environ)
        if args.print_only:
            changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
            prefix = ["env", *(f"{k}={v}" for k, v in changed.items())] if changed else []
            print(shlex.join(prefix + cmd))
            return 0
        if launcher == multinode.PDSH and not args.no_ssh_check:
            multinode.check_pdsh_hosts(hosts, args.launcher_args, env)
        with _pid_file(args):
            return multinode.run_launcher(cmd, env, launcher, hosts, elastic=args.elastic_training)
    except LaunchError as exc:
        if raise_errors:
            raise
        print(f"dsplug launch: error: {exc}", file=sys.stderr)
        return 2


class _pid_file:
    """``--save_pid``: ``/tmp/<pid>.deepspeed`` holds this launcher's pid while the job runs."""

    def __init__(self, args):
        import os

        self.path = f"/tmp/{os.getpid()}.deepspeed" if getattr(args, "save_pid", False) else None

    def __enter__(self):
        import os

        if self.path:
            with open(self.path, "w") as f:
                f.write(str(os.getpid()))
        return self

    def __exit__(self, *exc):
        import os

        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        return False


def _launch_override(args, resources):
    """The exit status of a plugin that runs this launch its own way (hook ``dsplug_launch_override``:
    the autotuning plugin for ``--autotuning``), or None to launch as usual."""
    import sys

    from dsplug.registry import get_registry

    status = get_registry().pm.hook.dsplug_launch_override(args=args, resources=resources)
    if status is None and getattr(args, "autotuning", ""):
        print(f"dsplug launch: error: --autotuning {args.autotuning} needs the autotuning plugin, which is not "
              "installed or is blocked (DSPLUG_BLOCK_PLUGINS); `dsplug list` shows what is installed",
              file=sys.stderr)
        return 2
    return status


def _accelerator():
    """This machine's accelerator; asked lazily because finding it imports torch (seconds)."""
    from dsplug.accelerator import get_accelerator

    return get_accelerator()
