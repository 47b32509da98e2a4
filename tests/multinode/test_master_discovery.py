"""Rank 0's address for ranks mpirun started without MASTER_ADDR (dsrun/runtime/distributed/discovery.py), and
the incomplete scheduler environments that are errors (dsrun/launcher/mpi.py). Fast: no process is started."""
import socket

import pytest
import torch

from dsrun.launcher.mpi import SchedulerEnvError, rank_env_from_scheduler
from dsrun.launcher.placement import derived_port
from dsrun.launcher.slurm import node_address
from dsrun.runtime.distributed import discovery
from dsrun.runtime.distributed.discovery import MasterDiscoveryError, discover_master, first_hostfile_host


_RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def _unset_rank_env(monkeypatch) -> None:
    """Unset the rank variables, and have monkeypatch remove whatever init_distributed sets in their place."""
    for name in _RANK_ENV:
        monkeypatch.setenv(name, "0")  # recorded, so undo restores the variable's absence
        monkeypatch.delenv(name)


@pytest.fixture
def no_mpi4py(monkeypatch):
    """The hostfile and one-node sources, as on a machine without mpi4py."""
    monkeypatch.setattr(discovery, "_by_mpi4py", lambda: None)


def test_first_hostfile_host_reads_every_mpi_format(tmp_path):
    for text in ("# comment\n\nworker-0.job.svc slots=4\nworker-1 slots=4\n", "worker-0.job.svc:4\nworker-1:4\n",
                 "  worker-0.job.svc   # no slots\n"):
        (tmp_path / "h").write_text(text)
        assert first_hostfile_host(str(tmp_path / "h")) == "worker-0.job.svc"
    (tmp_path / "h").write_text("# nothing\n")
    assert first_hostfile_host(str(tmp_path / "h")) is None


def test_master_from_kubeflow_hostfile(tmp_path, no_mpi4py):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{socket.gethostname()} slots=1\nworker-1.job.svc slots=1\n")
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_MCA_orte_default_hostfile": str(hostfile),
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert discover_master(env, rank=1, world_size=2).addr == socket.gethostname()
    assert discover_master({**env, "OMPI_COMM_WORLD_RANK": "0"}, rank=0, world_size=2).addr == socket.gethostname()
    hydra = {"PMI_RANK": "1", "HYDRA_HOST_FILE": str(hostfile)}
    assert discover_master(hydra, rank=1, world_size=2).source == "the first host of HYDRA_HOST_FILE"


def test_rank_0_not_on_the_first_host_is_named(tmp_path, no_mpi4py):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0.example.invalid slots=1\n")
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_default_hostfile": str(hostfile)}
    with pytest.raises(MasterDiscoveryError, match=r"rank 0 runs on .*, not on worker-0.example.invalid.*MASTER_ADDR"):
        discover_master(env, rank=0, world_size=2)
    assert discover_master({**env, "OMPI_COMM_WORLD_RANK": "1"}, 1, 2).addr == "worker-0.example.invalid"
    # A worker pod of the MPI Operator: the variable arrives, the file (on the launcher pod) does not.
    worker = {**env, "OMPI_COMM_WORLD_RANK": "1", "OMPI_MCA_orte_default_hostfile": str(tmp_path / "missing")}
    assert discover_master({**worker, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 1, 2).addr == "127.0.0.1"
    with pytest.raises(MasterDiscoveryError, match=r"the hostfile OMPI_MCA_orte_default_hostfile=.*missing \(No such "
                                                   r"file or directory on this node\) cannot be read.*install mpi4py"):
        discover_master(worker, 1, 2)


def test_one_node_without_hostfile_is_loopback_and_several_nodes_an_error(no_mpi4py):
    one_node = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert discover_master(one_node, 1, 4) == discovery.Master("127.0.0.1", "every rank on this node")
    assert discover_master({"PMI_RANK": "0", "MPI_LOCALNRANKS": "2"}, 0, 2).addr == "127.0.0.1"
    with pytest.raises(MasterDiscoveryError) as err:
        discover_master({**one_node, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 1, 4)
    for name in ("MASTER_ADDR", "mpi4py", "OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"):
        assert name in str(err.value)


def test_mpi4py_broadcast_comes_first(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "_by_mpi4py", lambda: "10.0.0.7")
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_default_hostfile": str(tmp_path / "unread")}
    assert discover_master(env, 0, 2) == discovery.Master("10.0.0.7", "rank 0, over MPI (mpi4py)")


@pytest.mark.parametrize("env, names", [
    ({"OMPI_COMM_WORLD_RANK": "1"}, ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "1"}, ["OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=1"]),
    ({"PMI_RANK": "3", "PMI_SIZE": "2"}, ["PMI_RANK=3", "PMI_SIZE=2"]),
    ({"PMI_RANK": "x", "PMI_SIZE": "2"}, ["PMI_RANK='x'", "whole numbers"]),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, ["SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS"]),
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "5"},
     ["SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS=1"]),
])
def test_incomplete_scheduler_environment_is_an_error(env, names):
    """Each of these would otherwise run as a job of one rank beside the others (N separate jobs)."""
    with pytest.raises(SchedulerEnvError) as err:
        rank_env_from_scheduler(env)
    for name in names:
        assert name in str(err.value)


def test_batch_shell_and_complete_environments_still_work():
    # sbatch's own shell: SLURM_PROCID=0 without a step is one process, not a rank.
    assert rank_env_from_scheduler({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "5"}) == {}
    assert rank_env_from_scheduler({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})["WORLD_SIZE"] == "1"


def test_srun_with_pmix_takes_the_master_from_the_step():
    """srun --mpi=pmix gives PMIX_RANK (read as the rank) and the step's variables, which name rank 0's node."""
    env = {"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_JOB_ID": "9", "SLURM_LOCALID": "0"}
    got = rank_env_from_scheduler(env)
    assert (got["RANK"], got["WORLD_SIZE"], got["MASTER_PORT"]) == ("1", "2", str(derived_port("9")))
    assert got["MASTER_ADDR"] in ("n1", node_address("n1"))
    # mpirun inside an allocation: its daemons' step says nothing about where rank 0 is
    under_mpirun = {**env, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0"}
    assert "MASTER_ADDR" not in rank_env_from_scheduler(under_mpirun)
    assert "MASTER_ADDR" not in rank_env_from_scheduler({**env, "SLURM_PROCID": "0"})


def test_init_distributed_reports_incomplete_environment(monkeypatch):
    """The error reaches the user from init_distributed, before any process group or port."""
    import dsrun
    _unset_rank_env(monkeypatch)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    with pytest.raises(SchedulerEnvError, match="OMPI_COMM_WORLD_RANK=1 but OMPI_COMM_WORLD_SIZE=1"):
        dsrun.init_distributed(dist_backend="gloo")


def test_auto_mpi_discovery_false_leaves_master_addr_to_the_user(monkeypatch, no_mpi4py):
    """As in DeepSpeed, auto_mpi_discovery=False looks for nothing, although the one-node source would answer.
    (init_distributed sets RANK etc. from OMPI_* before it fails: _unset_rank_env has them removed after.)"""
    import dsrun
    from dsrun.runtime.distributed.dist import DistributedSetupError
    _unset_rank_env(monkeypatch)
    for name, value in {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    # The question is what a fresh process decides: a process group an earlier test of this
    # pytest process left behind would make init_distributed return before looking.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(DistributedSetupError, match=r"MASTER_ADDR is not set \(auto_mpi_discovery=False"):
        dsrun.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
