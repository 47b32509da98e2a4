"""The tuning loop of `dsrun --autotuning tune|run` (docs/autotuning.md).

1. The baseline trial runs the user's own config. It measures the model
   (parameters, world size) and the machines (memory), which the candidates
   and the memory model need, and it is the figure to beat.
2. `space.generate` lists the candidates; `prune.prune` rules out those the
   memory model says cannot fit (they are never launched and are listed as
   "pruned" with the estimate); `space.spread` keeps
   `num_tuning_micro_batch_sizes` micro-batch sizes per setting.
3. `search.Search` orders the trials and stops; each trial is a real launch
   (trial.py), shown in the live table as it runs.
4. The best trial by `autotuning.metric` is written as
   results_dir/ds_config_optimal.json, every trial to results_dir/summary;
   `run` then launches the training with the optimal config.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import click
import pydantic
import yaml
from rich.console import Console

from dsrun.autotuning.prune import MemoryBudget, MemoryModel, prune
from dsrun.autotuning.report import (
    LiveTable,
    TrialRecord,
    best_record,
    render,
    write_optimal,
    write_summary,
)
from dsrun.autotuning.search import Search
from dsrun.autotuning.space import base_candidate, generate, spread
from dsrun.autotuning.trial import (
    Job,
    TrialOutcome,
    dsrun_command,
    find_config_arg,
    run_trial,
    script_args_for,
)
from dsrun.launcher.failure import exit_status
from dsrun.runtime.config.sections import AutotuningConfig

MODES = ("tune", "run")


def read_base_config(path: Path) -> dict[str, Any]:
    """The user's ds_config as plain data (JSON, or YAML for .yaml/.yml).

    Raises:
        click.UsageError: the file cannot be read or is not a mapping.
    """
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise click.UsageError(f"dsrun --autotuning: cannot read the config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise click.UsageError(f"dsrun --autotuning: {path} holds {type(data).__name__}, not a ds_config object")
    return data


def tuning_section(base: dict[str, Any], path: Path) -> AutotuningConfig:
    """The config's `autotuning` section, validated (every key has DeepSpeed's default when left out).

    Raises:
        click.UsageError: a key of the section is unknown or has a bad value.
    """
    try:
        return AutotuningConfig.model_validate(base.get("autotuning") or {})
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"autotuning.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(f"dsrun --autotuning: {path}: {problems}") from exc


def _apply(record: TrialRecord, outcome: TrialOutcome) -> None:
    record.status, record.result, record.reason, record.seconds = (outcome.status, outcome.result, outcome.reason,
                                                                   outcome.seconds)


def autotune(mode: str, job: Job, console: Console) -> int:
    """Tune (and with mode "run", then train); returns dsrun's exit status.

    Raises:
        click.UsageError: no config argument, an unreadable config, a bad
            autotuning section, or an mp_size that does not divide the world.
    """
    try:
        _, config_arg = find_config_arg(job.script_args)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    config_path = Path(config_arg)
    base = read_base_config(config_path)
    tuning = tuning_section(base, config_path)
    exps_dir, results_dir, metric = Path(tuning.exps_dir), Path(tuning.results_dir), tuning.metric

    def trial(name: str, config: dict[str, Any], ckpt: bool | None) -> TrialOutcome:
        return run_trial(job, name, config, exps_dir, arg_mappings=tuning.arg_mappings, activation_checkpointing=ckpt,
                         end_profile_step=tuning.end_profile_step, overwrite=tuning.overwrite)

    console.print(f"dsrun autotuning: baseline trial (your config {config_path}); trials in {exps_dir}/")
    outcome = trial("baseline", {**base, "autotuning": {**(base.get("autotuning") or {}), "enabled": True}}, None)
    if outcome.result is None:
        console.print(f"dsrun autotuning: the baseline trial (your own config) failed: {outcome.reason}\n"
                      f"  the tuner needs it to measure the model and the machines; see {exps_dir / 'baseline'}/",
                      markup=False, highlight=False)
        return 1
    res = outcome.result
    if res.world_size % tuning.mp_size:
        raise click.UsageError(f"autotuning.mp_size {tuning.mp_size} does not divide the world size "
                               f"{res.world_size}; give a divisor of it")
    dp = res.world_size // tuning.mp_size
    baseline = TrialRecord(base_candidate(base, dp, res.micro_batch, res.grad_accum), baseline=True)
    _apply(baseline, outcome)

    offloads = ("none", "cpu") if res.device != "cpu" else ("none",)
    candidates = [c for c in generate(tuning, base, dp, offloads) if c != baseline.candidate]
    fits, ruled_out = prune(candidates, MemoryModel.from_baseline(res, baseline.candidate, base, dp),
                            MemoryBudget.from_result(res))
    chosen = spread(fits, tuning.num_tuning_micro_batch_sizes)
    pending = {c: TrialRecord(c) for c in chosen}
    records = [baseline, *pending.values(), *(TrialRecord(c, "pruned", reason=why) for c, why in ruled_out)]
    console.print(f"dsrun autotuning: {res.num_params:,} parameters, {res.world_size} rank(s); "
                  f"{len(chosen)} trial(s) to run, {len(ruled_out)} candidate(s) ruled out by the memory estimate")

    search = Search(chosen, tuning.tuner_type, tuning.tuner_num_trials, tuning.tuner_early_stopping)
    with LiveTable(console, metric) as live:
        live.update(records, finished=baseline)
        while (candidate := search.next()) is not None:
            record = pending[candidate]
            record.status = "running"
            live.update(records)
            _apply(record, trial(candidate.name, candidate.apply(base, dp), candidate.activation_checkpointing))
            search.record(candidate, record.result.score(metric) if record.result else None)
            live.update(records, finished=record)
        why_not = (f"{tuning.tuner_early_stopping} trials without improvement (tuner_early_stopping)"
                   if search.stopped_early else f"tuner_num_trials ({tuning.tuner_num_trials}) reached")
        for record in records:
            if record.status == "pending":
                record.status, record.reason = "skipped", why_not
        best = best_record(records, metric)
        live.update(records, best=best)
    if not console.is_terminal:
        console.print(render(records, metric, best), width=max(console.width, 120))
    summary = write_summary(results_dir, records, metric, best)
    if best is None:
        if any(r.status == "ok" for r in records):  # only the flops metric can be unknown
            console.print("dsrun autotuning: metric flops needs token ids among the model's inputs (an integer "
                          f"tensor of 2 or more dimensions), and this script's have none; use metric throughput "
                          f"or latency. See {summary}")
        else:
            console.print(f"dsrun autotuning: no trial succeeded; see {summary}")
        return 1
    best_config = best.candidate.apply(base, dp) if not best.baseline else base
    optimal = write_optimal(results_dir, best_config)
    console.print(f"dsrun autotuning: best {best.label} ({best.candidate.describe()}): "
                  f"{best.result.samples_per_s:,.1f} samples/s, {best.result.step_time * 1e3:,.1f} ms/step; "
                  f"config: {optimal}, summary: {summary}", markup=False, highlight=False)
    if mode == "tune":
        return 0
    console.print("dsrun autotuning: training with the optimal config")
    args = script_args_for(job.script_args, optimal, best_config, tuning.arg_mappings,
                           best.candidate.activation_checkpointing)
    return exit_status(subprocess.call(dsrun_command(job, args)))
