"""`deepspeed.moe`: Mixture of Experts. The expert-parallel layer is not
implemented (`layer.MoE` raises naming the feature); `utils` has the
parameter-group helper scripts call unconditionally, which works on any model."""
from dsrun.moe import layer, utils  # noqa: F401 - `deepspeed.moe.layer.MoE` as an attribute path
