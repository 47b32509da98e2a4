"""The events the engine writes to the monitors after every optimizer step.

The x axis (`step`) is the number of samples trained on so far
(`engine.global_samples`), as DeepSpeed does for its `Train/Samples/*`
events. Names marked DeepSpeed are DeepSpeed's; the others are dsrun's.

    Train/Samples/train_loss      DeepSpeed: rank 0's loss, mean of the step's micro-batches
    Train/Samples/lr              DeepSpeed: learning rate of the first parameter group
    Train/Samples/loss_scale      DeepSpeed: fp16 only
    Train/Samples/grad_norm       global gradient L2 norm before clipping (absent on skipped steps)
    Train/Samples/skipped_steps   optimizer steps skipped so far (fp16 overflow, inf/nan)
    Train/Samples/samples_per_sec all ranks, over the wall time since the previous step ended
    Train/Samples/tokens_per_sec  the same for tokens, when the model's first input is token ids
    Train/Samples/step_time_ms    wall time since the previous step ended
    Train/Samples/peak_memory_bytes  the highest of every rank's peak memory (see telemetry.py)
    Train/Samples/comm_bytes      message bytes of this rank's collectives in the step
    Train/Samples/comm_time_ms    this rank's time in collectives in the step (dsrun.runtime.observability.timers)
    Train/Samples/comm_inter_node_bytes  ranks on several nodes: bus bytes of this rank's collectives
                                  whose group spans nodes (comm/logger.py, intra- and inter-node bytes)

With `wall_clock_breakdown` also DeepSpeed's
Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}
(backward_allreduce: the collectives inside backward; backward_inner: the rest).
"""
from __future__ import annotations

PREFIX = "Train/Samples/"
TRAIN_LOSS = PREFIX + "train_loss"
LR = PREFIX + "lr"
LOSS_SCALE = PREFIX + "loss_scale"
GRAD_NORM = PREFIX + "grad_norm"
SKIPPED_STEPS = PREFIX + "skipped_steps"
SAMPLES_PER_SEC = PREFIX + "samples_per_sec"
TOKENS_PER_SEC = PREFIX + "tokens_per_sec"
STEP_TIME_MS = PREFIX + "step_time_ms"
PEAK_MEMORY_BYTES = PREFIX + "peak_memory_bytes"
COMM_BYTES = PREFIX + "comm_bytes"
COMM_TIME_MS = PREFIX + "comm_time_ms"
COMM_INTER_NODE_BYTES = PREFIX + "comm_inter_node_bytes"
ELAPSED_MS = PREFIX + "elapsed_time_ms_"  # + forward, backward, backward_inner, backward_allreduce, step
