"""The loop's counters, kept apart from the engine so that the checkpointer and
the telemetry read (and a load restores) them without holding the engine."""
from __future__ import annotations

import dataclasses


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
