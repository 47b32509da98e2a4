"""Native ops (C++/CUDA in csrc/) with pure-PyTorch fallbacks.

    dsrun.ops.adam       CPUAdam, adam_step, grad_sq_norm, unscale_and_clip_coefficient
    dsrun.ops.aio        AioHandle (io_uring / libaio, O_DIRECT), new_aligned_tensor
    dsrun.ops.shm_comm   ShmGroup: shared-memory collectives for one node
    dsrun.ops.cuda_adam  multi_tensor_adam (fused CUDA Adam)
    dsrun.ops.builder    JIT/AOT builds, cache, status (see `dsrun-report`)

Submodules are imported on use: importing dsrun.ops builds nothing.
"""
