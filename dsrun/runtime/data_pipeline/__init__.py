"""Data efficiency (DeepSpeed's `deepspeed.runtime.data_pipeline`): what a
model sees of each batch. `data_routing/` holds random layerwise token
dropping (random-LTD)."""
