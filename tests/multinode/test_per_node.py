"""Launches where the cluster starts the command on every node: `dsrun --no_ssh` per node (SkyPilot,
Kubeflow's PET_* variables, DeepSpeed's --node_rank), a one-host hostfile naming this machine (no sshd), and
`--launcher_args` to mpirun. Each runs scripts/allreduce_train.py and checks its losses against one process.

The two "nodes" of a per-node launch are two dsrun processes on this machine at 127.0.0.1 and 127.0.0.2
(both loopback): nothing connects between them but the ranks' rendezvous, as between real nodes.
"""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.launcher.hostfile import parse_hostfile_text, select_slots
from dsrun.launcher.pernode import PerNodeError, nodes_from_environment, per_node_launch
from tests.multinode.conftest import expected_losses
from tests.multinode.sshd import free_port
from tests.system_packages import require_debian_packages

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/multinode/scripts/allreduce_train.py"
_CLUSTER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _CLUSTER_VARS and not k.startswith(("SKYPILOT_", "PET_", "OMPI_", "SLURM_"))}
    return {**env, **extra}


def _said(run: subprocess.CompletedProcess) -> str:
    """dsrun's stderr with rich's line wrapping undone."""
    return " ".join(run.stderr.split())


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^(?:\[rank \d+\] )?LOSS \d+ (\S+)$", out, re.M)]


def _two_nodes(node_env, extra_args: list[str] = ()) -> list[subprocess.CompletedProcess]:
    """Start node 0 and node 1 (`node_env(k)` gives each one's variables) and wait for both."""
    procs = [subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--no_ssh", *extra_args, SCRIPT,
                               "--steps", "2"], cwd=ROOT, env=_clean_env(**node_env(k)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _check_two_node_run(runs: list[subprocess.CompletedProcess]) -> None:
    for node, run in enumerate(runs):
        assert run.returncode == 0, f"node {node}:\n{run.stdout}\n{run.stderr}"
        assert f"node {node} of 2" in _said(run)
        assert re.search(rf"WHERE rank={node} local_rank=0 node_rank={node}", run.stdout), run.stdout
    assert _losses(runs[0].stdout) == pytest.approx(expected_losses(2), rel=1e-5)
    assert _losses(runs[1].stdout) == []  # only global rank 0 prints losses


@pytest.mark.slow
def test_per_node_launch_with_skypilot_variables():
    """SkyPilot runs `dsrun --no_ssh` on each node with SKYPILOT_NODE_IPS/NODE_RANK/NUM_NODES set; on CPU
    nodes SKYPILOT_NUM_GPUS_PER_NODE is 0 and --num_procs gives the ranks per node. Master: the first IP."""
    port = str(free_port())
    runs = _two_nodes(lambda k: {"SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2", "SKYPILOT_NODE_RANK": str(k),
                                 "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "0"},
                      ["--num_procs", "1", "--master_port", port])
    _check_two_node_run(runs)
    assert "per-node launch from SKYPILOT_NODE_IPS" in _said(runs[1]) and f"127.0.0.1:{port}" in _said(runs[1])


@pytest.mark.slow
def test_per_node_launch_with_kubeflow_pet_variables():
    """Kubeflow's PyTorchJob/Trainer sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT and
    PET_NPROC_PER_NODE on every pod: `dsrun --no_ssh train.py` needs no other flag."""
    port = str(free_port())
    runs = _two_nodes(lambda k: {"PET_NNODES": "2", "PET_NODE_RANK": str(k), "PET_MASTER_ADDR": "127.0.0.1",
                                 "PET_MASTER_PORT": port, "PET_NPROC_PER_NODE": "1"})
    _check_two_node_run(runs)
    assert f"master 127.0.0.1:{port}" in _said(runs[0])


@pytest.mark.slow
def test_one_host_hostfile_naming_this_machine_runs_without_ssh(tmp_path):
    """SkyPilot's recipe on one CPU node: a hostfile of this machine's name with slots=0, and no sshd needed
    (DeepSpeed runs a one-host hostfile locally too). slots=0 takes --num_procs."""
    hosts = tmp_path / "hostfile"
    hosts.write_text(f"{socket.gethostname()} slots=0\n")
    run = subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", str(hosts), "--num_procs", "2",
                          SCRIPT, "--steps", "2"], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "is this machine: running its ranks here without SSH" in _said(run)
    assert _losses(run.stdout) == pytest.approx(expected_losses(2), rel=1e-5)


@pytest.mark.slow
def test_launcher_args_reach_mpirun(tmp_path):
    """`--launcher_args '--allow-run-as-root --oversubscribe'` lets mpirun run as root (containers) with no
    OMPI_ALLOW_RUN_AS_ROOT variable: without the flag Open MPI refuses root."""
    require_debian_packages("openmpi-bin")
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=2\n")
    run = subprocess.run([sys.executable, "-m", "dsrun.launcher.cli", "--hostfile", str(hosts), "--launcher",
                          "openmpi", "--launcher_args", "--allow-run-as-root --oversubscribe", SCRIPT, "--steps",
                          "2"], cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--allow-run-as-root --oversubscribe " + sys.executable in _said(run)
    assert _losses(run.stdout) == pytest.approx(expected_losses(2), rel=1e-5)


def test_per_node_sources_and_errors():
    sky = {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NUM_GPUS_PER_NODE": "4"}
    hosts, source = nodes_from_environment(sky, None, lambda: 1)
    assert [(h.name, h.slots) for h in hosts] == [("10.0.0.1", 4), ("10.0.0.2", 4)]
    launch = per_node_launch(sky, hosts, source, None, None, None)
    assert (launch.node_rank, launch.master_addr, launch.master_port) == (1, "10.0.0.1", 29500)
    assert per_node_launch(sky, hosts, source, 0, "head", 1234).master_addr == "head"  # flags win
    with pytest.raises(PerNodeError, match="SKYPILOT_NUM_NODES=3 but SKYPILOT_NODE_IPS lists 2"):
        nodes_from_environment({**sky, "SKYPILOT_NUM_NODES": "3"}, None, lambda: 1)
    pet = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "auto"}
    hosts, source = nodes_from_environment(pet, None, lambda: 2)
    assert [h.slots for h in hosts] == [2, 2, 2] and hosts[0].name == "job-master-0"
    launch = per_node_launch(pet, hosts, source, None, None, None)
    assert (launch.node_rank, launch.master_addr, launch.master_port) == (2, "job-master-0", 23456)
    with pytest.raises(PerNodeError, match="fixed node count"):
        nodes_from_environment({"PET_NNODES": "1:4"}, None, lambda: 1)
    with pytest.raises(PerNodeError, match="out of range.*0..2"):
        per_node_launch(pet, hosts, source, 3, None, None)
    with pytest.raises(PerNodeError, match="--node_rank K.*SKYPILOT_NODE_RANK or PET_NODE_RANK"):
        per_node_launch({}, hosts, "hosts", None, None, None)
    with pytest.raises(PerNodeError, match="--hostfile.*SKYPILOT_NODE_IPS.*PET_NNODES"):
        nodes_from_environment({}, None, lambda: 1)


def test_slots_zero_needs_num_procs_and_names_skypilot():
    hosts = parse_hostfile_text("a slots=0\nb slots=0\n")
    assert select_slots(hosts, num_procs=2) == {"a": [0, 1], "b": [0, 1]}
    with pytest.raises(ValueError, match="slots=0.*SKYPILOT_NUM_GPUS_PER_NODE.*--num_procs"):
        select_slots(hosts)


def test_cli_flags_one_host_force_multi_and_unknown_flags(tmp_path):
    """Dry runs: a one-host hostfile of this machine is local unless --force_multi; DeepSpeed's -H works; an
    unknown flag is named instead of being taken for the script; --launcher_args needs a launcher that takes it."""
    from click.testing import CliRunner

    from dsrun.launcher.cli import cli
    (tmp_path / "hosts").write_text("127.0.0.1 slots=2\n")
    (tmp_path / "s.py").write_text("")
    base = ["-H", str(tmp_path / "hosts"), "--dry_run"]

    def said(args):
        result = CliRunner().invoke(cli, args)
        return result.exit_code, " ".join(result.output.split())
    code, out = said([*base, str(tmp_path / "s.py")])
    assert code == 0 and "127.0.0.1, is this machine: running its ranks here without SSH" in out
    code, out = said([*base, "--force_multi", str(tmp_path / "s.py")])
    assert code == 0 and "without SSH" not in out
    code, out = said(["--no_python", str(tmp_path / "s.py")])
    assert code == 2 and "no such option: --no_python" in out
    code, out = said([*base, "--launcher_args", "-v", str(tmp_path / "s.py")])
    assert code == 2 and "--launcher_args goes to mpirun, mpiexec or srun" in out
    code, out = said(["--no_ssh", "--max_restarts", "1", *base, str(tmp_path / "s.py")])
    assert code == 2 and "restart the job from the cluster manager" in out
