"""The table of which settings combine: every pair either works or is refused up front.

[Note: the combination table]
A job turns on some of the SETTINGS below (read from the resolved config,
the model and the mesh's degrees by `settings_of`). Every pair of them has
one entry in TABLE: `Works` (the pair trains; `test` names the pytest node
that trains it against its reference, or is None where no test covers the
pair yet, shown as "works (untested)") or `Refused` (why, and what to
change). The pairs no feature's own test trains (`_TESTED`) are trained by
one table-driven test (WALK_TEST, tests/parallel/test_combination_walk.py),
each against one process. Settings that
are values of one key (the ZeRO stages, the pipeline schedules, the devices
of one offload) never meet, so they have no entries (`EXCLUSIVE`).

`check_combinations` raises one ConfigError listing every refused pair a
job has; `initialize` calls it while reading the config, before its first
collective (the ranks' agreement, which re-raises the error on every rank),
so a refused combination never reaches the composition step.

One case of a working pair is refused from the model rather than the
settings: experts that are themselves split over the tensor ranks
(`split_experts`; plain experts beside tensor parallelism work).

Refusals about values (a degree that does not divide the world, hpZ blocks
spanning two nodes, a MiCS size that does not divide ZeRO's group) stay
where the values are used; this table holds the pairs only. The config
schema refuses the ZeRO++ features and parameter offload below stage 3 and
fp16 with bf16 while loading, with the same reasons as the entries here.
docs/combinations.md is generated from TABLE (docs/hooks.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from dsrun.runtime.config import ConfigError, DsConfig
from dsrun.runtime.fp16.onebit.base import CompressedCommOptimizer
from dsrun.runtime.parallel.expert.groups import is_expert_param
from dsrun.runtime.parallel.pipe.module import PipelineModule

SCHEDULES = ("1f1b", "interleaved", "zb-h1")
ONEBIT_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")

# Setting name -> how a job turns it on (the wording of the docs and of the errors).
SETTINGS: dict[str, str] = {
    **{f"pipeline:{s}": f"a PipelineModule with pipeline.schedule={s!r}" for s in SCHEDULES},
    "tensor": "tensor parallelism (tensor_parallel.autotp_size > 1, tp_model_init, or Megatron layers)",
    "sequence": "Ulysses sequence parallelism (sequence_parallel_size > 1 or mesh_param)",
    "expert": "Mixture-of-Experts layers (expert parallelism)",
    **{f"zero:{s}": f"zero_optimization.stage={s}" for s in range(4)},
    **{f"offload_optimizer:{d}": f"zero_optimization.offload_optimizer.device={d!r}" for d in ("cpu", "nvme")},
    **{f"offload_param:{d}": f"zero_optimization.offload_param.device={d!r}" for d in ("cpu", "nvme")},
    "mics": "MiCS (zero_optimization.mics_shard_size > 0, stages 1-3)",
    "hpz": "ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size > 1)",
    "qgz": "ZeRO++ qgZ (zero_optimization.zero_quantized_gradients)",
    "qwz": "ZeRO++ qwZ (zero_optimization.zero_quantized_weights)",
    "onebit": "a 1-bit optimizer (OneBitAdam, ZeroOneAdam, OneBitLamb)",
    "activation_checkpointing": "activation checkpointing (the activation_checkpointing section, or a "
                                "PipelineModule's activation_checkpoint_interval > 0)",
    "curriculum": "curriculum learning (curriculum_learning.enabled, or data_efficiency's curriculum sampling)",
    "random_ltd": "random-LTD (data_efficiency.data_routing.random_ltd.enabled)",
    "fp16": "fp16.enabled",
    "bf16": "bf16.enabled",
    "gradient_accumulation": "gradient_accumulation_steps > 1",
}

# Settings that are values of one key: a job has at most one of each group, so they never pair.
EXCLUSIVE: tuple[frozenset[str], ...] = (
    frozenset(f"pipeline:{s}" for s in SCHEDULES),
    frozenset(f"zero:{s}" for s in range(4)),
    frozenset({"offload_optimizer:cpu", "offload_optimizer:nvme"}),
    frozenset({"offload_param:cpu", "offload_param:nvme"}),
)


@dataclass(frozen=True)
class Works:
    """The pair trains. test: the pytest node id of a test training it
    (None: no test covers it yet)."""

    test: str | None = None


@dataclass(frozen=True)
class Refused:
    """The pair is refused at initialize: why, and what to change."""

    reason: str
    fix: str


def _pairs(a: Iterable[str], b: Iterable[str]) -> list[frozenset[str]]:
    return [frozenset((x, y)) for x in a for y in b if x != y]


PIPELINES = [f"pipeline:{s}" for s in SCHEDULES]
OFFLOADS = ["offload_optimizer:cpu", "offload_optimizer:nvme", "offload_param:cpu", "offload_param:nvme"]
ZERO_BELOW_3 = ["zero:0", "zero:1", "zero:2"]

# The refused pairs: (settings, reason, fix), expanded into TABLE below.
_REFUSED: list[tuple[list[frozenset[str]], str, str]] = [
    (_pairs(["pipeline:zb-h1"], ["zero:3", "offload_param:cpu", "offload_param:nvme", "qwz"]),
     "zero bubble defers each weight gradient past the next micro-batch's forward, while stage 3 (which "
     "this feature needs) releases the gathered parameters after each backward",
     "use pipeline.schedule '1f1b' or 'interleaved' with stage 3, or stage 1/2 with zb-h1"),
    (_pairs(["hpz", "qgz"], PIPELINES),
     "ZeRO++ hpZ and qgZ split ZeRO's group of the mesh, which no test has checked inside a pipeline's "
     "stages yet",
     "turn hpZ/qgZ off (zero_hpz_partition_size 1, zero_quantized_gradients false) or train without the "
     "pipeline"),
    (_pairs(["expert"], ["mics", "hpz", "qgz"] + OFFLOADS),
     "ZeRO partitions expert parameters over their expert-data-parallel group, which this feature "
     "does not build its groups from",
     "turn the ZeRO feature off, or train the model without MoE layers"),
    (_pairs(["onebit"], PIPELINES),
     "the 1-bit optimizers' compressed all-reduce is not built into the pipeline's step",
     "use Adam/AdamW"),
    (_pairs(["onebit"], ["expert"]),
     "the 1-bit optimizers would average expert gradients over every rank (MoE experts differ "
     "between expert-parallel ranks)",
     "use Adam/AdamW (any ZeRO stage)"),
    (_pairs(["onebit"], ["zero:1", "zero:2", "zero:3", "mics", "hpz", "qgz", "qwz"] + OFFLOADS),
     "the 1-bit optimizers need every parameter and optimizer state whole on every rank (as in DeepSpeed)",
     "use zero_optimization.stage 0 with them, or Adam/AdamW with ZeRO"),
    (_pairs(["hpz", "qgz", "qwz", "offload_param:cpu", "offload_param:nvme"], ZERO_BELOW_3),
     "it works on partitioned parameters, which only stage 3 has",
     "set zero_optimization.stage to 3, or turn the feature off"),
    (_pairs(["fp16"], ["bf16"]), "a run trains in one 16-bit format", "enable at most one of fp16 and bf16"),
    (_pairs(["mics"], ["hpz", "qgz"]),
     "ZeRO++ hpZ and qgZ split ZeRO's whole group of the mesh, which MiCS already splits into its shard groups",
     "turn MiCS (mics_shard_size) or the ZeRO++ feature off"),
    (_pairs(["random_ltd"], PIPELINES),
     "random-LTD numbers and counts the converted layers of the module it is given (total_layer_num, "
     "random_ltd_layer_id), and a pipeline stage holds only its own layers",
     "train random-LTD without the pipeline"),
    (_pairs(["random_ltd"], ["sequence"]),
     "each sequence rank would draw its kept tokens from its own slice of the sequence (up to the scheduled "
     "number out of every slice: the sequence ranks together keep more tokens than one process, and others; "
     "2 steps on 4 ranks gave a loss 3% off one process's)",
     "train random-LTD without sequence parallelism"),
]

# Works pairs a test trains against its reference (pair -> pytest node id); the table test
# collects each id. A pair with "zero:0" is the other setting alone (stage 0 is the default).
_PIPE = "tests/parallel/test_pipe_engine.py::"
_TP = "tests/parallel/test_autotp.py::test_training_tp_x_dp_equals_dp"
_MOE_ZERO = "tests/parallel/test_moe_zero.py::"
_OFFLOAD = "tests/offload/test_optimizer_offload.py::"
_TESTED_LIST: list[tuple[str, str, str]] = [
    ("pipeline:1f1b", "zero:0", _PIPE + "test_pipeline_matches_one_process_training[1f1b-2-4-1-False]"),
    ("pipeline:zb-h1", "zero:0", _PIPE + "test_pipeline_matches_one_process_training[zb-h1-2-4-1-False]"),
    ("pipeline:interleaved", "zero:0", _PIPE + "test_pipeline_matches_one_process_training[interleaved-2-4-2-False]"),
    ("pipeline:1f1b", "gradient_accumulation", _PIPE + "test_pipeline_matches_one_process_training[1f1b-2-4-1-False]"),
    ("pipeline:zb-h1", "gradient_accumulation",
     _PIPE + "test_pipeline_matches_one_process_training[zb-h1-2-4-1-False]"),
    ("pipeline:interleaved", "gradient_accumulation",
     _PIPE + "test_pipeline_matches_one_process_training[interleaved-2-4-2-False]"),
    ("pipeline:1f1b", "zero:1", _PIPE + "test_pipeline_with_zero_stages[1]"),
    ("pipeline:1f1b", "zero:2", _PIPE + "test_pipeline_with_zero_stages[2]"),
    ("pipeline:zb-h1", "zero:2", _PIPE + "test_tied_weights_and_eval_batch[zb-h1-2]"),
    *[(f"pipeline:{p}", f"zero:{s}", "tests/parallel/test_combinations.py::"
       f"test_pipeline_schedules_with_zero_1_and_2_equal_one_process[{p}-{v}-{s}]")
      for p, v, s in (("interleaved", 2, 1), ("interleaved", 2, 2), ("zb-h1", 1, 1))],
    *[(f"pipeline:{p}", "activation_checkpointing", "tests/parallel/test_combinations.py::"
       f"test_pipeline_schedules_with_activation_checkpointing_equal_one_process[{p}-{v}]")
      for p, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))],
    ("pipeline:1f1b", "bf16", _PIPE + "test_pipeline_bf16_zero2_and_variable_sequence_lengths"),
    ("pipeline:1f1b", "fp16", _PIPE + "test_fp16_one_loss_scale_across_stages[0]"),
    ("pipeline:1f1b", "tensor", "tests/parallel/test_autotp.py::test_pipe_x_tensor_x_data_equals_data_parallel"),
    ("pipeline:1f1b", "curriculum",
     "tests/data_pipeline/test_curriculum_pipeline.py::test_pipeline_truncates_micro_batches_to_the_curriculum"),
    ("pipeline:1f1b", "expert", "tests/parallel/test_moe_mesh.py::test_moe_inside_a_pipeline_trains_like_one_stage"),
    ("tensor", "zero:0", _TP + "[gpt-0-2-False]"),
    ("tensor", "zero:1", _TP + "[gpt2-1-2-False]"),
    ("tensor", "zero:2", _TP + "[llama-2-2-True]"),
    ("tensor", "zero:3", _TP + "[llama-3-4-True]"),
    ("tensor", "bf16", "tests/parallel/test_autotp.py::test_training_tp_x_dp_bf16_close_to_dp"),
    ("tensor", "expert",
     "tests/parallel/test_moe_mesh.py::test_moe_beside_tensor_parallelism_trains_like_data_parallel[2]"),
    ("expert", "zero:0",
     "tests/parallel/test_moe_mesh.py::test_moe_beside_tensor_parallelism_trains_like_data_parallel[0]"),
    *[("expert", f"zero:{s}", _MOE_ZERO + "test_zero_1_2_3_ep2_on_2_ranks_equals_all_experts_local")
      for s in (1, 2, 3)],
    ("expert", "gradient_accumulation",
     "tests/parallel/test_combinations.py::test_experts_with_gradient_accumulation_equal_all_experts_local"),
    *[("expert", p, _MOE_ZERO + "test_bf16_trains_and_fp16_overflow_in_one_expert_skips_on_every_rank")
      for p in ("bf16", "fp16")],
    *[("sequence", s, "tests/parallel/test_ulysses.py::test_training_sequence_x_data_equals_data_parallel")
      for s in ("zero:2", "zero:3", "gradient_accumulation")],
    *[("sequence", s, "tests/parallel/test_combinations.py::test_sequence_with_zero_0_and_1_equals_data_parallel")
      for s in ("zero:0", "zero:1")],
    ("sequence", "tensor", "tests/parallel/test_sequence_3d.py::test_tensor_x_sequence_equals_one_process"),
    ("pipeline:1f1b", "sequence", "tests/parallel/test_sequence_3d.py::test_pipeline_x_sequence_equals_one_process"),
    *[(f"pipeline:{p}", "zero:3", f"tests/parallel/test_pipe_zero.py::"
       f"test_zero3_with_a_pipeline_matches_one_process[{p}-{v}]") for p, v in (("1f1b", 1), ("interleaved", 2))],
    *[("pipeline:1f1b", f"offload_optimizer:{d}", "tests/parallel/test_pipe_zero.py::"
       f"test_optimizer_offload_with_a_pipeline_matches_one_process[{s}-{d}]") for s, d in ((2, "cpu"), (3, "nvme"))],
    *[(z, "tensor", "tests/compression/test_zeropp_mesh.py::test_hpz_and_qgz_with_tensor_parallelism")
      for z in ("hpz", "qgz")],
    ("hpz", "sequence",
     "tests/compression/test_zeropp_mesh.py::test_hpz_with_sequence_parallelism_equals_plain_and_one_process"),
    ("onebit", "tensor",
     "tests/compression/test_onebit_mesh.py::test_onebit_adam_on_the_data_axis_of_tensor_parallelism"),
    ("sequence", "mics",
     "tests/zero/test_mics_sequence.py::test_mics_with_sequence_parallelism_equals_plain_zero_and_one_process"),
    ("mics", "zero:2", "tests/zero/test_mics.py::test_mics_trains_as_plain_zero[2]"),
    ("mics", "zero:3", "tests/zero/test_mics.py::test_mics_trains_as_plain_zero[3]"),
    ("hpz", "zero:3",
     "tests/compression/test_hpz.py::test_hpz_matches_plain_stage3_and_keeps_backward_gathers_inside_nodes[fp32]"),
    ("hpz", "bf16",
     "tests/compression/test_hpz.py::test_hpz_matches_plain_stage3_and_keeps_backward_gathers_inside_nodes[bf16]"),
    ("qgz", "zero:3",
     "tests/compression/test_qgz.py::test_stage3_losses_close_to_plain_and_gradient_bytes_fall[2-fp32]"),
    ("qgz", "fp16", "tests/compression/test_qgz.py::test_fp16_overflow_through_int4_skips_the_step"),
    *[("qwz", s, f"tests/compression/test_qwz.py::test_stage3_losses_close_to_plain_and_a_quarter_of_the_bytes[{p}]")
      for s, p in (("zero:3", "fp32"), ("bf16", "bf16"))],
    ("onebit", "zero:0", "tests/compression/test_onebit.py::test_tiny_model_trains_with_each_optimizer[fp32]"),
    ("onebit", "bf16", "tests/compression/test_onebit.py::test_tiny_model_trains_with_each_optimizer[bf16]"),
    ("onebit", "fp16", "tests/compression/test_onebit.py::test_tiny_model_trains_with_each_optimizer[fp16]"),
    *[(f"offload_optimizer:{d}", f"zero:{s}", _OFFLOAD + f"test_losses_and_masters_equal_no_offload[{s}-fp32-{d}]")
      for d in ("cpu", "nvme") for s in (1, 2, 3)],
    *[(f"offload_optimizer:{d}", p, _OFFLOAD + f"test_losses_and_masters_equal_no_offload[2-{p}-{d}]")
      for d in ("cpu", "nvme") for p in ("bf16", "fp16")],
    *[(f"offload_param:{d}", "zero:3", _OFFLOAD + f"test_param_offload_equals_no_offload[param_{d}-none-{d}-fp32]")
      for d in ("cpu", "nvme")],
    *[(f"offload_param:{d}", "bf16", _OFFLOAD + f"test_param_offload_equals_no_offload[param_{d}-none-{d}-bf16]")
      for d in ("cpu", "nvme")],
    *[(f"offload_param:{d}", f"offload_optimizer:{d}",
       _OFFLOAD + f"test_param_offload_equals_no_offload[both_{d}-{d}-{d}-fp32]")
      for d in ("cpu", "nvme")],
    ("zero:0", "gradient_accumulation", "tests/runtime/test_stage0_equivalence.py::test_matches_single_process[2-4]"),
    # Stages 1-3 x fp32/bf16/fp16, gradient accumulation 2, against stage 0 in the same precision.
    *[(f"zero:{s}", p, "tests/zero/test_engine_stages.py::test_stages_match_stage0_two_ranks")
      for s in (1, 2, 3) for p in ("bf16", "fp16", "gradient_accumulation")],
]
_TESTED: dict[frozenset[str], str] = {frozenset((a, b)): test for a, b, test in _TESTED_LIST}

# The "works" pairs no test above trains are trained by one table-driven test, each against one
# process (tests/parallel/test_combination_walk.py), under this id with the pair as its parameter.
WALK_TEST = "tests/parallel/test_combination_walk.py::test_pair_trains_like_one_process"


def _build() -> dict[frozenset[str], Works | Refused]:
    table: dict[frozenset[str], Works | Refused] = {}
    for pairs, reason, fix in _REFUSED:
        for pair in pairs:
            if any(pair <= group for group in EXCLUSIVE):
                continue
            table.setdefault(pair, Refused(reason, fix))  # the first (most specific) reason wins
    for a, b in itertools.combinations(SETTINGS, 2):
        pair = frozenset((a, b))
        if pair in table or any(pair <= group for group in EXCLUSIVE):
            continue
        a, b = sorted(pair)
        table[pair] = Works(_TESTED.get(pair, f"{WALK_TEST}[{a}-x-{b}]"))
    return table


TABLE: dict[frozenset[str], Works | Refused] = _build()
# The pairs the walk trains (sorted by their test ids).
WALKED: list[frozenset[str]] = sorted((p for p, e in TABLE.items() if isinstance(e, Works) and e.test
                                       and e.test.startswith(WALK_TEST)), key=lambda p: TABLE[p].test)


def settings_of(cfg: DsConfig, model: torch.nn.Module, pipe: int, model_degree: int, sequence: int,
                optimizer: Any = None) -> set[str]:
    """The SETTINGS a job turns on: `cfg` resolved, `model` the model given
    to initialize, the mesh's pipe/model/sequence degrees (`pipe` > 1 or a
    PipelineModule is a pipeline), `optimizer` initialize's optimizer
    argument (an instance of a 1-bit optimizer counts as "onebit")."""
    zero = cfg.zero_optimization
    on = {f"zero:{zero.stage}"}
    if isinstance(model, PipelineModule) or pipe > 1:
        on.add(f"pipeline:{cfg.pipeline.schedule}")
        pipe_cfg = cfg.pipeline  # its interval replaces the module's (check_pipeline_config, after this)
        interval = (pipe_cfg.activation_checkpoint_interval if "activation_checkpoint_interval"
                    in pipe_cfg.model_fields_set else getattr(model, "activation_checkpoint_interval", 0))
        if interval:
            on.add("activation_checkpointing")
    if model_degree > 1:
        on.add("tensor")
    if sequence > 1:
        on.add("sequence")
    if any(is_expert_param(p) for p in model.parameters()):
        on.add("expert")
    for kind in ("offload_optimizer", "offload_param"):
        device = getattr(zero, kind).device
        if device in ("cpu", "nvme"):
            on.add(f"{kind}:{device}")
    if zero.mics_shard_size > 0 and zero.stage > 0:  # stage 0 shards nothing: MiCS changes nothing there
        on.add("mics")
    flags = {"hpz": zero.zero_hpz_partition_size > 1, "qgz": zero.zero_quantized_gradients,
             "qwz": zero.zero_quantized_weights, "fp16": cfg.fp16.enabled, "bf16": cfg.bf16.enabled,
             "gradient_accumulation": cfg.gradient_accumulation_steps > 1,
             "activation_checkpointing": "activation_checkpointing" in cfg.model_fields_set,
             "curriculum": cfg.curriculum_learning.enabled
             or cfg.data_efficiency.data_sampling.curriculum_learning.enabled,
             "random_ltd": cfg.data_efficiency.data_routing.random_ltd.enabled,
             "onebit": (cfg.optimizer is not None and cfg.optimizer.type in ONEBIT_OPTIMIZERS)
             or isinstance(optimizer, CompressedCommOptimizer)}
    on.update(name for name, value in flags.items() if value)
    return on


def split_experts(model: torch.nn.Module, model_degree: int) -> list[str]:
    """The "expert" x "tensor" case the table cannot see from the settings:
    expert weights split over the tensor ranks (experts built from
    ColumnParallelLinear/RowParallelLinear). ZeRO's expert partitions and
    the gradient norm take each expert whole on every tensor rank, so such
    a model would fail at its first step, inside the norm; [] when the
    experts are plain (replicated over the tensor ranks, which works)."""
    if model_degree <= 1:
        return []
    split = [n for n, p in model.named_parameters()
             if is_expert_param(p) and getattr(p, "tensor_model_parallel", False)]
    if not split:
        return []
    return [f"{SETTINGS['expert']} with {SETTINGS['tensor']} is not supported when the experts themselves are "
            f"split over the tensor ranks ({split[0]}, ...): ZeRO partitions and the gradient norm take each "
            "expert whole; build the experts from plain nn.Linear (replicated over the tensor ranks)"]


def refusals(settings: Iterable[str]) -> list[str]:
    """One sentence per refused pair among `settings` (names of SETTINGS),
    naming both settings, the reason and the fix; [] when all combine."""
    unknown = sorted(set(settings) - SETTINGS.keys())
    if unknown:
        raise KeyError(f"unknown settings {unknown}; known: {sorted(SETTINGS)}")
    out = []
    for a, b in itertools.combinations(sorted(settings), 2):
        entry = TABLE.get(frozenset((a, b)))
        if isinstance(entry, Refused):
            out.append(f"{SETTINGS[a]} with {SETTINGS[b]} is not supported: {entry.reason}; {entry.fix}")
    return out


def check_combinations(settings: Iterable[str], extra: Iterable[str] = ()) -> None:
    """Raise one ConfigError listing every refused pair among `settings`,
    after them the `extra` problems (e.g. `split_experts`'s).

    Raises:
        ConfigError: one problem per refused pair (see `refusals`) or extra.
        KeyError: a name that is not one of SETTINGS (a bug of the caller).
    """
    problems = refusals(settings) + list(extra)
    if problems:
        raise ConfigError(*problems)
