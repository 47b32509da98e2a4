"""Random layerwise token dropping (random-LTD; Yao et al. 2022, DeepSpeed's
`deepspeed.runtime.data_pipeline.data_routing`): `config.py` (the
`data_routing` section), `scheduler.py` (how many tokens the dropping layers
keep at each step), `basic_layer.py` (the wrapper that drops them) and
`helper.py` (`convert_to_random_ltd`, `save_without_random_ltd`)."""
