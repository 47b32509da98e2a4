"""Offline tools (DeepSpeed's `deepspeed.utils` names)."""
