"""Full fp32 weights from a dsrun checkpoint, in one process (DeepSpeed's names).

    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpts")          # tag from `latest`
    load_state_dict_from_zero_checkpoint(model, "ckpts", tag="global_step100")

No torch.distributed and no knowledge of the layout that wrote the
checkpoint: every parameter is assembled from the slices its index lists
(fp32 masters for trainable parameters, other tensors cast to fp32), each
read with safetensors' slicing after the file's checksum is verified. The
returned dict holds the whole model in fp32 (4 bytes per parameter).
"""
from __future__ import annotations

import os

import torch

from dsrun.runtime.checkpoint.reader import SliceReader
from dsrun.runtime.checkpoint.store import CheckpointError, load_index, resolve_tag


def _tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    found, _ = resolve_tag(checkpoint_dir, tag)
    if found is None:
        raise CheckpointError(f"no complete dsrun checkpoint in {checkpoint_dir}")
    return os.path.join(checkpoint_dir, found)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """{qualified name: fp32 tensor with its shape} of every parameter and
    persistent buffer saved in checkpoint_dir/<tag> (tag None: `latest`, else
    the newest complete tag). Tied parameters appear once, under their first
    name. exclude_frozen_parameters: leave out parameters that were frozen
    (requires_grad=False) when saved. Raises CheckpointError for a missing,
    incomplete or corrupted checkpoint (naming the file)."""
    tag_dir = _tag_dir(checkpoint_dir, tag)
    index = load_index(tag_dir)
    reader = SliceReader(tag_dir, index)
    out = {}
    for gname in index.tensors:
        if gname.startswith("module/"):
            name = gname[len("module/"):]
            if exclude_frozen_parameters and name in index.frozen:
                continue
            out[name] = reader.read_full(gname, torch.float32)
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load the fp32 weights of a dsrun checkpoint into `model` (a plain,
    non-engine module; strict=False as DeepSpeed, so tied parameters saved
    once load through their first name) and return it."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model
