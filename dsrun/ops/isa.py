"""The instruction set a CPU op runs with: the best the CPU has, or the one
`DSRUN_CPU_ISA` asks for (shared by dsrun.ops.adam and dsrun.ops.quantizer)."""
from __future__ import annotations

import os

ISA_NAMES = ("scalar", "avx2", "avx512")


def choose_isa(best: int) -> str:
    """Name of the instruction set to run: ISA_NAMES[best] (what cpuid reports),
    lowered by `DSRUN_CPU_ISA=scalar|avx2|avx512`.

    Raises:
        ValueError: DSRUN_CPU_ISA names no instruction set, or one this CPU lacks.
    """
    want = os.environ.get("DSRUN_CPU_ISA")
    if not want:
        return ISA_NAMES[best]
    if want not in ISA_NAMES:
        raise ValueError(f"DSRUN_CPU_ISA={want!r}: expected one of {', '.join(ISA_NAMES)}")
    if ISA_NAMES.index(want) > best:
        raise ValueError(f"DSRUN_CPU_ISA={want}: this CPU supports at most {ISA_NAMES[best]}")
    return want
