"""dsrun: a launcher and training runtime for large PyTorch models.

`import dsrun as deepspeed` is meant to run a DeepSpeed training script
unchanged; see README.md for what is supported.
"""

__version__ = "0.1.0"
