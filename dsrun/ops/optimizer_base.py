"""`OptimizerBase`: torch's Optimizer without importing torch._dynamo on the eager path.

[Note: torch._dynamo on the eager path]
torch wraps `Optimizer.add_param_group`, `zero_grad`, `state_dict` and
`load_state_dict` in `torch._disable_dynamo`, which imports torch._dynamo on
the wrapped function's first call so that a compiled frame never traces into
it. The import alone costs about 1 CPU-second per process (measured 1.07-1.20
s on the 2-core CI machine: `python -c "import torch, time; t =
time.process_time(); import torch._dynamo; print(time.process_time() - t)"`),
which every launched rank paid when it built its optimizer, although an eager
run never compiles anything. Disabling dynamo only matters while a frame is
being compiled, and nothing can be compiled before torch._dynamo is imported
(torch.compile and engine.compile() import it), so while it is absent from
sys.modules these methods call the function under torch's wrapper (its
`__wrapped__`); once it is imported they call torch's wrapped method, exactly
as torch.optim.Optimizer does.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

_Optimizer = torch.optim.Optimizer


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class OptimizerBase(_Optimizer):
    """torch.optim.Optimizer whose wrapped methods skip torch's lazy torch._dynamo import while it is absent.

    Behaves as torch.optim.Optimizer in every respect (same state dict, hooks
    and errors); see [Note: torch._dynamo on the eager path]. dsrun's own
    optimizers derive from it.
    """

    @staticmethod
    def closure_loss(closure: Callable[[], Any] | None) -> Any:
        """What `closure` returns (the loss), run with autograd enabled since
        `step()` runs under torch.no_grad(); None when there is no closure."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return _Optimizer.add_param_group(self, param_group)
        return _Optimizer.add_param_group.__wrapped__(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _dynamo_loaded():
            return _Optimizer.zero_grad(self, set_to_none)
        return _Optimizer.zero_grad.__wrapped__(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if _dynamo_loaded():
            return _Optimizer.state_dict(self)
        return _Optimizer.state_dict.__wrapped__(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _dynamo_loaded():
            return _Optimizer.load_state_dict(self, state_dict)
        return _Optimizer.load_state_dict.__wrapped__(self, state_dict)
