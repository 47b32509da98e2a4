"""The batch triple: train_batch_size = micro-batch x gradient accumulation x data-parallel size."""
from __future__ import annotations

import typing


from dsrun.runtime.config.errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch_triple(train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None,
                         world_size: int) -> tuple[int, int, int]:
    """Fill in the batch triple from what was given.

    train_batch_size = micro_batch x grad_accum x world_size, where
    world_size is the data-parallel world size. Two given infer the third;
    only the micro-batch given means grad_accum 1; only train_batch_size
    given means grad_accum 1 and micro = train_batch_size / world_size.

    Returns:
        (train_batch_size, micro_batch, grad_accum), all positive ints.

    Raises:
        ConfigError: neither batch size is given, a value cannot be
            inferred as a whole number, or all three disagree; the message
            shows the arithmetic and the values that would fix it.
    """
    tbs, micro, gas, ws = train_batch_size, micro_batch, grad_accum, world_size

    def fail(text: str) -> typing.NoReturn:
        raise ConfigError(text)

    if tbs is None and micro is None:
        fail("train_batch_size: neither train_batch_size nor train_micro_batch_size_per_gpu is set; "
             "set at least one (gradient_accumulation_steps defaults to 1)")
    if tbs is None:
        gas = 1 if gas is None else gas
        return micro * gas * ws, micro, gas
    if micro is None:
        gas = 1 if gas is None else gas
        if tbs % (gas * ws):
            fail(f"train_batch_size={tbs} is not divisible by {gas} (gradient_accumulation_steps) x {ws} "
                 f"(world size) = {gas * ws}, so train_micro_batch_size_per_gpu cannot be inferred; "
                 f"set train_batch_size to a multiple of {gas * ws} or set train_micro_batch_size_per_gpu")
        return tbs, tbs // (gas * ws), gas
    if gas is None:
        if tbs % (micro * ws):
            fail(f"train_batch_size={tbs} is not divisible by {micro} (train_micro_batch_size_per_gpu) x "
                 f"{ws} (world size) = {micro * ws}, so gradient_accumulation_steps cannot be inferred; "
                 f"set train_batch_size to a multiple of {micro * ws}")
        return tbs, micro, tbs // (micro * ws)
    if tbs != micro * gas * ws:
        fixes = [f"train_batch_size to {micro * gas * ws}"]
        if tbs % (micro * ws) == 0:
            fixes.append(f"gradient_accumulation_steps to {tbs // (micro * ws)}")
        if tbs % (gas * ws) == 0:
            fixes.append(f"train_micro_batch_size_per_gpu to {tbs // (gas * ws)}")
        fix = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])} or {fixes[-1]}"
        fail(f"train_batch_size={tbs} but {micro} (train_micro_batch_size_per_gpu) x {gas} "
             f"(gradient_accumulation_steps) x {ws} (world size) = {micro * gas * ws}; set {fix}")
    return tbs, micro, gas
