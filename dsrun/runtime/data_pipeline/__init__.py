"""Curriculum learning and data efficiency (DeepSpeed's `deepspeed.runtime.data_pipeline`).

`curriculum_scheduler.py`: `CurriculumScheduler`, the difficulty of each
optimizer step (fixed_linear, fixed_root, fixed_discrete or custom);
`curriculum.py`: the legacy `curriculum_learning` section in a training run
(`curriculum_seqlen`, the pipeline's truncation, token-based LR steps);
`data_sampling.py`: the `data_efficiency.data_sampling.curriculum_learning`
sampler over difficulty metrics computed in memory (docs/curriculum.md);
`data_routing/`: random layerwise token dropping, random-LTD
(docs/random_ltd.md).
"""
