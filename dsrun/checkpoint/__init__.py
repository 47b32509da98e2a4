"""`deepspeed.checkpoint`: checkpoint helpers scripts import by DeepSpeed's
path (`dsrun.checkpoint.utils`). dsrun's checkpointing itself is
dsrun/runtime/checkpoint/ (engine.save_checkpoint / load_checkpoint)."""
