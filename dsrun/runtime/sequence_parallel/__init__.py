"""DeepSpeed's `deepspeed.runtime.sequence_parallel`: Ulysses for Hugging
Face models (dsrun/runtime/parallel/sequence/)."""
