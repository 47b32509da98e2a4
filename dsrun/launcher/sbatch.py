"""`dsrun-sbatch`: write (and optionally submit) a Slurm batch script that runs a dsrun job.

    dsrun-sbatch --nodes 2 --gpus-per-node 8 --time 04:00:00 --partition gpu \\
        --job-name gpt --submit train.py --config cfg.json

The script asks Slurm for the nodes and one task slot per rank, then runs
`dsrun --launcher slurm` inside the allocation with the same Python and
working directory as this command, so the cluster job needs no hostfile
and no SSH. Without --submit the script is only written (default
`<job-name>.sbatch`) for users who keep job scripts in their repository.

[Note: requeue and the signal lead time]
`--requeue` makes the job requeue itself, at most `--max-requeues` times
(Slurm counts them in SLURM_RESTART_COUNT, which every rank also sees):
the script asks Slurm for a requeueable job (`#SBATCH --requeue`, so that
Slurm also requeues it after a node failure or a preemption with
PreemptMode=REQUEUE), appends to its output file (`--open-mode=append`:
every run's output stays), runs dsrun in the background and waits, and when
dsrun fails it runs `scontrol requeue $SLURM_JOB_ID`: the job goes back to
the queue and starts again from the top of the script, where the training
script's checkpoint `auto_resume` picks up the newest checkpoint.
`--signal S` asks Slurm to send the batch shell SIGUSR1 S seconds before
the time limit (`#SBATCH --signal=B:USR1@S`; Slurm may send it up to a
minute earlier); the script then stops dsrun with SIGTERM (its ranks get
`--grace_period` to finish; a rank may save a checkpoint then) and, with
`--requeue`, requeues the job. A SIGTERM to the batch shell (scancel,
preemption) stops dsrun the same way but never requeues from the script:
a cancelled job stays cancelled, a preempted one Slurm requeues itself.

Every value written into the script is checked (no newline or other
control character: one would start a new line of shell) and quoted with
`shlex.quote`, which both bash and sbatch's `#SBATCH` parser undo.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click

_TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_value(value: str, where: str) -> str:
    """Return `value` if it may be written into a batch script.

    Raises:
        click.BadParameter: `value` holds a newline or another control
            character (`where` names the option or argument it came from).
    """
    bad = _CONTROL.search(value)
    if bad:
        what = "a newline" if bad.group(0) in "\r\n" else f"the control character {bad.group(0)!r}"
        raise click.BadParameter(f"{value!r} contains {what}, which cannot be written into a batch script",
                                 param_hint=where)
    return value


def batch_script(*, nodes: int, ranks_per_node: int, gpus_per_node: int, time: str | None, partition: str | None,
                 job_name: str, output: str | None, cwd: str, python: str, dsrun_args: list[str],
                 command: list[str], max_requeues: int = 0, signal_lead: int | None = None) -> str:
    """The text of the batch script.

    Args:
        ranks_per_node: tasks per node (dsrun starts one rank per task).
        dsrun_args: extra dsrun options placed before the script (e.g. --grace_period 5).
        command: the training script and its arguments.
        max_requeues: with 1 or more, the job requeues itself when dsrun
            fails or the lead-time signal came, while SLURM_RESTART_COUNT is
            below it (see [Note: requeue and the signal lead time]).
        signal_lead: seconds before the time limit at which Slurm signals
            the script (SIGUSR1), which then stops dsrun; None: no signal.

    Raises:
        click.BadParameter: a value holds a newline or control character
            (see `check_value`).
    """
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={ranks_per_node}"]
    if gpus_per_node:
        directives.append(f"--gpus-per-node={gpus_per_node}")
    for flag, value in (("--time", time), ("--partition", partition), ("--output", output)):
        if value:
            directives.append(f"{flag}={check_value(value, flag)}")
    if max_requeues:
        directives += ["--requeue", "--open-mode=append"]
    if signal_lead is not None:
        directives.append(f"--signal=B:USR1@{signal_lead}")
    run = [check_value(python, "python"), "-m", "dsrun.launcher.cli", "--launcher", "slurm",
           *(check_value(a, "--dsrun-arg") for a in dsrun_args), *(check_value(a, "COMMAND") for a in command)]
    check_value(cwd, "working directory")
    head = [
        "#!/bin/bash",
        *(f"#SBATCH {shlex.quote(check_value(d, 'directive'))}" for d in directives),
        "# Written by dsrun-sbatch: dsrun reads the allocation (SLURM_JOB_NODELIST, tasks per node)",
        "# and starts one agent per node with srun; no hostfile, no SSH.",
    ]
    if not max_requeues and signal_lead is None:
        return "\n".join([*head, "set -euo pipefail", f"cd {shlex.quote(cwd)}", "exec " + shlex.join(run), ""])
    return "\n".join([*head, *_supervised_run(shlex.join(run), cwd, max_requeues), ""])


def _supervised_run(run: str, cwd: str, max_requeues: int) -> list[str]:
    """Script lines running dsrun in the background so signals reach the traps, then requeueing on failure."""
    lines = [
        "# dsrun runs in the background: bash runs a trap only between commands, and `wait` is one it leaves.",
        "set -uo pipefail",
        f"cd {shlex.quote(cwd)} || exit 1",
        'signalled=""; pid=""',
        "trap 'signalled=USR1; kill -TERM \"$pid\" 2>/dev/null' USR1  # --signal: the time limit is near",
        "trap 'signalled=TERM; kill -TERM \"$pid\" 2>/dev/null' TERM  # scancel or preemption",
        run + " &",
        "pid=$!",
        '[ -n "$signalled" ] && kill -TERM "$pid" 2>/dev/null  # a signal that came before pid was set',
        'wait "$pid"; status=$?',
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; status=$?; done  # a trap interrupted the wait',
    ]
    if max_requeues:
        lines += [
            f"max_requeues={max_requeues}",
            'restarts="${SLURM_RESTART_COUNT:-0}"',
            'if [ "$signalled" != TERM ] && { [ "$status" -ne 0 ] || [ "$signalled" = USR1 ]; }; then',
            '    if [ "$restarts" -lt "$max_requeues" ]; then',
            ('        echo "dsrun-sbatch: dsrun exited $status${signalled:+ after SIG$signalled}; requeueing job'
             ' $SLURM_JOB_ID (requeue $((restarts + 1)) of $max_requeues)" >&2'),
            '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
            "    else",
            ('        echo "dsrun-sbatch: dsrun exited $status; not requeueing: $restarts of $max_requeues'
             ' requeues used (--max-requeues)" >&2'),
            "    fi",
            "fi",
        ]
    return [*lines, 'exit "$status"']


@click.command(context_settings=dict(ignore_unknown_options=True, allow_interspersed_args=False,
                                     help_option_names=["-h", "--help"]))
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Number of nodes.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=0, show_default=True, help="GPUs per node.")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None,
              help="Ranks per node [default: --gpus-per-node, or 1 without GPUs].")
@click.option("--time", "time_limit", default=None, help="Time limit, Slurm format (e.g. 04:00:00 or 1-12:00:00).")
@click.option("--partition", default=None, help="Slurm partition.")
@click.option("--job-name", default="dsrun", show_default=True, help="Slurm job name.")
@click.option("--output", default=None, help="Slurm output file pattern (e.g. logs/%j.out).")
@click.option("--script", "script_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the batch script [default: <job-name>.sbatch].")
@click.option("--dsrun-arg", "dsrun_args", multiple=True, help="An option for dsrun itself (repeatable), e.g. --dsrun-arg=--grace_period=5.")
@click.option("--requeue", is_flag=True,
              help="Requeue the job when dsrun fails or the --signal lead time is reached (at most --max-requeues "
                   "times); the training script's checkpoint auto_resume then resumes it.")
@click.option("--max-requeues", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --requeue: how many times the job may requeue itself (SLURM_RESTART_COUNT).")
@click.option("--signal", "signal_lead", type=click.IntRange(1, 65535), default=None,
              help="Seconds before the time limit at which dsrun is stopped (SIGTERM to the ranks, --grace_period "
                   "to finish), so the job can requeue before Slurm kills it; needs --time.")
@click.option("--submit", is_flag=True, help="Submit the script with sbatch after writing it.")
@click.option("--wait", is_flag=True, help="With --submit: wait for the job to end and exit with its status (sbatch --wait).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def cli(nodes, gpus_per_node, ranks_per_node, time_limit, partition, job_name, output, script_path, dsrun_args,
        requeue, max_requeues, signal_lead, submit, wait, command) -> None:
    """Write a Slurm batch script running COMMAND (a training script and its arguments) with dsrun."""
    if time_limit and not _TIME.match(time_limit):
        raise click.BadParameter(f"{time_limit!r} is not a Slurm time; use MM, HH:MM:SS or D-HH:MM:SS", param_hint="--time")
    if not re.fullmatch(r"[\w.\-]+", job_name):
        raise click.BadParameter(f"{job_name!r}: use letters, digits, '.', '_' and '-'", param_hint="--job-name")
    if not Path(command[0]).is_file():
        raise click.BadParameter(f"training script {command[0]!r} does not exist (relative to {Path.cwd()})",
                                 param_hint="COMMAND")
    if wait and not submit:
        raise click.BadParameter("--wait only makes sense with --submit", param_hint="--wait")
    if signal_lead is not None and not time_limit:
        raise click.BadParameter("the lead time counts back from the time limit; give --time too", param_hint="--signal")
    text = batch_script(nodes=nodes, ranks_per_node=ranks_per_node or gpus_per_node or 1, gpus_per_node=gpus_per_node,
                        time=time_limit, partition=partition, job_name=job_name, output=output, cwd=str(Path.cwd()),
                        python=sys.executable, dsrun_args=list(dsrun_args), command=list(command),
                        max_requeues=max_requeues if requeue else 0, signal_lead=signal_lead)
    path = script_path or Path(f"{job_name}.sbatch")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)  # never leave a half-written script
    click.echo(f"dsrun-sbatch: wrote {path}", err=True)
    if not submit:
        return
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise click.ClickException(f"sbatch is not on PATH; submit {path} on a Slurm login node")
    proc = subprocess.run([sbatch, *(["--wait"] if wait else []), str(path)])
    sys.exit(proc.returncode)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`dsrun-sbatch`)."""
    cli.main(args=argv, prog_name="dsrun-sbatch")


if __name__ == "__main__":
    main()
