"""Communication-compressing optimizers, at DeepSpeed's import paths.

    dsrun.runtime.fp16.onebit.adam.OnebitAdam     1-bit Adam (Tang et al., ICML 2021)
    dsrun.runtime.fp16.onebit.zoadam.ZeroOneAdam  0/1 Adam (Lu et al., ICLR 2023)
    dsrun.runtime.fp16.onebit.lamb.OnebitLamb     1-bit LAMB (Li et al., HiPC 2022)

Each owns the gradient communication of its engine (see
dsrun/runtime/compression/onebit_strategy.py) and exchanges momentum (or
gradients) through dsrun.runtime.comm.compressed.
"""
from dsrun.runtime.fp16.onebit.adam import OnebitAdam
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.fp16.onebit.lamb import OnebitLamb
from dsrun.runtime.fp16.onebit.zoadam import ZeroOneAdam

__all__ = ["CompressedCommOptimizer", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
