"""One configuration of the GPU check: train examples/gpt_model.py's GPT for a few steps.

    python bench/gpu/gpt_case.py --model 82m --run dsrun --stage 3 [--fp16]
        [--offload_optimizer cpu|nvme] [--offload_param cpu|nvme] [--zero_init]
        [--act_ckpt] [--resume] [--prefetch_bucket N] [--moe_experts E]
        [--steps 8] [--warmup 3] [--device cuda|cpu]
    python bench/gpu/gpt_case.py --model 82m --run plain
    python bench/gpu/gpt_case.py --model 1.2b --stage 2 --offload_optimizer cpu --timeline   # ZeRO-Offload

Prints one line `RESULT {json}` with: median and minimum step time (ms, after
`--warmup` untimed steps; a step is forward + backward + optimizer step,
timed between device synchronisations), peak device memory (MiB,
torch.cuda.max_memory_allocated over the whole run, model build included;
on the CPU the process's peak RSS), the loss of every step, and with
`--resume` whether a checkpoint round trip resumed with identical losses.
Exits non-zero when the run fails or the resumed losses differ.

`--timeline` (dsrun runs) adds what an offload run needs to be read: the
seconds `initialize` took and the peak device memory up to then (the
construction's own, MiB), and the last step's offload timeline
(`engine.offload_timeline()`: copies, host gradient work and CPU Adam, per
kind total ms, MiB and count, printed as a bar chart); with
offload_optimizer it first checks that dsrun's native CPU Adam op builds
and exits non-zero when it does not (the PyTorch fallback is not what is
being measured).

Runs (world size 1; `python` alone, no launcher: the runtime then is one rank):
- plain: PyTorch alone, fp32 weights, autocast to bf16 (fp16 with a
  GradScaler under --fp16), torch.optim.AdamW(fused=True) on CUDA, gradient
  clipping 1.0: what the figures of REFERENCE.md section 7 call plain PyTorch.
- dsrun: dsrun.initialize with ZeRO `--stage`, bf16 (or fp16 with dynamic
  loss scaling), AdamW from the config, gradient clipping 1.0.
- deepspeed: the same config through DeepSpeed, when it is installed.

The model's weights come from one seed, so every run starts from the same
parameters; the batches are random tokens from another fixed seed.

`--prefetch_bucket N` sets stage 3's stage3_prefetch_bucket_size to N
elements (default 5e7, DeepSpeed's). `--moe_experts E` trains
examples/gpt_moe.py's MoEGPT instead (blocks 1, 3, ... with E experts, each a
copy of the block's MLP, top-1, capacity factor 1.0, ep 1: every expert on
this device; loss + 0.01 x l_aux; optimizer groups split for the experts):
the same active parameters per token as the GPT, plus the gates, so the GPT
at the same stage is its baseline without MoE machinery. Its first loss is
not the GPT's (other layers, the aux loss).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402

# name -> (n_layer, n_embd, n_head, seq_len, micro-batch)
MODELS = {
    "tiny": (2, 64, 4, 64, 2),
    "82m": (12, 768, 12, 1024, 8),
    "1.2b": (24, 2048, 16, 1024, 4),
}


def ds_config(args) -> dict:
    """The ds_config of a dsrun or DeepSpeed run (bf16 unless --fp16)."""
    zero: dict = {"stage": args.stage}
    nvme = str(Path(args.nvme_path))
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": args.offload_optimizer, "pin_memory": True, "nvme_path": nvme}
    if args.offload_param:
        zero["offload_param"] = {"device": args.offload_param, "pin_memory": True, "nvme_path": nvme}
    if args.prefetch_bucket is not None:
        zero["stage3_prefetch_bucket_size"] = args.prefetch_bucket
    precision = {"fp16": {"enabled": True, "initial_scale_power": 16}} if args.fp16 else {"bf16": {"enabled": True}}
    return {"train_micro_batch_size_per_gpu": MODELS[args.model][4], "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 10**6, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            **precision}


def build_model(args, device: torch.device) -> GPT:
    """The GPT (MoEGPT with --moe_experts) on `device` (under zero.Init when
    asked), weights from seed 1234."""
    n_layer, n_embd, n_head, seq_len, _ = MODELS[args.model]
    cfg = GPTConfig(vocab_size=256, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    torch.manual_seed(1234)
    if args.moe_experts:
        from gpt_moe import MoEGPT
        make = lambda: MoEGPT(cfg, args.moe_experts, ep_size=1, k=1)  # noqa: E731
    else:
        make = lambda: GPT(cfg)  # noqa: E731
    if args.zero_init:
        import dsrun
        with dsrun.zero.Init(config_dict_or_path=ds_config(args)):
            model = make()
    else:
        with torch.device(device):
            model = make()
    if args.act_ckpt:
        import dsrun
        for block in model.blocks:  # recompute each block's activations in backward
            block.forward = _checkpointed(dsrun.checkpointing.checkpoint, block.forward)
    return model


def _checkpointed(checkpoint, forward):
    return lambda x: checkpoint(forward, x)


def batches(args, device: torch.device, n: int):
    """`n` (input, target) pairs of (micro, seq_len) int64 random byte tokens."""
    _, _, _, seq_len, micro = MODELS[args.model]
    gen = torch.Generator(device="cpu").manual_seed(99)
    for _ in range(n):
        tokens = torch.randint(0, 256, (micro, seq_len + 1), generator=gen)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PlainStep:
    """Plain PyTorch: fp32 weights, autocast, fused AdamW, clipping 1.0."""

    def __init__(self, args, device):
        self.model = build_model(args, device)
        self.device, self.fp16 = device, args.fp16
        groups = self.model.param_groups()
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.fp16)

    def __call__(self, x, y) -> float:
        dtype = torch.float16 if self.fp16 else torch.bfloat16
        with torch.autocast(self.device.type, dtype=dtype):
            loss = self.model(x, y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class EngineStep:
    """dsrun's (or DeepSpeed's) engine: forward, backward, step. build_s:
    seconds `initialize` took; build_peak_mib: the peak device memory up to
    its end (MiB)."""

    def __init__(self, args, device, lib):
        model = build_model(args, device)
        groups = model.param_groups()
        if args.moe_experts:
            moe_utils = importlib.import_module(lib.__name__ + ".moe.utils")
            groups = moe_utils.split_params_into_different_moe_groups_for_optimizer(groups)
        t0 = time.perf_counter()
        self.engine, *_ = lib.initialize(model=model, model_parameters=groups, config=ds_config(args))
        self.build_s = time.perf_counter() - t0
        self.build_peak_mib = peak_mib(device)

    def __call__(self, x, y) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


def make_step(args, device):
    if args.run == "plain":
        return PlainStep(args, device)
    if args.run == "deepspeed":
        import deepspeed
        return EngineStep(args, device, deepspeed)
    import dsrun
    return EngineStep(args, device, dsrun)


def resume_matches(args, device, step, data) -> bool:
    """Save after the first half of `data`, train the second half, load the
    checkpoint into a second, freshly built engine (initial weights, empty
    optimizer), train the second half again: True when both give the same
    losses, bit for bit."""
    half = len(data) // 2
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as ckpt:
        for x, y in data[:half]:
            step(x, y)
        step.engine.save_checkpoint(ckpt, tag="half")
        first = [step(x, y) for x, y in data[half:]]
        again = make_step(args, device)
        again.engine.load_checkpoint(ckpt, tag="half")
        second = [again(x, y) for x, y in data[half:]]
    print(f"resume: {first} vs {second}", flush=True)
    return first == second


def cpu_adam_ready() -> bool:
    """Build dsrun's native CPU Adam op (printing how long it took); False,
    with the reason printed, when it does not build."""
    from dsrun.ops import adam as native_adam

    t0 = time.perf_counter()
    if not native_adam.native_available():
        print("FAIL: dsrun's CPU Adam op did not build (see dsrun-report); the offload timeline measures the "
              "native op", flush=True)
        return False
    print(f"CPU Adam op ready in {time.perf_counter() - t0:.1f} s (ISA {native_adam.selected_isa()}, "
          f"{torch.get_num_threads()} threads)", flush=True)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="82m")
    p.add_argument("--run", choices=["plain", "dsrun", "deepspeed"], default="dsrun")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--offload_optimizer", choices=["cpu", "nvme"])
    p.add_argument("--offload_param", choices=["cpu", "nvme"])
    p.add_argument("--zero_init", action="store_true")
    p.add_argument("--act_ckpt", action="store_true")
    p.add_argument("--resume", action="store_true", help="check a checkpoint round trip instead of timing")
    p.add_argument("--prefetch_bucket", type=int, default=None, help="stage3_prefetch_bucket_size (elements)")
    p.add_argument("--moe_experts", type=int, default=0, help="train MoEGPT with this many experts (ep 1)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeline", action="store_true",
                   help="dsrun: report initialize's time and peak and the last step's offload timeline")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nvme_path", default=os.environ.get("DSRUN_GPU_CHECK_NVME", tempfile.gettempdir()))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    result = {"model": args.model, "run": args.run, "arch": f"moe{args.moe_experts}" if args.moe_experts else "gpt"}
    if args.timeline and args.run != "dsrun":
        p.error("--timeline needs --run dsrun")
    if args.moe_experts and args.run == "plain":
        p.error("--moe_experts needs an engine (--run dsrun or deepspeed): the MoE layer's expert groups")
    if args.timeline and args.offload_optimizer and not cpu_adam_ready():
        return 1
    step = make_step(args, device)
    data = list(batches(args, device, args.warmup + args.steps))
    if args.resume:
        result["resume_equal"] = resume_matches(args, device, step, data)
    else:
        losses, times = [], []
        for i, (x, y) in enumerate(data):
            sync(device)
            t0 = time.perf_counter()
            losses.append(step(x, y))  # .item() waits for the step's last kernel
            sync(device)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        result.update(step_ms_median=statistics.median(times), step_ms_min=min(times), losses=losses)
    result["peak_mib"] = peak_mib(device)
    if args.timeline:
        from dsrun.runtime.offload.transfer import format_timeline

        result.update(build_s=step.build_s, build_peak_mib=step.build_peak_mib,
                      timeline=step.engine.offload_timeline())
        print(f"initialize: {step.build_s:.1f} s, peak {step.build_peak_mib:,.0f} MiB by then", flush=True)
        print(format_timeline(result["timeline"]) or "no offload timeline (nothing offloaded)", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result.get("resume_equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
