"""DeepSpeed's ``deepspeed.launcher.multinode_runner``: one class per cluster launcher, each building
the command line that starts a job on several hosts through that launcher.

dsplug starts no remote process itself: pdsh (over ssh), ``mpirun`` (OpenMPI, MVAPICH2, MPICH,
Intel MPI) or Slurm's ``srun`` do, and ``torch.distributed`` connects the ranks. Every class has
DeepSpeed's interface -- ``Runner(args, world_info_base64[, resource_pool])``, ``backend_exists()``,
``add_export(key, value)``, ``get_cmd(environment, active_resources)``, ``name`` -- and gives the
command DeepSpeed's gives for the same inputs, with two differences:

* pdsh nodes run ``python -u -m dsplug.plugins.launcher.launch`` (this plugin's per-node launcher,
  also importable as ``dsplug.launcher.launch``) where DeepSpeed runs ``deepspeed.launcher.launch``;
* values reach the remote shell quoted with :func:`shlex.quote` (DeepSpeed wraps them in double
  quotes, which the remote shell still expands: ``$``, backquotes); an export is stored as given
  and quoted where a shell reads it, so ``mpirun -x KEY=VALUE`` passes the value itself.

``args`` is the parsed ``dsplug launch`` / ``deepspeed`` command line; DeepSpeed's "not given"
value ``-1`` and dsplug's ``None`` mean the same for ``--num_nodes`` / ``--num_gpus``.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from abc import ABC, abstractmethod
from typing import Dict, List, Mapping, Tuple

from .errors import LaunchError

PDSH_MAX_FAN_OUT = 1024
MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"
#: the module each pdsh node runs (DeepSpeed: ``deepspeed.launcher.launch``)
NODE_LAUNCH_MODULE = "dsplug.plugins.launcher.launch"


def _given(value) -> bool:
    """A ``--num_nodes`` / ``--num_gpus`` value that limits something (DeepSpeed: -1 = not given)."""
    return value is not None and value != -1


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


class MultiNodeRunner(ABC):
    """A cluster launcher: what it needs installed, and the command that starts the job with it."""

    def __init__(self, args, world_info_base64: str):
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: Dict[str, str] = {}

    @abstractmethod
    def backend_exists(self):
        """Whether this launcher's program is installed (truthy: its path)."""

    @abstractmethod
    def get_cmd(self, environment, active_resources):
        """The command (argv list) that starts the job; ``environment`` is the launcher process's."""

    def add_export(self, key: str, var: str) -> None:
        """Make ``key=var`` part of every rank's environment."""
        self.exports[key.strip()] = var.strip()

    def parse_user_args(self) -> List[str]:
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        return self.__class__.__name__

    def validate_args(self) -> None:
        """Reject options this launcher cannot honour (a ValueError naming the option)."""

    def _python(self) -> List[str]:
        if _arg(self.args, "no_python", False):
            return []
        return [sys.executable, "-u", *(["-m"] if _arg(self.args, "module", False) else [])]

    def _whole_job_only(self) -> None:
        """MPI launchers take the hostfile as it is: no per-slot filters, no node/GPU limits."""
        if _arg(self.args, "include", "") or _arg(self.args, "exclude", ""):
            raise ValueError(f"{self.name} backend does not support worker include/exclusion "
                             "(--include/--exclude); list the hosts to use in the hostfile")
        if _given(_arg(self.args, "num_nodes")) or _given(_arg(self.args, "num_gpus")):
            raise ValueError(f"{self.name} backend does not support limiting num nodes/gpus (--num_nodes/--num_gpus); "
                             "give each host its process count as slots=N in the hostfile")


class PDSHRunner(MultiNodeRunner):
    """pdsh runs this plugin's node launcher on every host (``%n`` becomes the node's rank)."""

    def backend_exists(self):
        return shutil.which("pdsh")

    @property
    def name(self) -> str:
        return "pdsh"

    def parse_user_args(self) -> List[str]:
        return [shlex.quote(arg) for arg in self.args.user_args]

    def get_cmd(self, environment, active_resources) -> Tuple[List[str], List[str], Mapping[str, str]]:
        """``(command, kill command, environment)``: pdsh's command line, the pdsh line DeepSpeed
        runs to stop the nodes on Ctrl-C (``pkill -f`` of the node launcher's arguments), and the
        environment pdsh must run with (ssh as its remote command, ``--ssh_port``)."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        ssh_port = _arg(self.args, "ssh_port")
        if ssh_port is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = f"{environment.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()
        workers = ",".join(active_resources.keys())
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", workers, *shlex.split(_arg(self.args, "launcher_args", "") or "")]
        exports = "".join(f"export {key}={shlex.quote(value)}; " for key, value in self.exports.items())
        launch = [exports, f"cd {shlex.quote(os.path.abspath('.'))};", shlex.quote(sys.executable), "-u", "-m",
                  NODE_LAUNCH_MODULE, f"--world_info={self.world_info_base64}", "--node_rank=%n",
                  f"--master_addr={self.args.master_addr}", f"--master_port={self.args.master_port}"]
        if _arg(self.args, "no_python", False):
            launch.append("--no_python")
        if _arg(self.args, "module", False):
            launch.append("--module")
        if _arg(self.args, "no_local_rank", False):
            launch.append("--no_local_rank")
        if _arg(self.args, "save_pid", False):
            launch += ["--save_pid", str(os.getpid())]
        if _arg(self.args, "elastic_training", False):
            launch += ["--enable_elastic_training", f"--max_elastic_nodes={self.args.max_elastic_nodes}",
                       f"--min_elastic_nodes={self.args.min_elastic_nodes}"]
            if _arg(self.args, "max_restarts") is not None:
                launch.append(f"--max_restarts={self.args.max_restarts}")
            if _arg(self.args, "rdzv_conf", ""):
                launch.append(f"--rdzv_conf={self.args.rdzv_conf}")
        search = " ".join(launch[2:6])  # python -u -m <module>: what identifies the node launchers
        kill = pdsh + ["pkill -f", shlex.quote(search)]
        return pdsh + launch + [shlex.quote(self.user_script)] + self.user_arguments, kill, environment


class OpenMPIRunner(MultiNodeRunner):
    """``mpirun -n TOTAL -hostfile HOSTFILE``: the hostfile's ``slots=N`` give each host's process count."""

    def __init__(self, args, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool
        self.add_export("UCX_TLS", "tcp")

    def backend_exists(self):
        return shutil.which("ompi_info")

    @property
    def name(self) -> str:
        return "openmpi"

    def validate_args(self) -> None:
        self._whole_job_only()

    def get_cmd(self, environment, active_resources) -> List[str]:
        total = sum(self.resource_pool.values())
        launcher_args = shlex.split(_arg(self.args, "launcher_args", "") or "")
        named = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(launcher_args, launcher_args[1:]))
        btl_tcp = [] if named else ["--mca", "btl_tcp_if_include", "eth0"]
        cmd = ["mpirun", "-n", str(total), "-hostfile", str(self.args.hostfile), "--mca", "btl", "^openib",
               *btl_tcp, *launcher_args]
        for key, value in self.exports.items():
            cmd += ["-x", f"{key}={value}"]
        return cmd + self._python() + [self.user_script] + self.user_arguments


class MVAPICHRunner(MultiNodeRunner):
    """MVAPICH2-GDR's ``mpirun -np TOTAL -ppn PER_NODE --hostfile`` (the same process count on every host)."""

    def __init__(self, args, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool
        self.add_export("MV2_SMP_USE_CMA", "0")  # the CMA kernel module is missing on common distributions
        self.add_export("MV2_DEBUG_SHOW_BACKTRACE", "1")
        if _device_name() == "cuda":
            self.add_export("MV2_USE_CUDA", "1")
        self.add_export("MV2_SUPPORT_DL", "1")
        self.add_export("MV2_ENABLE_AFFINITY", "0")
        self.add_export("MV2_INTER_ALLGATHER_TUNING", "5")
        self.add_export("MV2_CUDA_USE_NAIVE", "0")

    def backend_exists(self) -> bool:
        if not shutil.which("mpiname"):
            warnings.warn("mpiname does not exist, mvapich is not installed properly")
            return False
        found = subprocess.check_output(["mpiname"]).decode("utf-8").strip()
        if "MVAPICH2-GDR" not in found:
            warnings.warn(f"Expected MVAPICH2-GDR as return for mpiname but received {found}")
            return False
        return True

    @property
    def name(self) -> str:
        return "mvapich"

    def validate_args(self) -> None:
        self._whole_job_only()

    def get_cmd(self, environment, active_resources) -> List[str]:
        per_node = _same_count(self.resource_pool, self.name)
        with open(MVAPICH_TMP_HOSTFILE, "w") as f:
            f.writelines(f"{host}\n" for host in self.resource_pool)
        cmd = ["mpirun", "-np", str(sum(self.resource_pool.values())), "-ppn", str(per_node),
               "--hostfile", MVAPICH_TMP_HOSTFILE, *shlex.split(_arg(self.args, "launcher_args", "") or "")]
        for key, value in self.exports.items():
            cmd += ["-env", f"{key}={value}"]
        return cmd + self._python() + [self.user_script] + self.user_arguments


class _HydraRunner(MultiNodeRunner):
    """MPICH and Intel MPI (the Hydra process manager): ``-genv`` exports, ``-hosts a,b``."""

    def __init__(self, args, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self):
        return shutil.which("mpirun")

    def validate_args(self) -> None:
        self._whole_job_only()

    def _job_env(self, per_node: int) -> List[str]:
        total = sum(self.resource_pool.values())
        return ["-genv", "MASTER_ADDR", str(self.args.master_addr), "-genv", "MASTER_PORT", str(self.args.master_port),
                "-genv", "WORLD_SIZE", str(total), "-genv", "LOCAL_SIZE", str(per_node)]


class MPICHRunner(_HydraRunner):
    @property
    def name(self) -> str:
        return "mpich"

    def get_cmd(self, environment, active_resources) -> List[str]:
        per_node = _same_count(self.resource_pool, "MPICH")
        cmd = ["mpirun", "-n", str(sum(self.resource_pool.values())), "-ppn", str(per_node),
               *shlex.split(_arg(self.args, "launcher_args", "") or "")]
        for key, value in self.exports.items():
            cmd += ["-genv", f"{key}={value}"]
        cmd += self._job_env(per_node) + ["-hosts", ",".join(self.resource_pool)]
        return cmd + self._python() + [self.user_script] + self.user_arguments


class IMPIRunner(_HydraRunner):
    """Intel MPI: one ``-n 1 -env RANK i -env LOCAL_RANK j`` section per rank, joined by ``:``."""

    @property
    def name(self) -> str:
        return "impi"

    def get_cmd(self, environment, active_resources) -> List[str]:
        per_node = _same_count(self.resource_pool, "Intel MPI")
        cmd = ["mpirun", "-ppn", str(per_node), *shlex.split(_arg(self.args, "launcher_args", "") or "")]
        for key, value in self.exports.items():
            cmd += ["-genv", key, value]
        cmd += self._job_env(per_node) + ["-genv", "I_MPI_PIN", "0", "-hosts", ",".join(self.resource_pool)]
        for rank in range(sum(self.resource_pool.values())):
            if rank:
                cmd.append(":")
            cmd += ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_node),
                    *self._python(), self.user_script, *self.user_arguments]
        return cmd


class SlurmRunner(MultiNodeRunner):
    """``srun -n TOTAL --export=ALL,KEY=VALUE,...`` inside (or asking for) a Slurm allocation."""

    def __init__(self, args, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self):
        return shutil.which("sinfo")

    @property
    def name(self) -> str:
        return "slurm"

    def parse_user_args(self) -> List[str]:
        """A JSON object argument is passed compacted (srun splits nothing, but a config written with
        comments or Python literals is refused here rather than by the script on every rank)."""
        out = []
        for arg in self.args.user_args:
            if arg.startswith("{") and arg.endswith("}"):
                try:
                    value = json.loads(arg)
                    if isinstance(value, dict) and "config_files" in value:
                        value["config_files"] = {k: json.loads(v) for k, v in value["config_files"].items()}
                except json.JSONDecodeError as exc:
                    raise ValueError(f"slurm launcher: the argument {arg[:60]!r} looks like JSON but is not plain JSON "
                                     f"({exc}); remove comments and write true/false/null in lower case") from exc
                arg = json.dumps(value, separators=(",", ":"))
            out.append(arg)
        return out

    @staticmethod
    def _pdsh_include_to_nodelist(include: str) -> str:
        if "@" not in include:
            if ":" in include:
                raise LaunchError(f"slurm launcher: --include {include!r} names slots; Slurm allocates whole nodes "
                                  "(name hosts only, e.g. 'node1@node2')")
            return include
        if ":" in include:
            raise LaunchError(f"slurm launcher: --include {include!r} names slots; Slurm allocates whole nodes "
                              "(name hosts only, e.g. 'node1@node2')")
        return include.replace("@", ",")

    def get_cmd(self, environment, active_resources) -> List[str]:
        cmd = ["srun", "-n", str(sum(self.resource_pool.values())),
               *shlex.split(_arg(self.args, "launcher_args", "") or "")]
        if _arg(self.args, "comment", ""):
            cmd += ["--comment", self.args.comment]
        if _arg(self.args, "account", ""):
            cmd += ["--account", self.args.account]
        if _arg(self.args, "include", ""):
            cmd += ["--nodelist", self._pdsh_include_to_nodelist(self.args.include)]
        if _given(_arg(self.args, "num_nodes")):
            cmd += ["--nodes", str(self.args.num_nodes)]
        if _given(_arg(self.args, "num_gpus")):  # on CPU the "GPUs" of a node are its processes
            gpus = _device_name() != "cpu"
            cmd += ["--gpus" if gpus else "--ntasks-per-node", str(self.args.num_gpus)]
        exports = "--export=ALL" + "".join(f",{key}={value}" for key, value in self.exports.items())
        return cmd + [exports, sys.executable, "-u", self.user_script] + self.user_arguments


def _same_count(resource_pool: Mapping[str, int], launcher: str) -> int:
    counts = list(resource_pool.values())
    if any(n != counts[0] for n in counts):
        shown = ", ".join(f"{h}: {n}" for h, n in resource_pool.items())
        raise ValueError(f"{launcher} requires same number of devices per node (hostfile slots: {shown})")
    return counts[0]


def _device_name() -> str:
    from dsplug.accelerator import get_accelerator

    return get_accelerator().device_name()


__all__ = ["IMPIRunner", "MPICHRunner", "MVAPICHRunner", "MultiNodeRunner", "OpenMPIRunner", "PDSHRunner",
           "SlurmRunner", "MVAPICH_TMP_HOSTFILE", "PDSH_MAX_FAN_OUT"]
