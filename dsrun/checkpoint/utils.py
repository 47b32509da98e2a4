"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`."""
from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """A copy of `item` (a tensor, or lists/tuples/dicts of them, any depth)
    where every tensor is detached and cloned onto `device`.

    torch.save writes a view's whole storage; cloning first stores only the
    tensor's own elements (e.g. one parameter, not the flat ZeRO buffer it
    views). Non-tensor leaves are returned as they are.
    """
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
