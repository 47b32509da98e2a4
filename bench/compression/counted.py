"""The training loop the byte-counting benchmarks share: GPT steps with the
comms logger counting only the steps after the warm-up."""
from __future__ import annotations

import torch


def counted_steps(engine, shape, rank: int, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Run `warmup` + `steps` training steps of the GPT benchmark model on
    batches drawn from a generator seeded with `rank`; the comms logger is
    reset after the warm-up, so set-up collectives are not counted.

    shape: gpt_step.Shape (vocab, seq, micro). Returns (the loss of every
    step, the comms logger's snapshot: op -> stats over the counted steps).
    """
    from dsrun import comm

    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, shape.vocab, (shape.micro, shape.seq + 1), generator=g)
            for _ in range(warmup + steps)]
    losses = []
    for i, batch in enumerate(data):
        if i == warmup:
            comm.comms_logger.reset()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, comm.comms_logger.snapshot()
