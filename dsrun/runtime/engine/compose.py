"""The composition step: every parallelism of a job applied to the model, in one order.

[Note: the order of composition]
`initialize` reads its arguments and the config, then calls `compose`,
which applies the job's parallelisms in this order (each step sees what
the ones before it did):

1. the mesh: one ParallelMesh of pipe x data x sequence x model with the
   degrees `resolve_degrees` found (the one the script built its layers on,
   which `init_distributed(config=)` or an mpu may have declared, or built
   here; see [Note: one declaration of the degrees] in
   runtime/parallel/degrees.py). `initialize` reads that mesh once, when it
   begins, and passes it in ([Note: the declared mesh] in
   runtime/parallel/mesh.py); everything below takes the job's mesh as an
   argument;
2. tensor parallelism: a model the config asks to shard
   (`tensor_parallel.autotp_size`) is sharded by layer names over the
   model axis (AutoTP, as tp_model_init); a model of Megatron layers, or
   one tp_model_init sharded, already is;
3. sequence parallelism: the mesh's sequence axis, whose group the model's
   DistributedAttention layers took when built; ZeRO's group becomes
   data x sequence ("sequence_data"), as in DeepSpeed;
4. expert groups: MoE layers made their expert-parallel and expert-data
   groups (blocks of ZeRO's group) when built; each expert parameter is
   broadcast within its expert-data group, every other parameter within
   ZeRO's group, so all copies start equal;
5. the pipeline split: a PipelineModule built only its stage's layers;
   weights tied across stages get their groups here;
6. the ZeRO strategy (or plain data parallelism) over ZeRO's group, told
   which ranks hold the rest of the model (the gradient norm's StageSpan)
   and which gradient sums run before the step (model_parallel.py).

The returned Composition is what the engine needs; the checkpoint split is
the PipelineModule's (the engine reads it from the module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsrun.runtime import comm
from dsrun.runtime.config import ConfigError, DsConfig, sequence_parallel_size_of, tensor_parallel_of
from dsrun.runtime.distributed.dist import Topology
from dsrun.runtime.engine.engine import build_strategy
from dsrun.runtime.engine.model_parallel import attach_model_parallel
from dsrun.runtime.parallel.degrees import ParallelDegrees, check_declared, declare_mesh
from dsrun.runtime.parallel.expert.groups import expert_group_name_of, expert_groups, is_expert_param
from dsrun.runtime.parallel.mesh import ParallelMesh, set_current
from dsrun.runtime.engine.pipeline_engine import tie_weights
from dsrun.runtime.engine.tp_model_init import apply_autotp, plan_autotp
from dsrun.runtime.parallel.pipe.module import PipelineModule, pipeline_degrees
from dsrun.runtime.parallel.tensor.autotp import check_shardable, shard_stage
from dsrun.runtime.strategy.data_parallel import GradientStrategy
from dsrun.runtime.zero.tensor_parallel import ZERO_INIT


@dataclass
class Composition:
    """What `compose` hands the engine.

    mesh: the job's ParallelMesh. data_axis: ZeRO's axis of it ("data", or
    "sequence_data" under sequence parallelism). strategy: the gradient
    strategy over that axis. tied: a pipeline's tied-weight groups (empty
    otherwise). pre_step_hooks: callables for Engine.register_pre_step_hook
    (the gradient sums of model_parallel.py).
    """

    mesh: ParallelMesh
    data_axis: str
    strategy: GradientStrategy
    tied: list
    pre_step_hooks: list[Callable[[], None]]


def compose(model: torch.nn.Module, cfg: DsConfig, degrees: ParallelDegrees, topology: Topology,
            built_on: ParallelMesh, make_optimizer: Callable[[list], torch.optim.Optimizer],
            model_parameters: list | None = None) -> Composition:
    """Apply the job's parallelisms to `model` (see [Note: the order of
    composition]) and build its gradient strategy. Collective: every rank
    calls it at the same point, after the ranks agreed on the config.

    Args:
        model: the model, on any device (moved to `topology.device`).
        cfg: the resolved config. degrees: resolve_degrees's answer.
        built_on: the mesh the script built its layers on (the current one
            when initialize began); kept when it has `degrees`.
        make_optimizer: builds the torch optimizer from parameters (or
            parameter-group dicts), called once the model is sharded.
        model_parameters: the optimizer's parameters (None: the model's
            parameters that require grad, after sharding).

    Raises:
        ConfigError: vocab_parallel asked for a model sharded without it.
        ValueError, NotImplementedError: as build_strategy raises.
    """
    pipeline = isinstance(model, PipelineModule)
    mesh = build_mesh(model, cfg, degrees, built_on, topology.device)
    # ZeRO's group: the ranks holding the same parameters (under sequence parallelism
    # data x sequence, as in DeepSpeed: gradients are averaged over both).
    data_axis = "sequence_data" if cfg.sequence_parallel_size > 1 else "data"
    data_group = None if mesh.size(data_axis) == topology.world_size else mesh.group(data_axis)
    model.to(topology.device)
    broadcast_module(model, mesh, src=mesh.ranks(data_axis)[0], group=data_group)
    tied = tie_weights(model, mesh) if pipeline else []
    params = (list(model_parameters) if model_parameters is not None
              else [p for p in model.parameters() if p.requires_grad])
    if pipeline and not params:  # a stage of parameterless layers: an optimizer of one empty group
        params = [{"params": []}]
    strategy = build_strategy(cfg, model, make_optimizer(params), topology, data_group=data_group,
                              mesh=mesh, data_axis=data_axis)
    hooks: list[Callable[[], None]] = []
    attach_model_parallel(model, mesh, strategy, hooks.append)
    return Composition(mesh, data_axis, strategy, tied, hooks)


def pipeline_mesh(module: PipelineModule, degrees: ParallelDegrees, built_on: ParallelMesh) -> ParallelMesh:
    """The job's mesh for a PipelineModule: its topology, or the module's
    stages x `degrees`' tensor and sequence axes x data, made the current
    mesh that `dsrun.utils.groups` answers from. `built_on` (the mesh the
    script built its layers on) is kept when it has the module's topology
    or degrees; otherwise collective: every rank creates every group."""
    topology = module.topology()
    if topology is None:
        return declare_mesh(ParallelDegrees(pipe=module.num_stages, model=degrees.model, sequence=degrees.sequence),
                            built_on)
    if (built_on.topology.get_axis_names(), built_on.topology.dims) == (topology.get_axis_names(), topology.dims):
        return built_on
    mesh = ParallelMesh(topology)
    set_current(mesh)
    return mesh


def resolve_degrees(model: torch.nn.Module, source: Any, world: int, built_on: ParallelMesh,
                    mesh_param: Any = None) -> ParallelDegrees:
    """The job's pipe x tensor x sequence degrees, resolved once from the
    model and the config (see [Note: one declaration of the degrees] in
    runtime/parallel/degrees.py): a PipelineModule's stages (or its
    topology's axes), the tensor degree of a model tp_model_init already
    sharded (or built from tensor-parallel layers on `built_on`, the mesh
    the script built its layers on) or else `tensor_parallel.autotp_size`,
    and `sequence_parallel_size` or `mesh_param`. Data parallelism takes
    the rest of the world.

    Raises:
        ConfigError: an invalid `tensor_parallel` section; a PipelineModule's
            topology differing from the config (pipeline_degrees); a stage
            AutoTP cannot shard (check_shardable); autotp_size differing from
            the degree tp_model_init sharded the model with; the sequence refusals of
            _sequence_size; degrees whose product does not divide the world;
            degrees other than those the script declared with
            init_distributed(config=...).
    """
    autotp = tensor_parallel_of(source).autotp_size
    sequence = _sequence_size(model, source, world, mesh_param)
    if isinstance(model, PipelineModule):
        degrees = pipeline_degrees(model, tensor_parallel_of(source), sequence, built_on)
        if autotp > 1 and not getattr(model, "ds_autotp_parsed", False):
            check_shardable(model, autotp, ZERO_INIT)  # this rank's stage; the agreement check tells the others
    elif _is_sharded(model):
        sharded = built_on.size("model")
        if autotp not in (1, sharded):
            raise ConfigError(f"tensor_parallel.autotp_size={autotp} but the model is already sharded over "
                              f"{sharded} ranks (the model axis it was built on); make them equal (or leave "
                              "the key out)")
        degrees = ParallelDegrees(model=sharded, sequence=sequence)
    else:
        degrees = ParallelDegrees(model=autotp, sequence=sequence)
    degrees.data(world)
    check_declared(degrees, built_on)
    return degrees


def _mesh_param_size(mesh_param: Any, source: Any, world: int) -> int:
    """The sequence-parallel degree of DeepSpeed's `mesh_param=(dp, sp)`.

    Raises:
        ConfigError: not two positive integers, dp * sp differing from the
            world size, or a config `sequence_parallel_size` other than sp.
    """
    if (not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh_param)):
        raise ConfigError(f"initialize(mesh_param={mesh_param!r}): give (data_parallel_size, "
                          "sequence_parallel_size), two integers >= 1, as DeepSpeed does")
    data, sequence = mesh_param
    if data * sequence != world:
        raise ConfigError(f"initialize(mesh_param=({data}, {sequence})): {data} x {sequence} = {data * sequence} "
                          f"ranks, but the job has {world}; the data and sequence degrees must multiply to "
                          "the world size")
    configured = sequence_parallel_size_of(source)
    if configured not in (1, sequence):
        raise ConfigError(f"initialize(mesh_param=({data}, {sequence})) asks for {sequence} sequence-parallel "
                          f"ranks but the config's sequence_parallel_size is {configured}; remove one of "
                          "them or make them equal")
    return sequence


def _sequence_size(model: torch.nn.Module, source: Any, world: int, mesh_param: Any = None) -> int:
    """The config's sequence_parallel_size (or mesh_param's, see
    _mesh_param_size), checked against the job.

    Raises:
        ConfigError: it does not divide the world size; a bad or
            conflicting mesh_param.
    """
    size = (sequence_parallel_size_of(source) if mesh_param is None
            else _mesh_param_size(mesh_param, source, world))
    if size == 1:
        return 1
    if world % size:
        raise ConfigError(f"sequence_parallel_size={size} does not divide the {world} ranks of the job; "
                          f"choose a divisor of {world} (data parallelism takes the rest)")
    return size


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` holds tensor-parallel layers: sharded by tp_model_init,
    or built from ColumnParallelLinear/RowParallelLinear/VocabParallelEmbedding
    (on the current mesh, whose model axis then splits it)."""
    return getattr(model, "ds_autotp_parsed", False) or any(
        getattr(p, "tensor_model_parallel", False) for p in model.parameters())


def build_mesh(model: torch.nn.Module, cfg: DsConfig, degrees: ParallelDegrees, built_on: ParallelMesh,
               device: torch.device) -> ParallelMesh:
    """The job's one mesh, with `degrees` (`built_on`, the mesh the model's
    layers were built on, when it has them; else built now and made
    current, collective), after which a model the config asks to shard
    (`tensor_parallel.autotp_size`) and that is not sharded yet is sharded
    over its model axis, as tp_model_init does (collective; broadcasts
    through `device`, the backend's).

    Raises:
        ConfigError: vocab_parallel asked for a model sharded without it.
    """
    if isinstance(model, PipelineModule):
        mesh = pipeline_mesh(model, degrees, built_on)
        if cfg.tensor_parallel.autotp_size > 1 and not _is_sharded(model):
            shard_stage(model, mesh, full=ZERO_INIT)
        return mesh
    mesh = declare_mesh(degrees, built_on)
    if not _is_sharded(model):
        tp = cfg.tensor_parallel.autotp_size
        if tp > 1:
            apply_autotp(model, plan_autotp(model, tp, cfg.tensor_parallel.vocab_parallel), mesh, device)
    elif cfg.tensor_parallel.vocab_parallel and not getattr(model, "ds_autotp_vocab_parallel", False):
        raise ConfigError("tensor_parallel.vocab_parallel=true but the model was sharded without it; call "
                          "dsrun.tp_model_init(..., vocab_parallel=True) or leave the key to initialize()")
    return mesh


def broadcast_module(module: torch.nn.Module, mesh: ParallelMesh, src: int = 0, group=None) -> None:
    """Give every rank of `group` (default: all) global rank `src`'s parameters
    and buffers (different seeds must not diverge). An expert parameter of an
    MoE layer comes instead from the first rank of its expert-data-parallel
    group on `mesh` (the ranks of an expert-parallel group hold different
    experts)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if is_expert_param(tensor):
                experts = expert_groups(expert_group_name_of(tensor), mesh)
                comm.broadcast(tensor.data, src=experts.expert_data_parallel.ranks[0],
                               group=experts.expert_data_group)
            else:
                comm.broadcast(tensor.data, src=src, group=group)
