"""Tiny models and a training loop shared by the ZeRO engine tests."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    """Token model with GPT-style tied embedding/head, blocks in a ModuleList,
    optional frozen block, an unused parameter, and a block called twice."""

    def __init__(self, vocab=37, d=16, layers=2, tie=True, unused=False, twice=False, freeze=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.wte.weight
        self.spare = nn.Linear(d, d) if unused else None
        self.twice = twice
        if freeze:
            for p in self.h[0].parameters():
                p.requires_grad_(False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        if self.twice:
            x = self.h[-1](x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def param_groups(model: nn.Module, lr=1e-2, shapes: dict | None = None):
    """Two groups: weight decay on matrices, none on norms/biases. `shapes`
    (name -> shape) stands in for parameters partitioned by zero.Init."""
    dim = lambda n, p: len(shapes[n]) if shapes else p.dim()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and dim(n, p) >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and dim(n, p) < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batches(rank: int, steps: int, micro: int, gas: int, vocab=37, seq=8):
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps * gas):
        idx = torch.randint(0, vocab, (micro, seq), generator=g)
        out.append((idx, torch.roll(idx, -1, 1)))
    return out


def base_config(stage: int, precision: str = "fp32", gas: int = 1, world_size: int = 1, **zero):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 10**6,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def mean_loss_step(engine, idx: torch.Tensor, tgt: torch.Tensor) -> float:
    """One forward, backward and step of `engine`; returns the micro-batch's
    loss averaged over the ranks (fp32)."""
    from dsrun.runtime import comm

    loss = engine(idx, tgt)
    engine.backward(loss)
    engine.step()
    t = loss.detach().float().clone()
    comm.all_reduce(t)
    return t.item() / comm.get_world_size()


def train(config: dict, steps: int = 3, seed: int = 0, model_kwargs: dict | None = None,
          lr=1e-2, optimizer="adamw"):
    """Train TinyGPT on this rank's data; returns (losses, {name: full fp32 param}, engine).

    optimizer: "adamw" or "sgd" (torch objects passed to initialize) or
    "config" (ds_config's AdamW, dsrun's native Adam)."""
    import dsrun
    from dsrun.runtime import comm

    torch.manual_seed(seed)
    model = TinyGPT(**(model_kwargs or {}))
    groups = param_groups(model, lr)
    if optimizer == "config":  # ds_config's AdamW: dsrun's native Adam, fused into the ZeRO step
        config = {**config, "optimizer": {"type": "AdamW", "params": {"lr": lr}}}
        engine, *_ = dsrun.initialize(model=model, model_parameters=groups, config=config)
    else:
        opt = (torch.optim.AdamW(groups, lr=lr) if optimizer == "adamw"
               else torch.optim.SGD(groups, lr=lr, momentum=0.9))
        engine, *_ = dsrun.initialize(model=model, optimizer=opt, config=config)
    rank = comm.get_rank()
    gas = engine.gradient_accumulation_steps()
    losses = []
    for idx, tgt in batches(rank, steps, 2, gas):
        losses.append(mean_loss_step(engine, idx.to(engine.device), tgt.to(engine.device)))
    full = {}
    for n, p in model.named_parameters():
        full[n] = full_param(engine, p)
    return losses, full, engine


def full_param(engine, p):
    strategy = engine.strategy
    getter = getattr(strategy, "full_fp32_param", None)
    if getter is not None:
        v = getter(p)
        if v is not None:
            return v.cpu().clone()
    return p.detach().float().cpu().clone()
