"""The `dsrun` command: parse the command line, build the job, run it through the head.

    dsrun [--num_procs N] [--master_port P] [--master_addr A] [--log_dir DIR]
          [--module] [--no_local_rank] [--grace_period S] [--hang_timeout S] [--autotuning tune|run]
          script.py [script args...]

Everything after the script is passed to it untouched, followed by
`--local_rank=N` as DeepSpeed's launcher does (`--no_local_rank`: not). Every launch, a
plain local one included, goes through `multinode.run_multinode`: there is
one code path whatever the flags (`--env`, `--print_env` and `--dry_run`
only add to it). `--autotuning` hands the command to dsrun/autotuning, which
runs each trial as such a launch. `--max_restarts N` runs that launch again
after a failure (dsrun/launcher/restart.py, docs/restarts.md).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import click
from rich.console import Console

from dsrun.launcher.hostfile import MAX_SLOTS
from dsrun.launcher.job import DEFAULT_HANG_TIMEOUT, DEFAULT_RENDEZVOUS_TIMEOUT
from dsrun.launcher.multinode import MultinodeOptions, RankCommand, multinode_options, run_multinode

# dsrun's own messages go to stderr; rank output is passed through untouched.
console = Console(stderr=True, highlight=False)


def _positive_count(_ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(
            f"{value} is not a number of processes; give 1 or more (or leave it out to use one per visible GPU)",
            param=param,
        )
    if value is not None and value > MAX_SLOTS:
        raise click.BadParameter(f"{value} ranks on one machine is more than dsrun's limit of {MAX_SLOTS}",
                                 param=param)
    return value


def _finite_seconds(_ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds; give a finite number, e.g. 10", param=param)
    return value


def rank_command(script: str, script_args: tuple[str, ...], module: bool) -> list[str]:
    """argv of every rank: this Python, unbuffered, running the script (or module) with its args."""
    target = ["-m", script] if module else [script]
    return [sys.executable, "-u", *target, *script_args]


@click.command(
    context_settings=dict(
        ignore_unknown_options=True, allow_interspersed_args=False, help_option_names=["-h", "--help"]
    )
)
@multinode_options
@click.option(
    "--num_procs", "--num_gpus", "--num_accelerators", "num_procs", type=int, default=None,
    callback=_positive_count, help="Ranks to start on this machine [default: one per visible GPU, else 1].",
)
@click.option("--master_port", type=click.IntRange(1, 65535), default=None,
              help="Rendezvous port [default: 29500, or a free port if 29500 is busy].")
@click.option("--master_addr", default=None,
              help="Rendezvous address (rank 0's host) [default: 127.0.0.1; with several nodes the first host].")
@click.option("--rendezvous_timeout", type=click.FloatRange(min=1), default=DEFAULT_RENDEZVOUS_TIMEOUT,
              show_default=True, callback=_finite_seconds,
              help="Seconds the ranks wait for each other at start-up; then every rank fails naming the "
                   "ranks that never arrived.")
@click.option("--hang_timeout", type=click.FloatRange(min=0), default=DEFAULT_HANG_TIMEOUT, show_default=True,
              callback=_finite_seconds,
              help="Seconds a rank may make no progress (no collective or engine step), once it made some, "
                   "before the job fails with every rank's stacks and last collective; 0: off (docs/launcher.md).")
@click.option("--log_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write each rank's output to DIR/rank_N.log.")
@click.option("--module", is_flag=True, help="Run SCRIPT as a module (python -m SCRIPT).")
@click.option("--no_local_rank", is_flag=True,
              help="Do not append --local_rank=N to the script's arguments (DeepSpeed's flag; by default "
                   "dsrun appends it, as DeepSpeed's launcher does). The rank's LOCAL_RANK is set either way.")
@click.option("--pass_local_rank", is_flag=True, hidden=True, help="Append --local_rank=N (the default).")
@click.option("--grace_period", type=click.FloatRange(min=0), default=10.0, show_default=True,
              callback=_finite_seconds, help="Seconds between SIGTERM and SIGKILL when stopping ranks.")
@click.option("--autotuning", type=click.Choice(["tune", "run"]), default=None,
              help="Try settings of the config's `autotuning` section (ZeRO stage, micro-batch, offload) as short "
                   "runs and write the fastest that fits as ds_config_optimal.json; run: then train with it "
                   "(docs/autotuning.md).")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def cli(
    ctx: click.Context,
    num_procs: int | None,
    master_port: int | None,
    master_addr: str | None,
    rendezvous_timeout: float,
    hang_timeout: float,
    log_dir: Path | None,
    module: bool,
    no_local_rank: bool,
    pass_local_rank: bool,
    grace_period: float,
    autotuning: str | None,
    script: str,
    script_args: tuple[str, ...],
    multinode: MultinodeOptions,
) -> None:
    """Launch SCRIPT as a distributed job: one process per rank, torch.distributed environment set."""
    if no_local_rank and pass_local_rank:
        raise click.UsageError("--no_local_rank and --pass_local_rank contradict each other; give one")
    if script.startswith("-") and not Path(script).is_file():
        # ignore_unknown_options lets the script's own flags through, so an unknown dsrun flag lands here.
        raise click.UsageError(f"no such option: {script} (dsrun's flags come before the script; `dsrun --help` "
                               "lists them, docs/migrating.md maps DeepSpeed's launcher flags)")
    if not module and Path(script).is_dir():
        raise click.BadParameter(f"'{script}' is a directory; give the path of the training script (a .py file), "
                                 "or pass --module to run a package by name", param_hint="SCRIPT")
    if not module and not Path(script).is_file():
        raise click.BadParameter(
            f"file '{script}' does not exist (looked relative to {Path.cwd()}); give the path of the "
            "training script, or pass --module to run a module by name",
            param_hint="SCRIPT",
        )
    if log_dir is not None:
        try:
            log_dir = log_dir.resolve()
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.BadParameter(f"cannot create '{log_dir}': {exc.strerror}", param_hint="--log_dir") from exc
    if autotuning is not None:  # imported here: the tuner needs torch, a plain launch does not
        from dsrun.autotuning.trial import Job
        from dsrun.autotuning.tuner import autotune
        argv = (ctx.obj or {}).get("argv", sys.argv[1:])
        ctx.exit(autotune(autotuning, Job.from_argv(argv, script, script_args), console))
    ctx.exit(run_multinode(multinode, RankCommand(
        rank_command(script, script_args, module), num_procs, master_addr, master_port, grace_period,
        not no_local_rank, str(log_dir) if log_dir else None, rendezvous_timeout, hang_timeout), console))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`dsrun`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cli.main(args=argv, prog_name="dsrun", obj={"argv": argv})


if __name__ == "__main__":
    main()
