"""Profilers (DeepSpeed's `deepspeed.profiling`): `flops_profiler`."""
