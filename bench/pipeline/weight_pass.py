"""CPU seconds of zero bubble's passes on one micro-batch of a whole GPT
stage, one process, one thread: the forward (F), the input pass (B) and the
weight pass (W) two ways, interleaved per repeat:

- "per module": one `torch.autograd.backward(output, grad, inputs=<own
  parameters>)` per parameter-owning module (dsrun's weight pass before
  pipe/weight_grad.py);
- "rules": pipe/weight_grad.py's gradients from each module's input and
  output gradient, applied with one autograd call (dsrun's weight pass now);

and the full backward for reference (B + W should match it).

    .venv/bin/python bench/pipeline/weight_pass.py [--model bench-v256] [--repeats 5]

Prints min / median / spread ((max - min) / median) per pass in ms, and
checks both weight passes give the same gradients.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_bubble as pb  # noqa: E402

from dsrun.runtime.parallel.pipe.weight_grad import weight_grads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="bench-v256", choices=sorted(pb.MODELS))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = pb.MODELS[args.model]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(spec.build() for spec in pb.layer_specs(s)))
    recorded = []
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.register_forward_hook(lambda m, a, o: recorded.append((m, a[0], o)))
    idx, targets = pb._micro_batch(s, 0, 0, 0)
    times: dict[str, list[float]] = {}
    grads: dict[str, list[torch.Tensor]] = {}

    def clock(name: str, fn):
        begun = time.process_time()
        out = fn()
        times.setdefault(name, []).append(time.process_time() - begun)
        return out

    def split(way: str) -> None:
        model.zero_grad(set_to_none=True)
        recorded.clear()
        loss = clock("F", lambda: pb.lm_loss(model(idx), targets))
        found = clock("B", lambda: torch.autograd.grad(loss, [o for _, _, o in recorded], retain_graph=True))
        work = list(zip(recorded, found))

        def per_module():
            for (m, _, o), g in work:
                torch.autograd.backward(o, g, inputs=list(m.parameters(recurse=False)), retain_graph=True)

        def rules():
            pairs = [pg for (m, x, _), g in work for pg in weight_grads(m, x, g)]
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])

        clock(f"W {way}", per_module if way == "per module" else rules)
        grads[way] = [p.grad.clone() for p in model.parameters()]

    for _ in range(args.repeats):
        split("per module")
        split("rules")
        model.zero_grad(set_to_none=True)
        loss = pb.lm_loss(model(idx), targets)
        clock("full backward", loss.backward)
    for a, b in zip(grads["per module"], grads["rules"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    print(f"{args.model}: one micro-batch ({s.micro} x {s.seq} tokens) through the whole model, fp32, 1 thread; "
          f"CPU ms over {args.repeats} interleaved repeats (F and B: both ways together); the two weight passes "
          "give the same gradients\n")
    print("| pass | min ms | median ms | spread |\n|---|---|---|---|")
    for name, v in times.items():
        med = statistics.median(v)
        print(f"| {name} | {min(v) * 1e3:.1f} | {med * 1e3:.1f} | {(max(v) - min(v)) / med:.0%} |")


if __name__ == "__main__":
    main()
