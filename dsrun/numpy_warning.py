"""Keep torch's warning about a missing NumPy from users who never asked for NumPy.

[Note: torch's NumPy warning]
torch's C++ argument parser asks, the first time a call needs it, whether
NumPy can be imported (is_numpy_available in torch/csrc/utils/tensor_numpy.cpp;
the answer is cached for the process) and, when it cannot, warns once:
`UserWarning: Failed to initialize NumPy: No module named 'numpy'`.
`import torch` itself makes such a call (torch 2.13:
torch/_subclasses/functional_tensor.py builds FunctionalTensor's `cpu`
method with `torch.device("cpu")`), so in an environment without NumPy,
which is what `pip install dsrun` gives (NumPy is no requirement), every
process that imports torch printed it: the demo's first line on rank 0.
The user did not cause it and nothing dsrun does needs NumPy.

dsrun silences exactly that message, and only where NumPy is not installed
(a NumPy that is installed but fails to import still warns: that is the
user's to fix), at the two places where torch gets imported on its behalf:
- its own entry points import torch inside `quiet_missing_numpy()`;
- the ranks it starts get a PYTHONWARNINGS entry (`rank_warning_filter`),
  since a training script imports torch before dsrun can run any code. The
  entry goes first, so a PYTHONWARNINGS of the user's takes precedence.
This module imports neither torch nor NumPy (the launcher imports it).
"""
from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from collections.abc import Iterator, Mapping

MESSAGE = "Failed to initialize NumPy: No module named 'numpy'"
# A PYTHONWARNINGS field ends at ':', so the rank filter matches the message up to its first colon.
_ENV_FILTER = "ignore:Failed to initialize NumPy:UserWarning"


def numpy_missing() -> bool:
    """True when no NumPy is installed for this interpreter (imports nothing)."""
    return importlib.util.find_spec("numpy") is None


@contextlib.contextmanager
def quiet_missing_numpy() -> Iterator[None]:
    """Inside the block, torch's warning that NumPy is missing is not shown (only that message,
    only when NumPy is not installed). Wrap the first `import torch` of an entry point in it."""
    with warnings.catch_warnings():
        if numpy_missing():
            warnings.filterwarnings("ignore", message=re.escape(MESSAGE), category=UserWarning)
        yield


def rank_warning_filter(env: Mapping[str, str]) -> dict[str, str]:
    """The PYTHONWARNINGS a rank started with environment `env` should get instead, so that its
    `import torch` does not warn about the missing NumPy; {} when NumPy is installed.
    The user's own filters in `env` follow dsrun's entry and so take precedence over it."""
    if not numpy_missing():
        return {}
    user = env.get("PYTHONWARNINGS", "")
    return {"PYTHONWARNINGS": f"{_ENV_FILTER},{user}" if user else _ENV_FILTER}
