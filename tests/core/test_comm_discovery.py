"""dsplug.comm.discovery: ranks of processes that mpirun or srun started (no RANK in their environment)."""
from __future__ import annotations

import pytest

from dsplug.comm import discovery


def test_openmpi_variables_become_torch_distributed_ones():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    assert discovery.discover(env) == "OpenMPI"
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}


def test_slurm_task_variables_and_the_batch_shell():
    env = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    assert discovery.discover(env) == "Slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == (
        "2", "4", "0", "2", "1234")
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}  # sbatch's own shell: not a task of a step
    assert discovery.discover(batch) is None and "RANK" not in batch


def test_discovery_keeps_what_is_set_and_defaults_one_host():
    env = {"RANK": "0", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert discovery.discover(env) is None and env["RANK"] == "0"
    one_host = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert discovery.discover(one_host) == "MPICH/Intel MPI" and one_host["MASTER_ADDR"] == "127.0.0.1"


def test_discovery_errors_name_the_variables():
    with pytest.raises(discovery.DiscoveryError, match=r"on several hosts but MASTER_ADDR is not set"):
        discovery.discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    with pytest.raises(discovery.DiscoveryError, match=r"OMPI_COMM_WORLD_RANK=5 outside 0..3"):
        discovery.discover({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"})
    with pytest.raises(discovery.DiscoveryError, match=r"PMI_SIZE='x' is not an integer"):
        discovery.discover({"PMI_RANK": "0", "PMI_SIZE": "x"})


def test_dist_init_required_false_without_a_group_is_refused_for_one_of_several_processes(monkeypatch):
    """dist_init_required=False and no process group: one process alone runs as a world of one;
    one of WORLD_SIZE=2 would silently train alone, so init_distributed and initialize refuse it."""
    import torch

    import dsplug
    from dsplug import comm

    monkeypatch.setattr(comm, "is_initialized", lambda: False)  # as in a fresh process (earlier tests may hold one)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    comm.init_distributed(dist_init_required=False)
    assert comm.planned_world_size(False) == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"dist_init_required=False, .* rank 1 of WORLD_SIZE=2: create the group"):
        comm.init_distributed(dist_init_required=False)
    with pytest.raises(ValueError, match="dist_init_required=False"):
        dsplug.initialize(model=torch.nn.Linear(2, 2), dist_init_required=False,
                          config={"train_micro_batch_size_per_gpu": 1})
