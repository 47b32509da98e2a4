"""Native ops (C++/CUDA in csrc/) with pure-PyTorch fallbacks.

    dsrun.ops.adam       CPUAdam, DeepSpeedCPUAdam, FusedAdam, adam_step, grad_sq_norm,
                         unscale_and_clip_coefficient, is_native_adam
    dsrun.ops.lion       Lion, DeepSpeedCPULion, FusedLion (PyTorch)
    dsrun.ops.adagrad    DeepSpeedCPUAdagrad (torch's Adagrad)
    dsrun.ops.lamb       FusedLamb (PyTorch)
    dsrun.ops.aio        AioHandle (io_uring / libaio, O_DIRECT), new_aligned_tensor
    dsrun.ops.shm_comm   ShmGroup: shared-memory collectives for one node
    dsrun.ops.cuda_adam  multi_tensor_adam (fused CUDA Adam)
    dsrun.ops.quantizer  int8/int4 block quantization, 1-bit sign packing (CPU SIMD, CUDA):
                         the native paths of dsrun.runtime.comm.quantized / compressed
    dsrun.ops.isa        the CPU instruction set (DSRUN_CPU_ISA)
    dsrun.ops.builder    JIT/AOT builds, cache, status (see `dsrun-report`)

Submodules are imported on use: importing dsrun.ops builds nothing, and
`dsrun.ops.adam` (attribute access, as in DeepSpeed's
`deepspeed.ops.adam.FusedAdam`) imports that module then.
"""
import importlib

_SUBMODULES = ("adagrad", "adam", "aio", "builder", "cuda_adam", "isa", "lamb", "lion", "quantizer", "report",
               "shm_comm")


def __getattr__(name: str):
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'dsrun.ops' has no attribute {name!r}")
    return importlib.import_module(f"dsrun.ops.{name}")  # also sets the attribute on this package


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
