"""Rank discovery for processes started by an MPI launcher or by Slurm's ``srun``.

``torch.distributed.run`` (``dsplug launch`` on one node, pdsh / ssh on several) gives each process
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``. ``mpirun`` and ``srun`` start the training script
directly and describe the process in their own variables instead; this module translates them,
as DeepSpeed's ``init_distributed(auto_mpi_discovery=True)`` does (DeepSpeed asks mpi4py; the
launchers' variables say the same without needing MPI in the script):

============  ===============================  ===================================  ======================
launcher      rank                              world size                           local rank
============  ===============================  ===================================  ======================
OpenMPI       ``OMPI_COMM_WORLD_RANK``          ``OMPI_COMM_WORLD_SIZE``             ``OMPI_COMM_WORLD_LOCAL_RANK``
MVAPICH2      ``MV2_COMM_WORLD_RANK``           ``MV2_COMM_WORLD_SIZE``              ``MV2_COMM_WORLD_LOCAL_RANK``
MPICH/IMPI    ``PMI_RANK``                      ``PMI_SIZE``                         ``MPI_LOCALRANKID``
Slurm srun    ``SLURM_PROCID``                  ``SLURM_STEP_NUM_TASKS``             ``SLURM_LOCALID``
============  ===============================  ===================================  ======================

``MASTER_ADDR`` / ``MASTER_PORT`` must come from the environment (``dsplug launch --launcher
openmpi|slurm|...`` exports them); only a job whose processes all run on one host defaults to
127.0.0.1 and port 29500. Variables already set (``RANK`` ...) are never overwritten.
"""
from __future__ import annotations

import os
from typing import Dict, MutableMapping, Optional, Tuple

#: (launcher name, rank, world size, local rank, local size) variables, in the order they are tried
LAUNCHER_VARIABLES: Tuple[Tuple[str, str, str, str, str], ...] = (
    ("OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
)
DEFAULT_PORT = "29500"


class DiscoveryError(RuntimeError):
    """The launcher's variables are incomplete or contradict each other; the message names them."""


def _int(environ, name: str, launcher: str) -> int:
    raw = environ.get(name)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise DiscoveryError(f"started by {launcher} but {name}={raw!r} is not an integer") from None


def discover(environ: Optional[MutableMapping[str, str]] = None, port: int = int(DEFAULT_PORT)) -> Optional[str]:
    """Set RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (and the master address on one host)
    in ``environ`` (default ``os.environ``) from an MPI launcher's or srun's variables.

    Returns the launcher's name, or None when ``RANK`` is already set or no launcher is recognised.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ:
        return None
    for launcher, rank_var, size_var, local_var, local_size_var in LAUNCHER_VARIABLES:
        if rank_var not in environ:
            continue
        if launcher == "Slurm" and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ:
            continue  # a batch script's own shell, not a task srun started
        size_var = size_var if size_var in environ or launcher != "Slurm" else "SLURM_NTASKS"
        rank, size = _int(environ, rank_var, launcher), _int(environ, size_var, launcher)
        local = _int(environ, local_var, launcher) if local_var in environ else None
        if not 0 <= rank < size:
            raise DiscoveryError(f"started by {launcher} with {rank_var}={rank} outside 0..{size - 1} "
                                 f"({size_var}={size})")
        values: Dict[str, str] = {"RANK": str(rank), "WORLD_SIZE": str(size)}
        if local is not None:
            values["LOCAL_RANK"] = str(local)
        local_size = _local_size(environ, local_size_var)
        if local_size is not None:
            values["LOCAL_WORLD_SIZE"] = str(local_size)
        for key, value in values.items():
            environ.setdefault(key, value)
        if "MASTER_ADDR" not in environ:
            if size > 1 and local_size != size:
                raise DiscoveryError(
                    f"started by {launcher} ({rank_var}={rank}, {size_var}={size}) on several hosts but MASTER_ADDR "
                    "is not set: export the address of rank 0's host (`dsplug launch --launcher ...` does; by hand: "
                    "mpirun -x MASTER_ADDR=<host>, srun --export=ALL,MASTER_ADDR=<host>)")
            environ["MASTER_ADDR"] = "127.0.0.1"
        environ.setdefault("MASTER_PORT", str(port))
        return launcher
    return None


def _local_size(environ, name: str) -> Optional[int]:
    """Processes on this host; Slurm's per-node list (``2(x2)``, ``3,1``) gives this node's as its first entry
    only when every node runs the same count, so a list is trusted only then."""
    raw = environ.get(name)
    if raw is None:
        return None
    if name != "SLURM_STEP_TASKS_PER_NODE":
        return int(raw) if raw.isdigit() else None
    counts = []
    for part in raw.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit():
            return None
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[0] if len(set(counts)) == 1 else None
