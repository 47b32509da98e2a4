"""Curriculum data sampling (`data_efficiency.data_sampling.curriculum_learning`)
with difficulty metrics computed in memory.

Li et al., "DeepSpeed Data Efficiency: Improving Deep Learning Model
Quality and Training Efficiency via Efficient Data Sampling and Routing"
(AAAI 2024), section 3.1. DeepSpeed computes each metric offline (its data
analyzer writes index files) and keeps clusters of samples as files. dsrun
computes a metric by calling a function on every sample once, when the
loader is built, and keeps one value per sample in memory (8 bytes each).

[Note: curriculum sampling]
Each optimizer step s = 1, 2, ... draws one global batch of
train_batch_size samples. Every metric's CurriculumScheduler moves to its
difficulty at s (`update_difficulty(s)`, DeepSpeed's counting); a sample
is eligible when, for every metric, its value is <= the difficulty
("value"), or it is among the first floor(N x difficulty / max_difficulty)
samples in the metric's ascending order ("percentile"; ties keep dataset
order; DeepSpeed counts floor(N / max_difficulty) x difficulty, none at all
when N < max_difficulty), or the metric is "single_cluster". The global batch is drawn from the eligible samples
without replacement (with replacement when fewer than the batch are
eligible) by a generator seeded with (data_efficiency.seed, s): the same
batch on every rank without communication, and the same after a resume,
since the step number alone decides it. Data rank r takes, for its k-th
micro-batch of the step, the samples [k*M*D + r*M, k*M*D + (r+1)*M) of the
global batch (M micro-batch size, D data-parallel ranks), so the ranks
read disjoint samples. DeepSpeed instead walks each new cluster of samples
in a shuffled order before repeating one; here a step may repeat a sample
an earlier step drew (a draw is uniform over the eligible set every step).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, default_collate

from dsrun.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler


def metric_values(dataset: Dataset, fn: Callable[[Any], float]) -> torch.Tensor:
    """fn(dataset[i]) for every sample, as a float64 tensor of shape [len(dataset)].

    Raises:
        TypeError: fn returned something that is not a real number (the
            message names the sample).
    """
    values = []
    for i in range(len(dataset)):
        value = fn(dataset[i])
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"the difficulty metric returned {type(value).__name__} for sample {i}; "
                            "return one number per sample")
        values.append(float(value))
    return torch.tensor(values, dtype=torch.float64)


def import_metric(path: str) -> Callable[[Any], float]:
    """The function named by a config's metric_fn, "package.module:function".

    Raises:
        ValueError: `path` has no ":" or does not name a callable.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"metric_fn {path!r}: write it as \"package.module:function\"")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"metric_fn {path!r}: {module_name} has no function {attr}")
    return fn


class CurriculumSampler:
    """The global batch of each optimizer step (see [Note: curriculum sampling]).

    Args:
        metrics: metric name -> value of every sample (float tensor [N]).
        config: the `curriculum_learning` section of data_sampling
            (DataSamplingCurriculumConfig): each metric's difficulty type,
            clustering type and schedule.
        global_batch: samples per optimizer step over all data ranks.
        seed: data_efficiency.seed.

    Attributes:
        step: optimizer steps drawn so far (the next draw is step + 1).
        schedulers: metric name -> its CurriculumScheduler.
    """

    def __init__(self, metrics: dict[str, torch.Tensor], config, global_batch: int, seed: int) -> None:
        missing = sorted(set(config.curriculum_metrics) - set(metrics))
        if missing:
            raise ValueError(f"no values for curriculum metric(s) {missing}: give each a metric_fn in the config "
                             "or a function in engine.deepspeed_io(difficulty_metrics=)")
        sizes = {len(v) for v in metrics.values()}
        if len(sizes) != 1:
            raise ValueError(f"the curriculum metrics have different lengths {sorted(sizes)}; one value per sample")
        self.num_samples = sizes.pop()
        self.global_batch = global_batch
        self.seed = seed
        self.step = 0
        self._metrics = {name: config.curriculum_metrics[name] for name in config.curriculum_metrics}
        self._values = {name: metrics[name] for name in self._metrics}
        self._order = {name: torch.argsort(v, stable=True) for name, v in self._values.items()}
        self.schedulers = {name: CurriculumScheduler(m) for name, m in self._metrics.items()}

    def set_custom_curriculum_learning_schedule(self, schedule: Callable | dict) -> bool:
        """Give the metrics of schedule_type "custom" their function (one for
        all, or a dict by metric name). Returns whether any took one."""
        taken = False
        for name, scheduler in self.schedulers.items():
            fn = schedule.get(name) if isinstance(schedule, dict) else schedule
            if fn is not None and scheduler.state["schedule_type"] == "custom":
                scheduler.set_custom_get_difficulty(fn)
                taken = True
        return taken

    def eligible(self) -> torch.Tensor:
        """Indices (int64, ascending) of the samples every metric allows at the current difficulties."""
        allowed = torch.ones(self.num_samples, dtype=torch.bool)
        for name, metric in self._metrics.items():
            if metric.clustering_type == "single_cluster":
                continue
            difficulty = self.schedulers[name].get_current_difficulty()
            if metric.difficulty_type == "value":
                allowed &= self._values[name] <= difficulty
            else:
                count = self.num_samples * min(difficulty, metric.max_difficulty) // metric.max_difficulty
                mask = torch.zeros(self.num_samples, dtype=torch.bool)
                mask[self._order[name][:count]] = True
                allowed &= mask
        return allowed.nonzero().flatten()

    def draw(self, step: int) -> list[int]:
        """The global batch of optimizer step `step` (1-based); moves the
        schedulers to it.

        Raises:
            RuntimeError: no sample is eligible at this step's difficulties.
        """
        for scheduler in self.schedulers.values():
            scheduler.update_difficulty(step)
        pool = self.eligible()
        if len(pool) == 0:
            now = {n: s.get_current_difficulty() for n, s in self.schedulers.items()}
            raise RuntimeError(f"curriculum step {step}: no sample has difficulties within {now}; raise the "
                               "metrics' min_difficulty (the easiest sample must be eligible at the start)")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if len(pool) >= self.global_batch:
            picked = torch.randperm(len(pool), generator=generator)[:self.global_batch]
        else:
            picked = torch.randint(len(pool), (self.global_batch,), generator=generator)
        self.step = step
        return pool[picked].tolist()

    def state_dict(self) -> dict[str, Any]:
        """{"step", "schedulers": {name: state}} (JSON data)."""
        return {"step": self.step, "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after a `state_dict()`; custom schedule functions are kept."""
        self.step = int(state["step"])
        for name, scheduler_state in state["schedulers"].items():
            self.schedulers[name].load_state_dict(scheduler_state)


class CurriculumDataLoader:
    """This data rank's micro-batches under curriculum sampling (see [Note:
    curriculum sampling]); the engine's loader when the config enables it.

    Args:
        dataset: a map-style Dataset.
        sampler: the CurriculumSampler (its global_batch = micro_batch_size
            x gradient_accumulation_steps x data_size).
        micro_batch_size, gradient_accumulation_steps: the config's.
        data_rank, data_size: this rank's place on the data axis.
        collate_fn: merges samples into a batch (default: torch's).
        num_epochs: the loader ends after num_epochs x len(dataset)
            samples' worth of whole steps (DeepSpeed's data_sampling.num_epochs).

    `state_dict()` is {"epoch": 0, "batches"}, the micro-batches handed out
    (the sampler's state is saved beside it: the engine registers it).
    """

    def __init__(self, dataset: Dataset, sampler: CurriculumSampler, micro_batch_size: int,
                 gradient_accumulation_steps: int, data_rank: int, data_size: int,
                 collate_fn: Callable[[list], Any] | None = None, num_epochs: int = 1) -> None:
        if sampler.global_batch != micro_batch_size * gradient_accumulation_steps * data_size:
            raise ValueError(f"the sampler draws {sampler.global_batch} samples per step, but micro-batch "
                             f"{micro_batch_size} x {gradient_accumulation_steps} accumulation steps x "
                             f"{data_size} data ranks = {micro_batch_size * gradient_accumulation_steps * data_size}")
        self.dataset, self.sampler = dataset, sampler
        self.micro_batch_size, self.gas = micro_batch_size, gradient_accumulation_steps
        self.data_rank, self.data_size = data_rank, data_size
        self.collate_fn = collate_fn or default_collate
        self.steps = max(1, num_epochs * len(dataset) // sampler.global_batch)
        self._batches = 0  # micro-batches handed out
        self._global: list[int] = []  # the current step's global batch

    def __len__(self) -> int:
        """Micro-batches this rank gets in all."""
        return self.steps * self.gas

    def __iter__(self) -> Iterator[Any]:
        while self._batches < len(self):
            step, k = divmod(self._batches, self.gas)
            if k == 0 or not self._global:
                self._global = self.sampler.draw(step + 1)
            lo = k * self.micro_batch_size * self.data_size + self.data_rank * self.micro_batch_size
            indices = self._global[lo:lo + self.micro_batch_size]
            self._batches += 1  # counted before the batch is used: a checkpoint taken now resumes after it
            yield self.collate_fn([self.dataset[i] for i in indices])

    def state_dict(self) -> dict[str, int]:
        """{"epoch": 0, "batches": micro-batches handed out} (JSON-able)."""
        return {"epoch": 0, "batches": self._batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after `state["batches"]` micro-batches (the step's global
        batch is drawn again: the step number decides it)."""
        self._batches = int(state["batches"])
        self._global = []


def build_curriculum_loader(dataset: Dataset, config, data_rank: int, data_size: int,
                            collate_fn: Callable | None = None,
                            difficulty_metrics: dict[str, Callable] | None = None) -> CurriculumDataLoader:
    """The engine's loader under `data_efficiency` curriculum sampling.

    Args:
        dataset: a map-style Dataset.
        config: the resolved DsConfig (its data_efficiency section enables
            curriculum sampling; its batch triple sizes the steps).
        data_rank, data_size: this rank's place on the data axis.
        difficulty_metrics: metric name -> function of a sample; a metric
            not given here uses its config metric_fn.

    Raises:
        ValueError: a metric has neither a function here nor a metric_fn.
    """
    de = config.data_efficiency
    section = de.data_sampling.curriculum_learning
    fns = dict(difficulty_metrics or {})
    for name, metric in section.curriculum_metrics.items():
        if name not in fns:
            if metric.metric_fn is None:
                raise ValueError(f"curriculum metric {name!r} has no function: set its metric_fn "
                                 "(\"package.module:function\") or pass engine.deepspeed_io(dataset, "
                                 f"difficulty_metrics={{{name!r}: fn}})")
            fns[name] = import_metric(metric.metric_fn)
    values = {name: metric_values(dataset, fns[name]) for name in section.curriculum_metrics}
    sampler = CurriculumSampler(values, section, config.train_batch_size, de.seed)
    return CurriculumDataLoader(dataset, sampler, config.train_micro_batch_size_per_gpu,
                                config.gradient_accumulation_steps, data_rank, data_size, collate_fn,
                                de.data_sampling.num_epochs)
