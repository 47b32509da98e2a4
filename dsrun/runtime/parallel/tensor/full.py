"""How automatic tensor parallelism reads the full tensor of a parameter it cuts.

[Note: full tensors]
AutoTP (autotp.py, vocab.py) plans from a layer's full shape and cuts each
rank's slice from its full value. A plain parameter is its full tensor. A
parameter built under `zero.Init` holds only its ZeRO shard: its full shape
is recorded and its full value must be gathered (collective), which is
ZeRO's business (dsrun/runtime/zero/tensor_parallel.py, ZeroInitTensors).
The tensor-parallel code therefore asks a FullTensors object it is given
instead of asking ZeRO, so that the dependency runs one way: ZeRO builds on
the mesh and the tensor-parallel layers, never the reverse.
"""
from __future__ import annotations

import torch


class FullTensors:
    """The full shape and value of a parameter; this base class is for plain
    parameters (each is its own full tensor). Subclasses override both."""

    def shape(self, param: torch.Tensor) -> torch.Size:
        """The full shape of `param`."""
        return param.shape

    def value(self, param: torch.Tensor) -> torch.Tensor:
        """The full value of `param`, detached (here `param`'s own data;
        a subclass may gather it: collective, a new tensor)."""
        return param.detach()


PLAIN = FullTensors()
