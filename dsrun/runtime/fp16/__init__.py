"""Optimizers under DeepSpeed's `deepspeed.runtime.fp16` paths (the 1-bit family in `onebit`)."""
