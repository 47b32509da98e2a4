"""`deepspeed.moe`: Mixture of Experts with expert parallelism (`layer.MoE`,
`experts.Experts`; implemented in dsrun/runtime/parallel/expert/) and
`utils`, the optimizer parameter-group helper for expert parameters."""
from dsrun.moe import experts, layer, utils  # noqa: F401 - `deepspeed.moe.layer.MoE` as an attribute path
