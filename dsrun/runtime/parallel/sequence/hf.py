"""Ulysses around a Hugging Face model's attention: the all-to-alls of
DistributedAttention wrapped around transformers' `sdpa` attention
function, for models built by transformers (Llama, GPT-2, Mistral, Qwen,
...). DeepSpeed's counterpart is `UlyssesSPAttentionHF` in
deepspeed/runtime/sequence_parallel/ulysses_sp.py.

[Note: how a Hugging Face model is wrapped]
transformers' attention layers look up their attention function by the
name in `config._attn_implementation` in a registry
(`AttentionInterface`), calling it as `fn(module, q, k, v, attention_mask,
**kwargs)` with q, k, v [b, heads, n, d] and expecting ([b, n, heads, d],
weights). wrap_hf_attention registers, under a name of its own for each
wrapped model, a function that moves q, k and v to whole-sequence slices of
heads (scatter_heads, one all-to-all), calls the `sdpa` attention on them
causally, and moves the output back (gather_heads), then points the
model's config at that name. No other model in the process is touched
(DeepSpeed overwrites every entry of the registry instead). The model
builds no attention mask for a name unknown to transformers' mask registry,
which is what Ulysses needs: its attention is causal over the whole
sequence, so padding must be on the right with labels -100 (see
batches.py). Head counts follow heads.py's [Note: heads the
sequence-parallel size does not divide] (any h >= P; grouped-query
attention with any key/value heads dividing h): each rank's
key/value-heads-per-query-head ratio is passed
to sdpa through a stand-in for the module (sdpa reads only
`num_key_value_groups` and `is_causal` from it).

The model's inputs must be this rank's slice with `position_ids` giving
the tokens' places in the whole sequence (UlyssesSPDataLoaderAdapter makes
such batches).
"""
from __future__ import annotations

import itertools
import types
from typing import Any

import torch
from torch.distributed import ProcessGroup

from dsrun.runtime import comm
from dsrun.runtime.parallel.mesh import MeshGroup, current
from dsrun.runtime.parallel.sequence.all_to_all import gather_heads, scatter_heads

SUPPORTED = ("sdpa",)
_names = itertools.count()


def _ulysses_attention(core: Any, group: ProcessGroup, world: int):
    """The registered attention function for one wrapped model."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        kwargs.pop("is_causal", None)
        if world == 1:
            return core(module, query, key, value, None, is_causal=True, **kwargs)
        q, k, v = scatter_heads(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                group, world, batch_dim_idx=0)          # [b, N, this rank's heads, d]
        stand_in = types.SimpleNamespace(num_key_value_groups=q.shape[2] // k.shape[2],
                                         is_causal=getattr(module, "is_causal", True), training=module.training)
        context, _ = core(stand_in, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                          is_causal=True, **kwargs)                      # [b, N, this rank's heads, d]
        return gather_heads(context, query.shape[1], group, world, batch_dim_idx=0), None  # [b, n, heads, d]

    return attention


def wrap_hf_attention(model: torch.nn.Module, sequence_group: ProcessGroup | MeshGroup | None = None,
                      core_attn_implementation: str = "sdpa") -> str:
    """Make a transformers model's attention Ulysses attention over the
    sequence-parallel group (see [Note: how a Hugging Face model is
    wrapped]). Call before dsrun.initialize (or any time before training).

    Args:
        model: a transformers PreTrainedModel (e.g. LlamaForCausalLM,
            GPT2LMHeadModel built from a config), whose config's attention is
            `core_attn_implementation`.
        sequence_group: the sequence-parallel group (default: the current
            mesh's "sequence" axis, e.g. after ParallelMesh.build(world,
            sequence=P) and set_current).
        core_attn_implementation: the attention run on whole-sequence head
            slices; "sdpa" (torch's scaled_dot_product_attention: causal
            without a mask).

    Returns:
        The attention name registered and set on the model's config.

    Raises:
        ImportError: transformers is not installed.
        ValueError: the model has no transformers config, its attention is
            not `core_attn_implementation`, or that is not supported.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if core_attn_implementation not in SUPPORTED:
        raise ValueError(f"wrap_hf_attention: core_attn_implementation={core_attn_implementation!r}; supported: "
                         f"{SUPPORTED} (Ulysses attention is causal without a mask, which 'eager' cannot do)")
    config = getattr(model, "config", None)
    have = getattr(config, "_attn_implementation", None)
    if have != core_attn_implementation:
        raise ValueError(f"wrap_hf_attention: the model's attention is {have!r}, not "
                         f"{core_attn_implementation!r}; build it with attn_implementation="
                         f"{core_attn_implementation!r} (e.g. AutoModelForCausalLM.from_config(config, "
                         f"attn_implementation={core_attn_implementation!r}))")
    if sequence_group is None:
        sequence_group = current().axis_group("sequence")
    group = sequence_group.group if isinstance(sequence_group, MeshGroup) else sequence_group
    world = comm.get_world_size(group) if group is not None else 1
    name = f"dsrun_ulysses_{core_attn_implementation}_{next(_names)}"
    AttentionInterface.register(name, _ulysses_attention(sdpa_attention_forward, group, world))
    model.set_attn_implementation(name)
    return name
