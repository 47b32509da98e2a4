"""The flops profiler's counts equal the analytic FLOPs of known models."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from dsrun.profiling.flops_profiler import FlopsProfiler, get_model_profile, number_to_string
from tests.dist_helpers import run_ranks

B, T, D, H, V, LAYERS = 2, 16, 32, 4, 50, 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)
        self.fc = torch.nn.Linear(D, 4 * D)
        self.out = torch.nn.Linear(4 * D, D)
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def transformer_flops() -> tuple[int, int]:
    """(FLOPs of one block, of the whole model): 2 per multiply-accumulate of every matmul;
    attention (scores and weighted sum) counted over all T x T pairs, as the kernel computes them."""
    linear = 2 * B * T * (D * 3 * D + D * D + D * 4 * D + 4 * D * D)
    attention = 2 * (2 * B * T * T * D)
    block = linear + attention
    return block, LAYERS * block + 2 * B * T * D * V


def test_a_linear_layer():
    flops, macs, params = get_model_profile(torch.nn.Linear(64, 32), input_shape=(8, 64),
                                            print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * 8 * 64 * 32, 8 * 64 * 32, 64 * 32 + 32)


def test_a_small_transformer_in_total_and_per_module(capsys):
    model = TinyTransformer()
    ids = torch.randint(0, V, (B, T))
    block, total = transformer_flops()
    flops, macs, params = get_model_profile(model, args=[ids], as_string=False, module_depth=3, top_modules=2)
    assert (flops, macs, params) == (total, total // 2, sum(p.numel() for p in model.parameters()))

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(ids)
    prof.stop_profile()
    modules = prof.module_profiles()
    assert modules["blocks.0"].flops == modules["blocks.1"].flops == block
    assert modules["blocks.0.qkv"].flops == 2 * B * T * D * 3 * D
    assert modules["head"].flops == 2 * B * T * D * V
    assert modules["emb"].flops == 0 and modules["blocks.0.ln1"].flops == 0  # not matmuls
    assert modules["blocks"].flops == 2 * block  # a ModuleList sums its children
    assert modules["blocks.0"].params == sum(p.numel() for p in model.blocks[0].parameters())
    assert modules["blocks.0"].calls == 1 and modules[""].duration > 0
    assert prof.get_total_duration() >= modules[""].duration
    prof.end_profile()
    assert not model._forward_hooks and not model.blocks[0].qkv._forward_pre_hooks  # hooks removed

    report = capsys.readouterr().out
    assert "fwd FLOPs:" in report and number_to_string(total) in report
    assert re.search(r"^      qkv \(Linear\): ", report, re.M)  # depth 3: model > blocks > 0 > qkv
    assert "ln1 (LayerNorm)" in report


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="input_shape or"):
        get_model_profile(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(torch.nn.Linear(2, 2), input_shape=(1, 2), mode="backward")


def profile_in_training(out_file: str) -> tuple[int, int]:
    import dsrun

    torch.manual_seed(0)
    engine, *_ = dsrun.initialize(model=TinyTransformer(), config={
        "train_micro_batch_size_per_gpu": B, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 1, "top_modules": 2,
                           "output_file": out_file}})
    for _ in range(3):
        logits = engine(torch.randint(0, V, (B, T)))
        engine.backward(logits.float().logsumexp(-1).mean())
        engine.step()
    return transformer_flops()


def test_the_config_section_profiles_one_training_step(tmp_path):
    out = tmp_path / "flops.txt"
    (rank0,) = run_ranks(profile_in_training, 1, str(out), timeout=120)
    text = out.read_text()
    assert "profile of step 1" in text
    assert re.search(rf"^fwd FLOPs:\s+{re.escape(number_to_string(rank0[1]))}$", text, re.M)
    assert re.search(rf"^bwd FLOPs = .*:\s+{re.escape(number_to_string(2 * rank0[1]))}$", text, re.M)
    assert re.search(r"^achieved FLOPS = .*FLOPS$", text, re.M)
    assert "blocks (ModuleList)" in text and "qkv" not in text.split("per module")[1]  # module_depth 1
    assert text.count("profile of step") == 1
