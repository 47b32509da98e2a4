"""What a checkpoint is taken of: the training parts the engine hands its checkpointer.

The save, load and export code reads the model, the strategy, the topology,
the config and the counters through one `CheckpointedParts`, never through
the engine: the strategy says what it holds (`GradientStrategy.checkpoint_pieces`,
`managed_params`, `scaler_state`, ...), so a new kind of parallelism plugs
in by implementing those methods, with no type test here.
"""
from __future__ import annotations

import dataclasses

import torch

from dsrun.runtime.checkpoint.pieces import HeldPiece, plain_pieces
from dsrun.runtime.config import DsConfig
from dsrun.runtime.data_parallel import GradientStrategy
from dsrun.runtime.dist import Topology
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.train_state import TrainState
from dsrun.runtime.zero.groups import RankGroup
from dsrun.runtime.zero.params import record_of


@dataclasses.dataclass(frozen=True)
class CheckpointedParts:
    """The engine's state a checkpoint holds (all references, nothing copied).

    Attributes:
        module: the wrapped model.
        strategy: how it is trained; reports the pieces it holds.
        topology: this rank's place in the job.
        config: the resolved DsConfig (its `checkpoint` and `aio` sections).
        state: the loop's counters (restored by a load).
    """

    module: torch.nn.Module
    strategy: GradientStrategy
    topology: Topology
    config: DsConfig
    state: TrainState

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    def held_pieces(self) -> list[HeldPiece]:
        """Every piece of the module this rank holds: the strategy's own
        (ZeRO partitions) and every other parameter and buffer whole."""
        managed = {id(p) for p in self.strategy.managed_params()}
        world = RankGroup(None, self.topology.rank, self.topology.world_size)
        return self.strategy.checkpoint_pieces() + plain_pieces(self.module, self.optimizer, managed, world)

    def global_names(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Name -> (global shape, frozen) of every parameter and persistent
        buffer (all ranks agree: read from the module)."""
        out = {}
        for name, p in self.module.named_parameters():
            rec = record_of(p)
            out[name] = (tuple(rec.shape) if rec is not None else tuple(p.shape), not p.requires_grad)
        for mod_name, mod in self.module.named_modules():
            for bname, buf in mod._buffers.items():
                if buf is not None and bname not in mod._non_persistent_buffers_set:
                    out[f"{mod_name}.{bname}" if mod_name else bname] = (tuple(buf.shape), False)
        return out

    def optimizer_extras(self) -> dict[str, torch.Tensor]:
        """Tensors a 1-bit optimizer keeps outside its per-parameter state (see
        [Note: error buffers in checkpoints] in dsrun/runtime/fp16/onebit/base.py):
        "optim_rank/rank<r>/<key>" for this rank's own, "optim_shared/<key>"
        (rank 0 writes them) for those every rank holds alike; {} for any
        other optimizer."""
        optimizer, rank = self.optimizer, self.topology.rank
        if not isinstance(optimizer, CompressedCommOptimizer):
            return {}
        out = {f"optim_rank/rank{rank}/{k}": t for k, t in optimizer.checkpoint_extras().items()}
        if rank == 0:
            out.update({f"optim_shared/{k}": t for k, t in optimizer.replicated_extras().items()})
        return out
