"""Slurm/MPI variable parsing, mpirun commands, env propagation and the sbatch script (fast, no daemons)."""
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.launcher.mpi import SchedulerEnvError, mpirun_command, mpirun_env, rank_env_from_scheduler
from dsrun.launcher.placement import build_placement, derived_port
from dsrun.launcher.propagate import EnvFileError, masked, propagated_env
from dsrun.launcher.sbatch import batch_script
from dsrun.launcher.slurm import (SlurmError, allocation_from_env, expand_nodelist, per_node_counts,
                                  slurm_task_env, split_nodelist)

ROOT = Path(__file__).resolve().parents[2]


def test_nodelist_expansion_without_scontrol():
    assert split_nodelist("n[01-03,07],gpu1,r[1-2]c[1-2]") == ["n[01-03,07]", "gpu1", "r[1-2]c[1-2]"]
    assert expand_nodelist("n[01-03,07],gpu1", use_scontrol=False) == ["n01", "n02", "n03", "n07", "gpu1"]
    with pytest.raises(SlurmError, match="descending"):
        expand_nodelist("n[3-1]", use_scontrol=False)


def test_per_node_counts():
    assert per_node_counts("4(x2),2", 3) == [4, 4, 2]
    assert per_node_counts("8", 2) == [8, 8]
    with pytest.raises(SlurmError, match="gives 2 values for 3"):
        per_node_counts("4(x2)", 3)
    with pytest.raises(SlurmError, match="cannot read"):
        per_node_counts("4x2", 2)


def test_allocation_from_env():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NNODES": "2",
           "SLURM_JOB_CPUS_PER_NODE": "32(x2)", "SLURM_GPUS_ON_NODE": "4"}
    alloc = allocation_from_env(env)
    assert alloc.nodes[:1] and alloc.cpus_per_node == (32, 32) and alloc.gpus_per_node == 4
    assert alloc.ranks_per_node(None) == [4, 4] and alloc.ranks_per_node(2) == [2, 2]
    assert allocation_from_env({**env, "SLURM_NTASKS_PER_NODE": "3"}).ranks_per_node(None) == [3, 3]
    assert alloc.default_port() == derived_port("77")
    with pytest.raises(SlurmError, match="inside a Slurm allocation"):
        allocation_from_env({})


def test_slurm_task_env_only_inside_a_step():
    batch = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "5"}
    assert slurm_task_env(batch) == {}  # the batch script's own shell is not a rank
    step = {**batch, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "head"}
    assert slurm_task_env(step) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_PORT": str(derived_port("5"))}


def test_mpi_rank_env_sources_and_precedence():
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    assert rank_env_from_scheduler(ompi) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                             "LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "4"}
    hydra = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert rank_env_from_scheduler(hydra)["RANK"] == "2"
    assert rank_env_from_scheduler({**hydra, "RANK": "0"}) == {}  # dsrun/torchrun already set it
    assert rank_env_from_scheduler({**hydra, "LOCAL_RANK": "1"}).get("LOCAL_RANK") is None  # never overridden
    with pytest.raises(SchedulerEnvError, match="no world size"):
        rank_env_from_scheduler({"PMIX_RANK": "0"})
    assert rank_env_from_scheduler({}) == {}


def test_mpirun_commands_pass_names_not_values():
    placement = build_placement({"a": [0, 1], "b": [0, 1]})
    cmd = mpirun_command("openmpi", placement, ["python", "t.py"], ["HF_TOKEN"])
    assert cmd[:5] == ["mpirun", "-n", "4", "--host", "a:2,b:2"]
    assert ["-x", "HF_TOKEN"] == cmd[cmd.index("HF_TOKEN") - 1:cmd.index("HF_TOKEN") + 1]
    assert cmd[-5:] == [sys.executable, "-m", "dsrun.launcher.mpi", "python", "t.py"]
    hydra = mpirun_command("mpich", placement, ["python", "t.py"], ["HF_TOKEN"])
    assert hydra[:5] == ["mpiexec", "-n", "4", "-hosts", "a:2,b:2"]
    assert hydra[hydra.index("-genvlist") + 1] == "HF_TOKEN,MASTER_ADDR,MASTER_PORT"
    env = mpirun_env({"PATH": "/bin"}, {"HF_TOKEN": "secret"}, "a", 1234)
    assert env == {"PATH": "/bin", "HF_TOKEN": "secret", "MASTER_ADDR": "a", "MASTER_PORT": "1234"}
    assert "secret" not in " ".join(cmd + hydra)
    # --launcher_args: after dsrun's options, before the program (as DeepSpeed's runner places them)
    extra = mpirun_command("openmpi", placement, ["python", "t.py"], [], ["--allow-run-as-root", "--mca", "x", "y"])
    assert extra[-9:-5] == ["--allow-run-as-root", "--mca", "x", "y"]
    assert mpirun_command("mpich", placement, ["python", "t.py"], [], ["-v"])[-6] == "-v"


def test_mpi_shim_sets_rank_and_execs():
    env = {"PATH": "/usr/bin:/bin", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, "-m", "dsrun.launcher.mpi", sys.executable, "-c",
                          "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'])"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "2"], out.stderr


def test_propagated_env_rules(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("# comment\n\nA=home\nB=home\n")
    (cwd / ".dsrun_env").write_text("export B='cwd value'\nC=\"x=y\"\n")
    environ = {"NCCL_DEBUG": "INFO", "HF_TOKEN": "t", "PYTHONPATH": "/p", "HOME": "/h", "SECRET": "no"}
    env = propagated_env(environ, cwd, ["C=flag", "D="], home=home)
    assert env == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "t", "PYTHONPATH": "/p", "A": "home", "B": "cwd value",
                   "C": "flag", "D": ""}
    assert masked({"HF_TOKEN": "abc"}) == ["HF_TOKEN=<3 chars>"]
    (cwd / ".dsrun_env").write_text("GOOD=1\nnot a line\n")
    with pytest.raises(EnvFileError, match=r"\.dsrun_env:2: expected NAME=VALUE"):
        propagated_env({}, cwd, home=home)
    with pytest.raises(EnvFileError, match="--env"):
        propagated_env({}, home, ["1BAD=x"], home=home)


def test_batch_script_text_and_cli_errors(tmp_path):
    text = batch_script(nodes=2, ranks_per_node=8, gpus_per_node=8, time="04:00:00", partition="gpu", job_name="gpt",
                        output=None, cwd="/work dir", python="/venv/bin/python", dsrun_args=["--grace_period=5"],
                        command=["train.py", "--config", "c.json"])
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n#SBATCH --gpus-per-node=8\n" in text
    assert "cd '/work dir'\n" in text
    assert text.rstrip().endswith("exec /venv/bin/python -m dsrun.launcher.cli --launcher slurm "
                                  "--grace_period=5 train.py --config c.json")
    bad = subprocess.run([sys.executable, "-m", "dsrun.launcher.sbatch", "--nodes", "1", "--time", "4h",
                          "tests/multinode/scripts/allreduce_train.py"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "not a Slurm time" in bad.stderr


def _requeue_script(tmp_path: Path, max_requeues: int, signal_lead: int | None = 120) -> Path:
    """A generated batch script whose 'python' is a stand-in dsrun (exits with $FAKE_EXIT, or sleeps with 'sleep')."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/bash\ntrap 'echo TERM >> \"$LOG\"; kill $!; exit 143' TERM\necho \"started $*\" >> \"$LOG\"\n"
                    "if [ \"$FAKE_EXIT\" = sleep ]; then sleep 60 >/dev/null 2>&1 & wait; fi\nexit \"$FAKE_EXIT\"\n")
    (tmp_path / "bin").mkdir(exist_ok=True)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text("#!/bin/bash\necho \"scontrol $*\" >> \"$LOG\"\n")
    for f in (fake, scontrol):
        f.chmod(0o755)
    text = batch_script(nodes=2, ranks_per_node=1, gpus_per_node=0, time="10", partition=None, job_name="j",
                        output=None, cwd=str(tmp_path), python=str(fake), dsrun_args=[], command=["train.py"],
                        max_requeues=max_requeues, signal_lead=signal_lead)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    return path


@pytest.mark.parametrize("fake_exit, restarts, send, requeued, status", [
    ("0", "0", None, False, 0),        # success: done
    ("1", "0", None, True, 0),         # failure: requeue
    ("1", "2", None, False, 1),        # failure, --max-requeues used up: fail
    ("sleep", "0", "USR1", True, 0),   # the --signal lead time: stop dsrun, requeue
    ("sleep", "0", "TERM", False, 143),  # scancel or preemption: stop dsrun, Slurm decides
])
def test_requeue_script_behaviour(tmp_path, fake_exit, restarts, send, requeued, status):
    import signal
    import time
    script = _requeue_script(tmp_path, max_requeues=2)
    log = tmp_path / "log"
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "LOG": str(log), "FAKE_EXIT": fake_exit,
           "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": restarts}
    proc = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    if send:
        deadline = time.monotonic() + 10
        while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(getattr(signal, f"SIG{send}"))
    _, err = proc.communicate(timeout=20)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("started -m dsrun.launcher.cli --launcher slurm train.py")
    assert ("scontrol requeue 42" in lines) == requeued, (lines, err)
    assert ("TERM" in lines) == (send is not None), lines
    assert proc.returncode == status, err
    if fake_exit == "1" and not requeued:
        assert "2 of 2 requeues used" in err


def test_requeue_directives_and_cli_checks(tmp_path):
    text = _requeue_script(tmp_path, max_requeues=3, signal_lead=120).read_text()
    assert "#SBATCH --requeue\n#SBATCH --open-mode=append\n#SBATCH --signal=B:USR1@120\n" in text
    assert "max_requeues=3" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    plain = batch_script(nodes=1, ranks_per_node=1, gpus_per_node=0, time=None, partition=None, job_name="j",
                         output=None, cwd="/w", python="/py", dsrun_args=[], command=["t.py"])
    assert "--requeue" not in plain and "--signal" not in plain and "\nexec /py -m dsrun.launcher.cli" in plain
    bad = subprocess.run([sys.executable, "-m", "dsrun.launcher.sbatch", "--nodes", "1", "--signal", "120",
                          "--script", str(tmp_path / "x.sbatch"), "tests/multinode/scripts/allreduce_train.py"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "give --time too" in bad.stderr, bad.stderr


def test_srun_agent_argv_takes_launcher_args():
    """--launcher_args go into each node's srun after dsrun's options (srun lets a later option win)."""
    from dsrun.launcher.placement import node_jobs
    from dsrun.launcher.slurm import srun_agent_argv
    alloc = allocation_from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_CPUS_PER_NODE": "4"})
    job, = node_jobs(build_placement({"n1": [0]}), job_id="j", master_addr="n1", master_port=1, command=["python"],
                     cwd="/", env={}, grace_period=1, pass_local_rank=False, log_dir=None, visible_devices=False,
                     rendezvous_timeout=1)
    argv = srun_agent_argv(job, alloc, "python3", ["--cpus-per-task=2", "--mpi=none"])
    assert argv[-5:] == ["--cpus-per-task=2", "--mpi=none", "python3", "-m", "dsrun.launcher.agent"]
    assert "--cpus-per-task=4" in argv[:-5]
