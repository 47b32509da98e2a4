"""DeepSpeed's accelerator interface (`deepspeed.accelerator`): one object that
answers device questions the same way on CPU and CUDA.

    from dsrun.accelerator import get_accelerator
    device = get_accelerator().current_device_name()   # "cuda:0" or "cpu"

See abstract_accelerator.py for the methods; real_accelerator.py picks the
device kind.
"""
from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator
from dsrun.accelerator.real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
