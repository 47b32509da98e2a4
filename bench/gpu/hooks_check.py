"""dsrun's hooks on one GPU: profiler labels, engine.destroy(), the plain module afterwards.

    python bench/gpu/hooks_check.py                 # CUDA
    python bench/gpu/hooks_check.py --device cpu    # the same without a GPU (gloo)

World size 1 (RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1, MASTER_PORT set
here when missing). For each configuration -- stage 0 fp32 (the all-reduce
strategy), stage 2 bf16, stage 2 bf16 with offload_optimizer cpu, stage 3
bf16 -- a stack of 4 Linear(256, 256) trains two steps, the second under
torch.profiler.profile (CPU and, on CUDA, CUDA activities), then the
engine is destroyed. Prints one line `RESULT {json}` per configuration:
the dsrun:: labels of the profile, the hooks dsrun had added and how many
are left after destroy(), the dsrun threads still alive, and whether the
plain module's forward (stage 3: inside GatheredParameters) gives the
engine's loss. Exits 1 when a label is missing, a hook or thread is left,
or the plain forward differs. See [Note: strategy hooks] in dsrun/runtime/strategy/hooks.py.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

CONFIGS = {
    "s0-fp32": ({"stage": 0}, None),
    "s2-bf16": ({"stage": 2}, "bf16"),
    "s2-bf16-offload": ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}, "bf16"),
    "s3-bf16": ({"stage": 3, "stage3_param_persistence_threshold": 0}, "bf16"),
}
STAGE3 = ["dsrun::reduce_grad", "dsrun::stage3_post_forward", "dsrun::stage3_pre_backward",
          "dsrun::stage3_pre_forward", "dsrun::stage3_start_step"]


def _hooks(model: torch.nn.Module) -> int:
    return (sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
            + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()))


def _dsrun_threads() -> list[str]:
    """The threads a strategy starts (the watchdog, the offloaded gradients' worker) still alive."""
    return sorted(t.name for t in threading.enumerate()
                  if t.is_alive() and t.name.startswith(("dsrun-zero-watchdog", "dsrun-offload-grads")))


def run_config(name: str, device: torch.device) -> dict:
    import dsrun
    from dsrun.runtime.zero import GatheredParameters

    zero, precision = CONFIGS[name]
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if precision:
        cfg[precision] = {"enabled": True}
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    before = _hooks(model)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    added = _hooks(model) - before
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    def step():
        engine.backward(engine(x).float().square().mean())
        engine.step()
    step()  # the first step records stage 3's fetch trace
    with torch.profiler.profile(activities=activities) as prof:
        step()
    labels = sorted({e.name for e in prof.events() if e.name.startswith("dsrun::")})
    with torch.no_grad():
        expected = engine(x).float().square().mean().item()
    engine.destroy()
    if zero["stage"] == 3:
        with GatheredParameters(list(model.parameters())), torch.no_grad():
            plain = model(x).float().square().mean().item()
    else:
        with torch.no_grad():
            plain = model(x).float().square().mean().item()
    want = STAGE3 if zero["stage"] == 3 else ["dsrun::reduce_grad"]
    return {"config": name, "device": str(device), "labels": labels, "labels_ok": labels == want,
            "hooks_added": added, "hooks_left": _hooks(model) - before, "threads_left": _dsrun_threads(),
            "loss": expected, "plain_loss": plain, "plain_ok": abs(plain - expected) <= 1e-6 * abs(expected)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    failed = 0
    for name in args.configs.split(","):
        result = run_config(name, device)
        print("RESULT " + json.dumps(result), flush=True)
        failed += not (result["labels_ok"] and result["plain_ok"] and result["hooks_added"] > 0
                       and result["hooks_left"] == 0 and not result["threads_left"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
