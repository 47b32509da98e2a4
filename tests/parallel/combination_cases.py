"""Training jobs for the walk of the combination table (test_combination_walk.py).

[Note: one job per pair]
For a pair of settings of dsrun/runtime/parallel/combinations.py, `plan`
builds the smallest job that turns both on: each setting edits a `Plan`
(the ds_config and how the model and the batches are made, `SETUP`), in
the order of `combinations.SETTINGS`. Some settings bring what they need:
hpZ, qgZ, qwZ, parameter offload and MiCS run at ZeRO-3 (MiCS at ZeRO-2
with zb-h1, which refuses stage 3; its shard groups are halves of ZeRO's
group), optimizer offload at ZeRO-2 (unless the pair names a stage), and a
pipeline runs 2
micro-batches per step (so its pairs also accumulate gradients, a pair
tested on its own). `reference` is the same job on one process: the same
model (every expert local), global batch, micro-batches, precision,
optimizer, curriculum and random-LTD, at ZeRO-0 without pipeline, tensor,
sequence, ZeRO features or activation checkpointing.

The model is test_sequence_3d's tiny Llama-like LM (embedding, 2 blocks of
grouped-query attention through DistributedAttention and a SwiGLU MLP,
head), optionally with MoE MLPs (2 experts, dropless top-1, each expert
from a seed of its global name), the blocks checkpointed
(dsrun.checkpointing.checkpoint) or wrapped for random-LTD. `train` runs
STEPS steps of a plan on the ranks of the current process group and
returns (loss, global gradient norm) per step, the loss averaged over the
global batch.

Random-LTD draws the kept tokens from torch's global generator. So that a
data rank's micro-batch keeps the same tokens as the reference's, a forward
pre-hook seeds the generator before each dropping layer from (step, the
micro-batch's place in the global batch, the block).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from tests.parallel import test_sequence_3d as lm

WORLD = 4            # ranks of the walk's world
SAMPLES = 8          # the global batch (sequences per step)
STEPS = 2
CLIP = 0.5           # below the gradient norms: clipping acts
TOKENS = lm.N        # sequence length
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": TOKENS,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 2}}
RANDOM_LTD = {"enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 2, "random_ltd_layer_id": [0, 1],
              "model_mask_name": None, "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
              "random_ltd_schedule": {"min_value": 4, "max_value": TOKENS, "schedule_type": "fixed_linear",
                                      "schedule_config": {"require_steps": 4, "seq_per_step": 2}}}


@dataclass
class Plan:
    """One job: `config` (the ds_config without batch sizes, ZeRO stage and
    degrees, which `config_of` adds) and how the model and batches are made."""

    settings: tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    zero: dict = field(default_factory=dict)  # zero_optimization keys besides the stage
    stage: int | None = None                  # named by a zero:N setting
    min_stage: int = 0                        # what the other settings need
    max_stage: int = 3                        # what the pipeline schedule allows
    pipe: int = 1
    virtual: int = 1                          # model chunks per stage (interleaved schedule)
    tensor: int = 1
    sequence: int = 1
    experts: bool = False
    mics: bool = False                        # MiCS shards within halves of ZeRO's group
    checkpointing: bool = False
    random_ltd: bool = False
    curriculum: bool = False
    accumulation: int = 1                     # micro-batches per step on each rank
    world: int = WORLD

    @property
    def data(self) -> int:
        return self.world // (self.pipe * self.tensor * self.sequence)

    @property
    def micro(self) -> int:
        return SAMPLES // (self.data * self.accumulation)


def _pipeline(schedule: str):
    def setup(p: Plan) -> None:
        p.pipe, p.virtual = 2, 2 if schedule == "interleaved" else 1
        p.max_stage = 2 if schedule == "zb-h1" else 3  # zb-h1 x zero:3 is refused
        p.accumulation = max(p.accumulation, 2)
        p.config["pipeline"] = {"schedule": schedule, "virtual_stages": p.virtual}
    return setup


def _zero(stage: int):
    def setup(p: Plan) -> None:
        p.stage = stage
    return setup


def _offload(kind: str, device: str, min_stage: int):
    def setup(p: Plan) -> None:
        p.zero[kind] = {"device": device}  # plan() adds an NVMe device's path
        p.min_stage = max(p.min_stage, min_stage)
    return setup


def _zero_feature(key: str, value, min_stage: int = 3):
    def setup(p: Plan) -> None:
        p.zero[key] = value
        p.min_stage = max(p.min_stage, min_stage)
    return setup


def _set(**attrs):
    def setup(p: Plan) -> None:
        for name, value in attrs.items():
            setattr(p, name, value)
    return setup


def _section(key: str, value, **attrs):
    def setup(p: Plan) -> None:
        p.config[key] = copy.deepcopy(value)
        _set(**attrs)(p)
    return setup


SETUP = {
    **{f"pipeline:{s}": _pipeline(s) for s in ("1f1b", "interleaved", "zb-h1")},
    "tensor": _set(tensor=2),
    "sequence": _set(sequence=2),
    "expert": _set(experts=True),
    **{f"zero:{s}": _zero(s) for s in range(4)},
    **{f"offload_optimizer:{d}": _offload("offload_optimizer", d, 2) for d in ("cpu", "nvme")},
    **{f"offload_param:{d}": _offload("offload_param", d, 3) for d in ("cpu", "nvme")},
    "mics": _set(mics=True, min_stage=3),
    "hpz": _zero_feature("zero_hpz_partition_size", 2),
    "qgz": _zero_feature("zero_quantized_gradients", True),
    "qwz": _zero_feature("zero_quantized_weights", True),
    # freeze_step 1: the first step is Adam's warm-up, the second exchanges compressed momenta
    "onebit": _section("optimizer", {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 1}}),
    "activation_checkpointing": _section("activation_checkpointing", {}, checkpointing=True),
    "curriculum": _section("curriculum_learning", CURRICULUM, curriculum=True),
    "random_ltd": _section("data_efficiency", {"enabled": True, "data_routing": {"enabled": True,
                                                                                 "random_ltd": RANDOM_LTD}},
                           random_ltd=True),
    "fp16": _section("fp16", {"enabled": True, "initial_scale_power": 8}),
    "bf16": _section("bf16", {"enabled": True}),
    "gradient_accumulation": _set(accumulation=2),
}


def plan(settings, nvme_path: str = "") -> Plan:
    """The job turning on `settings` (names of combinations.SETTINGS) on
    WORLD ranks; see [Note: one job per pair]."""
    from dsrun.runtime.parallel.combinations import SETTINGS
    p = Plan(settings=tuple(sorted(settings, key=list(SETTINGS).index)),
             config={"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    for name in p.settings:
        SETUP[name](p)
    for kind in ("offload_optimizer", "offload_param"):
        if kind in p.zero and p.zero[kind]["device"] == "nvme":
            p.zero[kind]["nvme_path"] = nvme_path
    return p


def reference(p: Plan) -> Plan:
    """`p` on one process: see [Note: one job per pair]."""
    config = {k: v for k, v in p.config.items() if k not in ("pipeline", "activation_checkpointing")}
    return replace(p, settings=(), config=config, zero={}, stage=0, min_stage=0, max_stage=3, pipe=1, virtual=1,
                   tensor=1, sequence=1, mics=False, checkpointing=False, world=1, accumulation=SAMPLES // p.micro)


def config_of(p: Plan) -> dict:
    """The ds_config of `p`."""
    return {**p.config, "train_micro_batch_size_per_gpu": p.micro, "gradient_accumulation_steps": p.accumulation,
            "gradient_clipping": CLIP, "steps_per_print": 10**6,
            "zero_optimization": {"stage": p.stage if p.stage is not None else min(p.min_stage, p.max_stage),
                                  **p.zero, **({"mics_shard_size": p.data * p.sequence // 2} if p.mics else {})},
            **({"pipeline": {**p.config.get("pipeline", {}), "stages": p.pipe}} if p.pipe > 1 else {}),
            "tensor_parallel": {"autotp_size": p.tensor}, "sequence_parallel_size": p.sequence}


# -- the model ---------------------------------------------------------------------------------

class Expert(torch.nn.Module):
    """An MoE expert: a GELU MLP, [..., W] -> [..., W]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in = torch.nn.Linear(lm.WIDTH, 2 * lm.WIDTH)
        self.fc_out = torch.nn.Linear(2 * lm.WIDTH, lm.WIDTH)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(lm.Block):
    """test_sequence_3d's block; with `ep` > 0 its MLP is an MoE of 2
    experts at ep_size `ep` (the auxiliary loss enters with weight 0: it
    depends on how tokens are grouped), with `checkpointed` its body runs
    under dsrun.checkpointing.checkpoint."""

    def __init__(self, seed: int, ep: int = 0, checkpointed: bool = False):
        super().__init__(seed)
        self.seed, self.checkpointed, self.moe = seed, checkpointed, None
        if ep:
            from dsrun.moe.layer import MoE
            torch.manual_seed(seed + 100)
            self.moe = MoE(lm.WIDTH, Expert(), num_experts=2, ep_size=ep, k=1, drop_tokens=False,
                           min_capacity=1, use_rts=False)

    def _body(self, x):
        if self.moe is None:
            return lm.Block.forward(self, x)
        x = x + self.attn(self.input_norm(x))
        out, l_aux, _ = self.moe(self.post_norm(x))
        return x + out + 0.0 * l_aux

    def forward(self, x):
        if self.checkpointed:
            import dsrun
            return dsrun.checkpointing.checkpoint(self._body, x)
        return self._body(x)


def _layer_specs(p: Plan, ep: int) -> list:
    from dsrun.pipe import LayerSpec
    block = {"ep": ep, "checkpointed": p.checkpointing}
    return [LayerSpec(lm.Embed, 1), LayerSpec(Block, 2, **block), LayerSpec(Block, 3, **block),
            LayerSpec(lm.Head, 4)]


class LM(torch.nn.Sequential):
    """The layers in one module; truncates its input to the legacy
    curriculum's `curriculum_seqlen` ([Note: curriculum_seqlen])."""

    def forward(self, ids, curriculum_seqlen=None):
        return super().forward(ids if curriculum_seqlen is None else ids[:, :curriculum_seqlen])


def build(p: Plan) -> torch.nn.Module:
    """The model of `p` on the current mesh (a PipelineModule when p.pipe > 1)."""
    from dsrun.pipe import PipelineModule
    from tests.parallel.test_moe_mesh import _distinct_experts
    specs = _layer_specs(p, ep=min(p.data, 2) if p.experts else 0)
    if p.pipe > 1:
        model = PipelineModule(specs, num_stages=p.pipe, loss_fn=lm.token_mean_loss, partition_method="uniform",
                               virtual_stages=p.virtual)
    else:
        model = LM(*(spec.build() for spec in specs))
    _distinct_experts(model)
    if p.random_ltd:
        from dsrun.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd
        convert_to_random_ltd(model, Block)
    return model


# -- training ----------------------------------------------------------------------------------

def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, lm.VOCAB, (SAMPLES, TOKENS + 1), generator=torch.Generator().manual_seed(100 + step))


class _LtdSeeds:
    """Seeds torch's generator before each random-LTD layer's forward from
    (step, the micro-batch's place in the global batch, the block's seed)."""

    def __init__(self, model: torch.nn.Module, first_micro: int) -> None:
        from dsrun.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
        self.first_micro, self.step, self.calls = first_micro, 0, {}
        for layer in model.modules():
            if isinstance(layer, RandomLayerTokenDrop):
                layer.register_forward_pre_hook(self._seed)

    def start(self, step: int) -> None:
        self.step, self.calls = step, {}

    def _seed(self, layer, args) -> None:
        seed = layer.random_ltd_layer.seed
        micro = self.first_micro + self.calls.get(seed, 0)
        self.calls[seed] = self.calls.get(seed, 0) + 1
        torch.manual_seed(10_000 * self.step + 100 * micro + seed)


_MESHES: dict = {}  # (pipe, tensor, sequence) -> the mesh of this process group


def train(p: Plan) -> tuple[list[tuple[float, float]], list[str]]:
    """STEPS steps of `p` on the current process group (p.world ranks):
    (loss, global gradient norm) per step, and the settings the engine's
    config and model turn on (combinations.settings_of). Leaves no mesh,
    engine or checkpointing option behind."""
    import torch.distributed as dist

    import dsrun
    from dsrun.runtime.activation_checkpointing import checkpointing
    from dsrun.runtime.parallel.combinations import settings_of
    from dsrun.runtime.parallel.mesh import current, set_current
    from dsrun.utils import groups
    cfg = config_of(p)
    degrees = (p.pipe, p.tensor, p.sequence)
    set_current(_MESHES.get(degrees))  # a mesh of these degrees made by an earlier job: no new groups
    dsrun.init_distributed(config=cfg)  # the mesh first: the attention and the experts take their groups
    _MESHES[degrees] = current()
    try:
        data_rank = groups._get_data_parallel_rank()
        assert groups._get_data_parallel_world_size() == p.data
        model = build(p)
        params = None
        if p.experts and p.pipe == 1:
            from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
            params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                           "name": "all"})
        engine, *_ = dsrun.initialize(model=model, model_parameters=params, config=cfg)
        settings = sorted(settings_of(engine.config, model, p.pipe, p.tensor, p.sequence))
        seeds = _LtdSeeds(model, data_rank * p.accumulation) if p.random_ltd else None
        out = []
        for step in range(STEPS):
            if seeds:
                seeds.start(step)
            mine = _tokens(step)[data_rank * p.micro * p.accumulation:][:p.micro * p.accumulation]
            batches = [_micro_batch(p, engine, mine[m * p.micro:(m + 1) * p.micro]) for m in range(p.accumulation)]
            if p.pipe > 1:
                loss = float(engine.train_batch(iter(batches)))
            else:
                loss = 0.0
                for ids, labels in batches:
                    logits = engine(ids)
                    micro_loss = lm.token_mean_loss(logits.float(), labels[:, :logits.shape[1]])
                    engine.backward(micro_loss)
                    engine.step()
                    loss += float(micro_loss.detach()) / p.accumulation
                if p.data > 1:  # the data ranks train on different samples: the step's loss is their mean
                    total = torch.tensor(loss)
                    dist.all_reduce(total, group=groups._get_data_parallel_group())
                    loss = float(total) / p.data
            out.append((loss, float(engine.get_global_grad_norm())))
        engine.destroy()
        return out, settings
    finally:
        checkpointing.reset()
        set_current(None)


def _micro_batch(p: Plan, engine, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of `rows`, this sequence rank's slice of the tokens.
    Under the curriculum with sequence parallelism the sequences are cut
    to the step's length before they are split (the model, holding a
    slice, cannot cut them)."""
    from dsrun.sequence import shard_sequence
    ids, labels = rows[:, :-1], rows[:, 1:]
    if p.sequence > 1:
        if p.curriculum:
            length = engine.curriculum_scheduler_legacy.update_difficulty(engine.global_steps + 1)
            ids, labels = ids[:, :length], labels[:, :length]
        ids, labels = shard_sequence(ids, 1), shard_sequence(labels, 1)
    return ids, labels
