"""`initialize()` and `add_config_arguments()`: DeepSpeed's entry points.

`initialize` reads its arguments and the config in a fixed order --
process group, an mpu's groups, the parallel degrees (compose.py
`resolve_degrees`), config, the ranks' agreement -- then applies every
parallelism and builds the gradient strategy in one step (compose.py
`compose`), and adds the LR scheduler and the data loader for an Engine.
Each piece is built by its own module; this file only decides where each
comes from (an object, a factory, or the config).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from dsrun.runtime.memory import allocator, profile as memory_profile
from dsrun.runtime import comm
from dsrun.runtime.observability import heartbeat
from dsrun.runtime.observability import exit_report
from dsrun.runtime.distributed.agreement import check_ranks_agree
from dsrun.runtime.activation_checkpointing import checkpointing
from dsrun.runtime.config import ConfigError, DsConfig, load_config
from dsrun.runtime.data_pipeline.data_sampling import CurriculumDataLoader, build_curriculum_loader
from dsrun.runtime.engine.dataloader import DistributedDataLoader, RepeatingLoader
from dsrun.runtime.distributed.dist import Topology, init_distributed
from dsrun.runtime.engine.compose import compose, resolve_degrees
from dsrun.runtime.engine.engine import Engine
from dsrun.runtime.engine.state_dump import describe_engine
from dsrun.runtime.observability.logging import log_rank0, logger
# Through DeepSpeed's path, so that after initialize `deepspeed.runtime.lr_schedules`
# is an attribute of `deepspeed.runtime` (Accelerate reads it so, without importing it).
from dsrun.runtime.lr_schedules import build_lr_scheduler
from dsrun.runtime.optim.optimizers import build_optimizer
from dsrun.runtime.parallel.combinations import check_combinations, settings_of, split_experts
from dsrun.runtime.parallel.degrees import record_declaration
from dsrun.runtime.parallel.mesh import current
from dsrun.runtime.parallel.mpu import mesh_from_mpu
from dsrun.runtime.engine.pipeline_engine import PipelineEngine, check_pipeline_config
from dsrun.runtime.parallel.pipe.module import PipelineModule

ConfigSource = dict | str | Path | DsConfig


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's arguments to `parser` and return it.

    Adds a "DeepSpeed" argument group: `--deepspeed` (flag),
    `--deepspeed_config PATH` (alias `--deepscale_config`, DeepSpeed's old
    name; stored as `args.deepspeed_config`), `--deepscale` (old name of
    `--deepspeed`, accepted and ignored), and `--config` as a further alias
    when the script does not define `--config` itself.
    """
    taken = set(parser._option_string_actions)  # the parser's own options win over our aliases
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the dsrun/DeepSpeed runtime (accepted for compatibility)")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    names = [n for n in ("--deepspeed_config", "--config", "--deepscale_config") if n not in taken]
    group.add_argument(*names, dest="deepspeed_config", default=None, type=str,
                       help="ds_config file (.json, .yaml or .yml)")
    return parser


def _config_source(args: Any, config: ConfigSource | None,
                   config_params: ConfigSource | None) -> ConfigSource:
    """Exactly one config source, or a ConfigError saying which were given."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize(): both config= and config_params= were given; "
                          "pass the config once (config_params is an old alias of config)")
    given = config if config is not None else config_params
    # args.config counts only without args.deepspeed_config: a script may own a --config
    # option of its own (add_config_arguments then leaves it alone).
    from_args = {name: getattr(args, name, None) for name in ("deepspeed_config", "config")}
    from_args = {k: v for k, v in from_args.items() if v is not None}
    from_args = dict(list(from_args.items())[:1])
    if from_args and given is not None:
        name = next(iter(from_args))
        raise ConfigError(f"a config was passed to initialize() and also as args.{name}="
                          f"{from_args[name]!r}; remove one of them")
    if given is not None:
        return given
    if from_args:
        return next(iter(from_args.values()))
    raise ConfigError("no config: pass initialize(config=...) (dict or path) or "
                      "--deepspeed_config PATH (see add_config_arguments)")


def _check_model(model: torch.nn.Module) -> None:
    """Reject a model the engine cannot train, before any collective (a
    pipeline stage may hold no trainable parameter: another stage does)."""
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} parameters/buffers of the model are on the meta device (no data), first "
            f"'{meta[0]}'; materialize them before initialize() (model.to_empty(device='cpu') then "
            "initialize the weights), or build the model inside `with dsrun.zero.Init():`, which "
            "materializes meta parameters and initialises them with their module's reset_parameters()")
    if not isinstance(model, PipelineModule) and not any(p.requires_grad for p in model.parameters()):
        count = sum(1 for _ in model.parameters())
        raise ValueError(
            f"the model has no trainable parameters ({count} parameters, none with requires_grad=True): "
            "there is nothing to train; unfreeze some (p.requires_grad_(True)) or run the model "
            "without initialize() for inference")


def _notice_client_wins(section: str, config_type: str) -> None:
    """One line on rank 0: the object passed to initialize() is used, not the config's section."""
    if comm.get_rank() == 0:
        what = "optimizer" if section == "optimizer" else "lr_scheduler"
        logger.info(f"dsrun: initialize() got {what}= and the config's '{section}' section names "
                    f"{config_type}; using the one passed to initialize(), as DeepSpeed does")


def _build_optimizer(optimizer, params: list, cfg: DsConfig) -> torch.optim.Optimizer:
    if optimizer is not None and cfg.optimizer is not None:
        _notice_client_wins("optimizer", cfg.optimizer.type)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}, "
                            "not a torch.optim.Optimizer")
        return built
    if optimizer is not None:
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a callable taking the "
                        f"parameters, got {type(optimizer).__name__}")
    if cfg.optimizer is None:
        raise ConfigError("no optimizer: pass optimizer= to initialize() or add an "
                          "'optimizer' section to the config, e.g. "
                          '{"type": "AdamW", "params": {"lr": 1e-4}}')
    return build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), params)


def _build_scheduler(lr_scheduler, optimizer: torch.optim.Optimizer, cfg: DsConfig):
    if lr_scheduler is not None and cfg.scheduler is not None:
        _notice_client_wins("scheduler", cfg.scheduler.type)
    if lr_scheduler is None:
        if cfg.scheduler is None:
            return None
        return build_lr_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), optimizer)
    # As in DeepSpeed: a callable is a factory (scheduler objects are not callable).
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    return lr_scheduler


def _auto_resume(engine: Engine, cfg: DsConfig, topology: Topology) -> None:
    """Config `checkpoint.auto_resume`: load the newest complete checkpoint of
    `checkpoint.save_dir` into `engine` (collective: every rank), if there is one.

    The load is `engine.load_checkpoint(save_dir)` with no tag: the tag in
    `latest`, else the newest complete one; resharded to this world size,
    with the data loader's position and every RNG state when the layout is
    unchanged (so a restarted run continues bit for bit). Sets
    `engine.resumed_checkpoint` (tag directory or None) and
    `engine.resumed_client_state` (the saved client_state or None); rank 0
    says from which step it resumed, or that it starts fresh.

    Raises dsrun.runtime.checkpoint.CheckpointError as load_checkpoint does
    (a corrupted or foreign checkpoint is never skipped silently).
    """
    if not cfg.checkpoint.auto_resume:
        return
    save_dir = cfg.checkpoint.save_dir
    path, client_state = engine.load_checkpoint(save_dir)
    engine.resumed_checkpoint, engine.resumed_client_state = path, client_state
    if path is None:
        log_rank0(topology, f"auto_resume: no complete checkpoint in {save_dir} yet; starting fresh")
    else:
        log_rank0(topology, f"auto_resume: resumed from step {engine.global_steps} ({path}) "
                            f"on {topology.world_size} rank(s)")


@heartbeat.setting_up()  # a rank in initialize is not watched for hangs: [Note: heartbeats]
def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None,
               model_parameters: Iterable | None = None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: ConfigSource | None = None,
               mesh_param: tuple[int, int] | None = None, config_params: ConfigSource | None = None):
    """Build the training engine (DeepSpeed's `deepspeed.initialize`, same signature).

    Args:
        args: namespace whose `deepspeed_config` (or `config`) names the config.
        model: the torch.nn.Module to train; moved to this rank's device and
            given rank 0's weights.
        optimizer: a torch.optim.Optimizer, a callable taking the parameters
            and returning one, or None to build it from the config. When
            both are given, this one is used (a notice says so).
        model_parameters: parameters or parameter-group dicts for the
            optimizer (default: the model's parameters that require grad).
        training_data: a map-style Dataset; when given, a per-rank data
            loader of micro-batches is returned.
        lr_scheduler: a scheduler object, a callable taking the optimizer,
            or None to build it from the config (this one wins over the
            config's, with a notice).
        distributed_port: MASTER_PORT when the environment sets none.
        mpu: a Megatron-style model-parallel unit (get_model_parallel_group
            or get_tensor_model_parallel_group, get_data_parallel_group,
            optionally the pipeline and sequence ones): the job's mesh adopts
            its groups (ZeRO partitions over its data group, the gradient
            norm spans its model groups); see [Note: adopting an mpu] in
            runtime/parallel/mpu.py. The config and the model must agree
            with its degrees (e.g. tensor_parallel.autotp_size = its tensor
            size for a model to shard). None: the degrees come from the
            config and the model (see compose.resolve_degrees).
        dist_init_required: False asserts the process group already exists.
        collate_fn: batch collation for the data loader.
        config, config_params: dict, path (.json/.yaml/.yml) or DsConfig.
        mesh_param: DeepSpeed's (data_parallel_size, sequence_parallel_size):
            the same data x sequence mesh as the config's
            `sequence_parallel_size` (dp x sp must be the world size; a
            config value other than sp is a ConfigError).

    Returns:
        (engine, optimizer, dataloader or None, lr_scheduler or None).
        With config `checkpoint.auto_resume` the engine has already loaded
        the newest complete checkpoint of `checkpoint.save_dir`, if any
        (see `_auto_resume`; docs/restarts.md).

    Raises:
        ConfigError: no config, two configs,
            an invalid config, or configs that differ between ranks. An
            uncaught ConfigError prints one message without traceback and
            exits with code 78 (see dsrun.runtime.observability.exit_report).
        ValueError: model missing, parameters on the meta device, no
            trainable parameters; an mpu whose groups do not tile the world
            (runtime/parallel/mpu.py MpuError, naming the ranks).
        dsrun.runtime.distributed.agreement.RankMismatchError: ranks built different
            models (the first differing parameter is named).
    """
    if model is None:
        raise ValueError("initialize() needs model= (the torch.nn.Module to train)")
    if dist_init_required is False and not comm.is_initialized():
        raise RuntimeError("dist_init_required=False but torch.distributed is not initialised; "
                           "call dsrun.init_distributed() first or drop the argument")
    exit_report.install()
    source = _config_source(args, config, config_params)
    _check_model(model)
    started = memory_profile.MemorySnapshot.take()  # reads /proc only; used if the config asks
    topology: Topology = init_distributed(distributed_port=distributed_port)
    exit_report.install()  # again after torch's own hook (init_process_group's): ours runs first
    if mpu is not None:  # its groups become the mesh's: [Note: adopting an mpu]
        record_declaration(mesh_from_mpu(mpu), "initialize(mpu=...)")
    # The one read of the process-global mesh: the one the script built its layers on, kept
    # by compose when it has the job's degrees ([Note: the declared mesh] in parallel/mesh.py).
    built_on = current()
    pipeline = isinstance(model, PipelineModule)
    cfg, error = None, None
    try:
        # The batch triple counts the data-parallel ranks, not every rank.
        degrees = resolve_degrees(model, source, topology.world_size, built_on, mesh_param)
        cfg = load_config(source, world_size=degrees.data(topology.world_size))
        if cfg.sequence_parallel_size != degrees.sequence:  # from mesh_param
            cfg = cfg.model_copy(update={"sequence_parallel_size": degrees.sequence})
        # Every pair of settings the job turns on combines or is refused here, before any collective.
        check_combinations(settings_of(cfg, model, degrees.pipe, degrees.model, degrees.sequence, optimizer),
                           split_experts(model, degrees.model))
        if pipeline:
            check_pipeline_config(cfg, model)
    except ConfigError as exc:
        error = exc
    # The first collective of training; raises on every rank when they disagree.
    check_ranks_agree(model, cfg, error, topology.rank, topology.device,
                      description=model.describe() if pipeline else None)
    if "activation_checkpointing" in cfg.model_fields_set and not checkpointing.is_configured():
        checkpointing.configure(None, deepspeed_config=cfg)  # DeepSpeed scripts may call configure() themselves
    comm.comms_logger.configure(cfg.comms_logger.enabled, cfg.comms_logger.verbose,
                                cfg.comms_logger.prof_all, cfg.comms_logger.prof_ops)

    with (memory_profile.phase("initialize", since=started) if cfg.memory_breakdown
          else contextlib.nullcontext()):
        # Every parallelism, in one order: [Note: the order of composition] in compose.py.
        parts = compose(model, cfg, degrees, topology, built_on,
                        lambda params: _build_optimizer(optimizer, params, cfg), model_parameters)
        mesh, strategy = parts.mesh, parts.strategy
        allocator.trim()  # the model's original storage was just released
        scheduler = _build_scheduler(lr_scheduler, strategy.optimizer, cfg)
        loader = None
        if training_data is not None:
            # Shard the data over the data axis: the stages, model ranks and sequence ranks of one
            # replica read the same samples (each sequence rank keeps its tokens: shard_sequence).
            shard = dataclasses.replace(topology, rank=mesh.rank("data"), world_size=mesh.size("data"))
            if cfg.data_efficiency.curriculum_sampling:  # metrics from the config's metric_fn
                loader = build_curriculum_loader(training_data, cfg, shard.rank, shard.world_size, collate_fn)
            else:
                loader = DistributedDataLoader(training_data, cfg.train_micro_batch_size_per_gpu,
                                               shard, collate_fn=collate_fn)
        if pipeline:
            engine = PipelineEngine(model, strategy, scheduler, cfg, topology, mesh, parts.tied)
            if loader is not None:
                engine.set_dataiterator(iter(RepeatingLoader(loader)))
        else:
            engine = Engine(model, strategy, scheduler, cfg, topology, mesh)
        for hook in parts.pre_step_hooks:
            engine.register_pre_step_hook(hook)
        engine.training_dataloader = loader  # its position is checkpointed
        if isinstance(loader, CurriculumDataLoader):
            engine.register_checkpoint_state("data_sampling", loader.sampler)
    _auto_resume(engine, cfg, topology)
    if engine.dump_state() and topology.is_rank_zero:
        print(describe_engine(engine), flush=True)
    return engine, engine.optimizer, loader, engine.lr_scheduler
