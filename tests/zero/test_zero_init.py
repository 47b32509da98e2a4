"""zero.Init: where parameters are built, the model's own initialisation kept
bit for bit, construction memory, and GatheredParameters hand-off.

Two gloo ranks seeded alike build a model under `dsrun.zero.Init` and
eagerly; every gathered parameter must equal the eager one bit for bit
(see [Note: writes under zero.Init] in dsrun/runtime/zero/init_writes.py).
"""
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.dist_helpers import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt_model import GPT, GPTConfig  # noqa: E402

MiB = 1 << 20
GPT_CFG = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, n_embd=24)


class Inner(nn.Module):
    """Initialises inside its own constructor, after its layers were built."""

    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.empty(width))
        nn.init.uniform_(self.scale, 0.5, 1.5)       # direct nn.init
        self.a.weight.data.mul_(0.5)                  # in-place write through .data
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight * 2)    # copy from another parameter
            self.b.bias.add_(self.scale)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale


class Outer(nn.Module):
    """apply(_init_weights) at the end of the constructor, then a rescaling
    loop over named_parameters(), like GPT-2 / nanoGPT / HF post_init, and
    writes inside GatheredParameters(modifier_rank=0). Needs a process group."""

    def __init__(self, width: int = 12, vocab: int = 17, depth: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Inner(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("b.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))
        self.out.bias.data.zero_()  # out.bias is the resident parameter now
        import dsrun
        with dsrun.zero.GatheredParameters([self.out.bias, self.emb.weight], modifier_rank=0):
            self.emb.weight.data[0].zero_()  # HF style: written inside GatheredParameters
            self.out.bias.data.add_(0.25)
        self.norm.weight.data.fill_(0.75)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.normal_(module.bias, std=0.01)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.out(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build(factory, seed: int, **init_kwargs):
    """(eager model, zero.Init model), both built from `seed`."""
    import dsrun

    torch.manual_seed(seed)
    eager = factory()
    torch.manual_seed(seed)
    with dsrun.zero.Init(**init_kwargs):
        model = factory()
    return eager, model


def _gathered_equal(eager, model) -> dict:
    """name -> bit equality of each gathered parameter with the eager one."""
    import dsrun

    out = {}
    for name, p in model.named_parameters():
        with dsrun.zero.GatheredParameters([p]):
            out[name] = (p.shape == eager.get_parameter(name).shape
                         and torch.equal(p.data, eager.get_parameter(name).data))
    return out


def _batch(vocab: int, seq: int):
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, vocab, (2, seq), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _bit_equality() -> dict:
    import dsrun

    topo = dsrun.init_distributed()
    out = {}
    eager, model = _build(lambda: GPT(GPTConfig(**GPT_CFG)), seed=3)
    out["gpt_equal"] = _gathered_equal(eager, model)
    out["gpt_tied"] = model.head.weight is model.tok_emb.weight
    out["gpt_empty"] = all(p.numel() == 0 for p in model.parameters())
    out["gpt_devices"] = {str(p.ds_tensor.device) for p in model.parameters()} | {
        str(p.device) for p in model.parameters()}
    out["topo_device"] = str(topo.device)
    idx, tgt = _batch(GPT_CFG["vocab_size"], GPT_CFG["seq_len"])
    eager_loss = eager(idx, tgt).item()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    out["gpt_losses"] = (engine(idx, tgt).item(), eager_loss)

    eager, model = _build(Outer, seed=5)
    out["outer_equal"] = _gathered_equal(eager, model)
    eager, model = _build(Outer, seed=5, dtype=torch.float64, remote_device="cpu", pin_memory=True)
    out["outer64_dtypes"] = {str(p.ds_tensor.dtype) for p in model.parameters()}
    out["outer64_shard_devices"] = {str(p.ds_tensor.device) for p in model.parameters()}
    with dsrun.zero.GatheredParameters(list(model.parameters())):
        out["outer64_full_devices"] = {str(p.device) for p in model.parameters()}
    # remote_device="nvme": shards in host memory until the NVMe tier adopts them.
    nvme = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "offload_param": {"device": "nvme", "nvme_path": os.environ["ZI_TMP"]}}}
    eager, model = _build(Outer, seed=6, remote_device="nvme", config_dict_or_path=nvme)
    out["nvme_shard_devices"] = {str(p.ds_tensor.device) for p in model.parameters()}
    engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=nvme)
    idx, tgt = _batch(17, 8)
    out["nvme_losses"] = (engine(idx, tgt).item(), eager(idx, tgt).item())
    out["nvme_bytes"] = engine.strategy.param_tier.nvme_bytes()
    return out


def test_init_keeps_the_models_own_initialisation_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("ZI_TMP", str(tmp_path))
    for rank, r in enumerate(run_ranks(_bit_equality, 2, timeout=240)):
        for key in ("gpt_equal", "outer_equal"):
            bad = [n for n, ok in r[key].items() if not ok]
            assert not bad, f"rank {rank}: {key}: differ from the eager model: {bad}"
        assert r["gpt_tied"] and r["gpt_empty"]
        assert r["gpt_devices"] == {r["topo_device"]} == {"cpu"}
        init_loss, eager_loss = r["gpt_losses"]
        assert init_loss == eager_loss, r["gpt_losses"]
        assert r["outer64_dtypes"] == {"torch.float64"}
        assert r["outer64_shard_devices"] == {"cpu"} and r["outer64_full_devices"] == {"cpu"}
        assert r["nvme_shard_devices"] == {"cpu"} and r["nvme_bytes"] > 0
        assert r["nvme_losses"][0] == r["nvme_losses"][1], r["nvme_losses"]


def _hf_models() -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    import dsrun

    dsrun.init_distributed()
    makers = {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                                   bos_token_id=0, eos_token_id=0)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=97)),
    }
    return {name: _gathered_equal(*_build(make, seed=11)) for name, make in makers.items()}


@pytest.mark.slow
def test_hugging_face_models_built_under_init_equal_eager_ones():
    """Hugging Face's post_init (initialize_weights over every module, tied
    embeddings) under dsrun.zero.Init, without DeepSpeed's integration."""
    pytest.importorskip("transformers")
    for rank, r in enumerate(run_ranks(_hf_models, 2, timeout=300)):
        for name, equal in r.items():
            bad = [n for n, ok in equal.items() if not ok]
            assert equal and not bad, f"rank {rank} {name}: differ from the eager model: {bad}"


def _save_pattern() -> dict:
    """DeepSpeed-Chat's save_zero_three_model: gather each parameter, keep
    p.data.cpu() in a dict, save it on rank 0 after the loop."""
    import dsrun
    from dsrun.runtime import comm

    dsrun.init_distributed()
    torch.manual_seed(0)
    with dsrun.zero.Init():
        model = Outer()
    results = {}
    for label in ("init", "stage3"):
        if label == "stage3":
            cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
                   "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
            engine, *_ = dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=cfg)
            model = engine.module
        kept = {}
        for name, p in model.named_parameters():
            with dsrun.zero.GatheredParameters([p]):
                kept[name] = p.data.cpu()
        path = os.path.join(os.environ["ZI_TMP"], f"{label}.pt")
        if comm.get_rank() == 0:
            torch.save(kept, path)
        comm.barrier()
        loaded = torch.load(path)
        truth = {}
        for name, p in model.named_parameters():
            with dsrun.zero.GatheredParameters([p]):
                truth[name] = p.data.clone()
        results[label] = {n: torch.equal(loaded[n], truth[n]) and torch.equal(kept[n], truth[n]) for n in truth}
    return results


def test_tensors_taken_from_gathered_parameters_stay_valid(tmp_path, monkeypatch):
    monkeypatch.setenv("ZI_TMP", str(tmp_path))
    for rank, r in enumerate(run_ranks(_save_pattern, 2, timeout=180)):
        for label, equal in r.items():
            assert equal and all(equal.values()), f"rank {rank} {label}: {equal}"


class Wide(nn.Module):
    """LAYERS x Linear(WIDTH, WIDTH), initialised after construction."""

    def __init__(self, layers: int = 16, width: int = 2048):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("weight"):
                p.data.mul_(0.5)

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


def _construction_peak() -> dict:
    import dsrun
    from dsrun.runtime.memory import profile as memory_profile

    topo = dsrun.init_distributed()
    with memory_profile.phase("construction"):  # resets the kernel's peak RSS at its start
        with dsrun.zero.Init():
            model = Wide()
    record = memory_profile.recorded_phases()["construction"]
    assert record["rss_peak_reset"], memory_profile.rss_source()  # the peak is this phase's own
    numels = [p.ds_numel for p in model.parameters()]
    return {"peak": record["rss_peak"] - record["rss_start"], "model": 4 * sum(numels),
            "largest": 4 * max(numels), "world": topo.world_size}


@pytest.mark.slow
def test_construction_peak_is_the_shards_plus_the_largest_parameters():
    for rank, r in enumerate(run_ranks(_construction_peak, 2, timeout=300)):
        shards = r["model"] / r["world"]
        bound = shards + 3 * r["largest"] + 32 * MiB
        assert r["peak"] <= bound, (f"rank {rank}: construction peak {r['peak'] / MiB:.0f} MiB > "
                                    f"{bound / MiB:.0f} MiB (model {r['model'] / MiB:.0f} MiB)")
        assert r["peak"] < 0.75 * r["model"]


def test_placement_follows_remote_device_and_the_backends_device():
    from dsrun.runtime.zero.init import Placement, choose_placement

    meta, cuda, cpu = torch.device("meta"), torch.device("cuda", 1), torch.device("cpu")
    assert choose_placement(None, True, meta) == Placement(meta, meta)
    assert choose_placement("none", False, cuda) == Placement(cuda, cuda)
    assert choose_placement("cpu", True, cuda) == Placement(cuda, cpu, pin=True)
    assert choose_placement("cpu", False, cuda) == Placement(cuda, cpu, pin=False)
    assert choose_placement("cpu", True, cpu) == Placement(cpu, cpu, pin=False)  # nothing to pin for
    assert choose_placement("nvme", True, cuda, "nvme") == Placement(cuda, cpu, pin=True, nvme=True)
    with pytest.raises(ValueError, match="offload_param.device='nvme'"):
        choose_placement("nvme", False, cuda, "cpu")
    with pytest.raises(ValueError, match="remote_device"):
        choose_placement("gpu", False, cuda)


def test_the_configs_offload_param_decides_where_shards_live():
    from dsrun.runtime.zero.init import resolve_remote

    hf = {"train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                            "offload_param": {"device": "cpu", "pin_memory": True}}}
    assert resolve_remote(None, False, hf) == ("cpu", True, "cpu")  # "auto" elsewhere is not read
    assert resolve_remote("cpu", True, None) == ("cpu", True, None)
    assert resolve_remote("nvme", False, {"zero_optimization": {"stage": 3}}) == ("nvme", False, "none")
    assert resolve_remote(None, False, {"zero_optimization": {"cpu_offload_param": True}}) == ("cpu", False, "cpu")
    with pytest.raises(ValueError, match="offload_param.device: Input should be"):
        resolve_remote(None, False, {"zero_optimization": {"offload_param": {"device": "gpu"}}})


def test_writes_are_routed_through_the_full_value_on_a_forced_device():
    """The write-through mode on its own, one process, no collectives: the
    'shard' is a copy and the build device is meta for shape-only calls."""
    from dsrun.runtime.zero.init_writes import Residency, WriteThroughMode
    from dsrun.runtime.zero.params import ZeroParam

    store = {}
    p = nn.Parameter(torch.arange(6.0).view(2, 3))
    rec = ZeroParam(p, p.shape)
    log = []

    def evict(q):
        store["full"] = q.data.clone()
        record_of_q = q._dsrun_zero
        record_of_q.init_full = False
        q.data = torch.empty(0)
        log.append("evict")

    def gather(q):
        q.data = store["full"].clone()
        q._dsrun_zero.init_full = True
        log.append("gather")

    rec.init_shard = torch.empty(0)
    evict(p)
    residency = Residency(gather, evict)
    with WriteThroughMode(residency), torch.device("meta"):
        assert p.shape == (2, 3) and p.dim() == 2 and p.size(1) == 3 and p.numel() == 6  # no gather
        assert log == ["evict"]
        made = torch.empty(4)
        assert made.device.type == "meta"  # factories follow the forced device
        with torch.no_grad():
            p.mul_(2)
        nn.init.constant_(p.data[0], -1.0)
    residency.release()
    assert log == ["evict", "gather", "evict"]
    assert torch.equal(store["full"], torch.tensor([[-1.0, -1.0, -1.0], [6.0, 8.0, 10.0]]))
