"""The instruction set a CPU op runs with: the best the CPU has, or the one
`DSRUN_CPU_ISA` asks for (shared by dsrun.ops.adam and dsrun.ops.quantizer)."""
from __future__ import annotations

from dsrun.env import CPU_ISA

ISA_NAMES = CPU_ISA.choices  # scalar, avx2, avx512: the native ops' index of each


def choose_isa(best: int) -> str:
    """Name of the instruction set to run: ISA_NAMES[best] (what cpuid reports),
    lowered by `DSRUN_CPU_ISA=scalar|avx2|avx512`.

    Raises:
        ValueError: DSRUN_CPU_ISA names no instruction set, or one this CPU lacks.
    """
    want = CPU_ISA.read()
    if want is None:
        return ISA_NAMES[best]
    if ISA_NAMES.index(want) > best:
        raise ValueError(f"DSRUN_CPU_ISA={want}: this CPU supports at most {ISA_NAMES[best]}")
    return want
