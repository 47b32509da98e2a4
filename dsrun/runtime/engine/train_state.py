"""What the engine hands its checkpointer and its telemetry instead of itself.

`TrainState` is the loop's counters (a load restores them); `TrainingParts`
bundles them with the model, the strategy, the topology and the config, so
that neither the checkpointer nor the telemetry holds (or imports) the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dsrun.runtime.config import DsConfig
from dsrun.runtime.strategy.data_parallel import GradientStrategy
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.parallel.mesh import ParallelMesh


@dataclasses.dataclass
class TrainState:
    """Counters of one training run (DeepSpeed's engine attributes of the same names).

    Attributes:
        global_steps: optimizer steps attempted (applied or skipped).
        global_samples: samples consumed by those steps, over all ranks.
        skipped_steps: steps skipped for inf/nan gradients (fp16 overflow).
        micro_steps: forward/backward passes (micro-batches) of this rank.
    """

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    micro_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        """The counters by name (JSON-ready)."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore counters saved by `state_dict`.

        Raises:
            KeyError: `state` names a counter this class does not have.
        """
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise KeyError(f"unknown training counter(s) {unknown}; known: {sorted(names)}")
        for name, value in state.items():
            setattr(self, name, int(value))


@dataclasses.dataclass(frozen=True)
class ModelSplit:
    """How the model is split across ranks when each rank holds one part of
    it (a pipeline stage): what a checkpoint needs to write every tensor
    once and to check names against the whole model.

    Attributes:
        replicas: the ranks holding the same part as this one (the data
            axis of its stage), as an object with .group (torch process
            group), .rank and .size (dsrun.runtime.zero.groups.RankGroup):
            they split the writing of the tensors they hold alike.
        parts_group: the torch process group of the ranks holding the other
            parts with this rank's replica index (the pipe axis), this one
            included; None when there is one part.
        parts: the number of parts (pipeline stages).
        part_ranks: the global rank holding each part in `parts_group`
            (index: the part), this rank's entry included.
        duplicates: names of this rank's parameters that another part also
            holds and writes (weights tied across stages, on every stage but
            the lowest that holds them): written once, by that part, and
            read by name into every copy on load.
    """

    replicas: Any
    parts_group: Any
    parts: int
    part_ranks: tuple[int, ...] = ()
    duplicates: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """The engine's training state, by reference (nothing is copied).

    Attributes:
        module: the wrapped model.
        strategy: how it is trained (gradient reduction, optimizer step); it
            also says what it holds for a checkpoint (`checkpoint_pieces`, ...).
        topology: this rank's place in the job.
        config: the resolved DsConfig.
        state: the loop's counters.
        mesh: the job's ParallelMesh (the engine's; checkpoints read the
            tensor-parallel and data axes from it).
        split: how the model is split across ranks (a pipeline), or None
            when every rank holds the whole model.
        stateful: name -> object with state_dict()/load_state_dict() of
            JSON data, saved in every checkpoint under its name and restored
            by a load (curriculum schedulers: see
            Engine.register_checkpoint_state).
    """

    module: torch.nn.Module
    strategy: GradientStrategy
    topology: Topology
    config: DsConfig
    state: TrainState
    mesh: ParallelMesh
    split: ModelSplit | None = None
    stateful: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer
