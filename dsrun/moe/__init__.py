"""`deepspeed.moe`: Mixture of Experts with expert parallelism (`layer.MoE`,
`experts.Experts`; implemented in dsrun/runtime/parallel/expert/),
`sharded_moe` (the gate, gating functions and MOELayer under DeepSpeed's
names) and `utils`, the optimizer parameter-group helper for expert
parameters."""
from dsrun.moe import experts, layer, sharded_moe, utils  # noqa: F401 - `deepspeed.moe.layer.MoE` as an attribute path
