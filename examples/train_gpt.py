"""Train a small GPT on the bytes of real text with dsrun.

    dsrun --num_procs 2 examples/train_gpt.py --config examples/configs/gpt_demo.json

By default the text is the Python standard library's ``.py`` files; ``--data``
takes any text file or folder. Files are split into training and held-out
validation files (see byte_data.py). The script measures the validation loss
(nats per byte; a model that knows nothing scores ln 256 = 5.55) before and
after training and prints both and the drop.

The script uses only DeepSpeed's public API (initialize, forward, backward,
step): with DeepSpeed 0.16.5 standing in for dsrun (CPU, torchrun, pass
--deepspeed_config, since DeepSpeed has no --config) it runs unchanged and,
at ZeRO stage 2 in fp32 with a constant learning rate, prints the same
per-step losses to 4 decimals. It also runs under torchrun or as a single
process (world size 1).

With ``--pipeline_stages N`` the model is the same GPT split into N pipeline
stages (gpt_pipe.py; the world size must be a multiple of N, the rest is
data parallelism) and a step is ``engine.train_batch()`` over
gradient_accumulation_steps micro-batches, evaluation ``engine.eval_batch()``.
It starts from the same weights as the data-parallel run. For the same global
batch as gpt_demo.json on 2 ranks use configs/gpt_pipe.json, which fixes
train_batch_size.

With ``--tensor_parallel T`` the GPT's attention and MLP linear layers are
split over T ranks by DeepSpeed's AutoTP (``dsrun.tp_model_init``: q/k/v and
fc column-parallel, the two output projections row-parallel, embeddings and
output layer replicated); the world size must be a multiple of T, the rest
is data parallelism, and the T ranks of one model copy train on the same
windows. A data-parallel replica r draws the windows data-parallel rank r
draws, so tp=T on T ranks trains as one rank does. With ``--pipeline_stages
P`` as well, each stage's blocks are split the same way on a pipe x model x
data mesh (gpt_pipe.tensor_parallel_gpt_pipeline; P x T must divide the
world size). That combination uses dsrun's mesh and AutoTP placement
directly: DeepSpeed's AutoTP does not shard a PipelineModule.

A config that declares ``pipeline.stages`` with
``tensor_parallel.autotp_size`` or ``sequence_parallel_size``
(configs/gpt_4d.json: pipe 2 x tensor 2 x sequence 2) needs no flag: the
degrees are read from it, ``dsrun.init_distributed(config=...)`` builds the
mesh before the model, each stage's blocks are sharded by AutoTP's
placement and run Ulysses attention (gpt_sequence.sequence_parallel_pipeline);
its validation losses equal those of the same config without the tensor
and sequence keys on 2 ranks (pipe 2), the same global batch.

A config file may also hold this script's own settings, in a ``"train_gpt"``
section (SCRIPT_SECTION) that the script takes out before dsrun reads the
config: ``moe_experts``, ``moe_ep_size`` and ``moe_top_k``, the defaults of
the flags of those names (a flag given wins). ds_config has no MoE section
(DeepSpeed configures MoE in the model's code), so that is where
configs/gpt_3d_moe.json (pipe 2 x tensor 2 x data 2 on 8 ranks) asks for 4
experts at ep 2: it trains the MoE GPT as a pipeline
(gpt_moe.moe_gpt_pipeline: the auxiliary loss rides along with the hidden
states), AutoTP keeping the MoE layers' gates and experts whole. Its
validation losses equal, to 4 decimals over a short run (12 steps), those
of the same config without the tensor key on 4 ranks (``--pipeline_stages
2``: pipe 2 x data 2), the same global batch; after the default 400 steps
they differ by 4e-4 (fp32 summation order; docs/pipeline.md).

With ``--curriculum_seqlen MIN`` the config gets a sequence-length
curriculum (its ``curriculum_learning`` section, DeepSpeed's legacy one):
windows start MIN bytes long and grow linearly, in multiples of 8, to
--seq_len over the first --curriculum_steps steps (default: half of --steps);
the learning-rate schedule then counts tokens, not steps
(docs/curriculum.md). bench/curriculum/ compares it with a plain run.

With ``--moe_experts E`` the MLPs of alternate blocks (1, 3, ...) are
Mixture-of-Experts layers of E experts (gpt_moe.py), ``--moe_ep_size P``
spreads them over P expert-parallel ranks (P divides E and the world size;
the ranks stay data-parallel for everything else) and ``--moe_top_k k``
sends each token to k experts. The optimizer's groups go through
``split_params_into_different_moe_groups_for_optimizer`` as DeepSpeed asks.

With ``--sequence_parallel N`` every window's tokens are split over N ranks
with Ulysses (gpt_sequence.py: DistributedAttention in every block, the
loss the token mean over the N slices); the world size must be a multiple
of N, the rest is data parallelism (``initialize(mesh_param=(world // N,
N))``), and the N ranks of one replica draw the same windows, so sp=N on N
ranks trains as one rank does.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import dsrun
from dsrun.utils import groups
from byte_data import WindowSampler, eval_windows, load_corpus
from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer
from gpt_model import GPT, GPTConfig
from gpt_moe import MoEGPT, moe_gpt_pipeline
from gpt_pipe import gpt_pipeline, load_gpt_weights, param_groups, tensor_parallel_gpt_pipeline
from gpt_sequence import sequence_parallel_gpt, sequence_parallel_pipeline, shard_window

# The validation windows do not depend on --seed, so runs with different
# seeds are scored on the same text.
EVAL_SEED = 0
# The config file's section of this script's own settings (taken out before
# dsrun reads the config), and their defaults when neither it nor a flag
# sets them. ds_config has no MoE section: DeepSpeed configures MoE in the
# model's code, so configs/gpt_3d_moe.json asks for its experts here.
SCRIPT_SECTION = "train_gpt"
SCRIPT_DEFAULTS = {"moe_experts": 0, "moe_ep_size": 1, "moe_top_k": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's flags plus dsrun's --config/--deepspeed_config; exits with a usage error on bad values."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400,
                   help="optimizer steps (the config's LR schedule, total_num_steps, is fitted to them)")
    p.add_argument("--data", default=None,
                   help="text file or folder to train on (default: the Python standard library)")
    p.add_argument("--seed", type=int, default=1234, help="seed for the model's init and the training windows")
    p.add_argument("--eval_batches", type=int, default=8,
                   help="validation set size in micro-batches, shared out across ranks")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128, help="tokens (bytes) per training window")
    p.add_argument("--log_every", type=int, default=50, help="print a progress line every N steps")
    p.add_argument("--pipeline_stages", type=int, default=0,
                   help="split the model into N pipeline stages (0: data parallelism only)")
    p.add_argument("--tensor_parallel", type=int, default=1,
                   help="split the attention and MLP layers over N ranks with AutoTP (1: no tensor parallelism)")
    p.add_argument("--curriculum_seqlen", type=int, default=0,
                   help="start with windows of this many bytes and grow them to --seq_len (0: no curriculum)")
    p.add_argument("--curriculum_steps", type=int, default=0,
                   help="steps of the sequence-length curriculum (default: half of --steps)")
    p.add_argument("--moe_experts", type=int, default=None,
                   help="Mixture-of-Experts MLPs in alternate blocks with E experts (0: dense; default: the "
                        f"config's {SCRIPT_SECTION}.moe_experts, else 0)")
    p.add_argument("--moe_ep_size", type=int, default=None,
                   help="expert-parallel ranks the experts are spread over (default: the config's "
                        f"{SCRIPT_SECTION}.moe_ep_size, else 1)")
    p.add_argument("--moe_top_k", type=int, default=None,
                   help=f"experts per token (default: the config's {SCRIPT_SECTION}.moe_top_k, else 1)")
    p.add_argument("--sequence_parallel", type=int, default=1,
                   help="split every window's tokens over N ranks with Ulysses (1: no sequence parallelism)")
    # The `deepspeed` launcher appends --local_rank=N; accept it so the script
    # runs under either launcher. The rank itself comes from the environment.
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    dsrun.add_config_arguments(p)
    args = p.parse_args(argv)
    try:
        options = script_options(args)
    except ValueError as exc:
        p.error(str(exc))
    for name, default in SCRIPT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, options.get(name, default))
    for name in ("steps", "eval_batches", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.pipeline_stages < 0:
        p.error(f"--pipeline_stages must be >= 0 (0: no pipeline), got {args.pipeline_stages}")
    if args.tensor_parallel < 1:
        p.error(f"--tensor_parallel must be >= 1 (1: no tensor parallelism), got {args.tensor_parallel}")
    if args.curriculum_seqlen and not 8 <= args.curriculum_seqlen <= args.seq_len:
        p.error(f"--curriculum_seqlen must lie in [8, --seq_len={args.seq_len}], got {args.curriculum_seqlen}")
    if args.tensor_parallel > 1 and args.n_head % args.tensor_parallel:
        p.error(f"--tensor_parallel {args.tensor_parallel} must divide --n_head {args.n_head} "
                "(each rank computes n_head / tensor_parallel attention heads)")
    if args.moe_experts < 0:
        p.error(f"--moe_experts must be >= 0 (0: dense MLPs), got {args.moe_experts}")
    if args.moe_experts:
        if args.tensor_parallel > 1 or args.sequence_parallel > 1:
            p.error("--moe_experts runs with data (and expert) parallelism, a pipeline, or the config's "
                    "pipeline x tensor layout; drop --tensor_parallel and --sequence_parallel")
        if args.moe_ep_size < 1 or args.moe_experts % args.moe_ep_size:
            p.error(f"--moe_ep_size {args.moe_ep_size} must divide --moe_experts {args.moe_experts}")
        if not 1 <= args.moe_top_k <= args.moe_experts:
            p.error(f"--moe_top_k must be between 1 and --moe_experts {args.moe_experts}, got {args.moe_top_k}")
        if args.n_layer < 2:
            p.error("--moe_experts needs --n_layer >= 2 (blocks 1, 3, ... hold the MoE layers)")
    if args.sequence_parallel < 1:
        p.error(f"--sequence_parallel must be >= 1 (1: no sequence parallelism), got {args.sequence_parallel}")
    if args.sequence_parallel > 1 and (args.n_head % args.sequence_parallel or args.seq_len % args.sequence_parallel):
        p.error(f"--sequence_parallel {args.sequence_parallel} must divide --n_head {args.n_head} and --seq_len "
                f"{args.seq_len} (each rank holds seq_len / N tokens and attends with n_head / N heads)")
    if args.sequence_parallel > 1 and (args.pipeline_stages or args.tensor_parallel > 1):
        p.error("--sequence_parallel runs with data parallelism only (not with --pipeline_stages or "
                "--tensor_parallel)")
    if args.sequence_parallel > 1 and args.curriculum_seqlen:
        p.error("--curriculum_seqlen does not work with --sequence_parallel yet (each rank holds a fixed slice "
                "of every window); drop one of them")
    return args


def config_file(args: argparse.Namespace) -> dict:
    """The --config file (JSON, or YAML by its suffix) as read, {} without one."""
    if not args.deepspeed_config:
        return {}
    with open(args.deepspeed_config) as f:
        return yaml.safe_load(f) if args.deepspeed_config.endswith((".yaml", ".yml")) else json.load(f)


def config_degrees(args: argparse.Namespace) -> tuple[int, int, int]:
    """(pipeline.stages, tensor_parallel.autotp_size, sequence_parallel_size)
    of the --config file (1 for each key it lacks, or without one)."""
    config = config_file(args)
    stages = config.get("pipeline", {}).get("stages", 1)
    return (stages if isinstance(stages, int) else 1, config.get("tensor_parallel", {}).get("autotp_size", 1),
            config.get("sequence_parallel_size", 1))


def script_options(args: argparse.Namespace) -> dict[str, int]:
    """The --config file's SCRIPT_SECTION: this script's settings ({} without it).

    Raises:
        ValueError: the section is not an object, or holds a key other than
            SCRIPT_DEFAULTS' or a value that is not an integer.
    """
    section = config_file(args).get(SCRIPT_SECTION, {})
    where = f"{args.deepspeed_config}: {SCRIPT_SECTION!r}"
    if not isinstance(section, dict):
        raise ValueError(f"{where} must be an object of {sorted(SCRIPT_DEFAULTS)}, got {section!r}")
    unknown = sorted(set(section) - set(SCRIPT_DEFAULTS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; it takes {sorted(SCRIPT_DEFAULTS)}")
    wrong = {k: v for k, v in section.items() if isinstance(v, bool) or not isinstance(v, int)}
    if wrong:
        raise ValueError(f"{where}: {wrong} must be integers")
    return section


def declared_pipeline(args: argparse.Namespace, full: GPT, degrees: tuple[int, int, int]):
    """The GPT as a pipeline whose degrees the config declares (configs/gpt_4d.json:
    pipe x tensor x sequence): the mesh from `dsrun.init_distributed(config=...)`,
    this rank's stage loaded with `full`'s weights, its blocks' linear layers
    cut to this tensor rank's slices (AutoTP's placement: dsrun's shard_stage,
    also what initialize would do, done here so that the optimizer's groups
    hold the sliced weights), Ulysses attention over the sequence ranks
    (gpt_sequence.sequence_parallel_pipeline).

    Raises:
        SystemExit: a degree flag was given as well.
    """
    from dsrun.runtime.parallel.mesh import current
    from dsrun.runtime.parallel.tensor.autotp import shard_stage

    if args.pipeline_stages or args.tensor_parallel > 1 or args.sequence_parallel > 1:
        raise SystemExit("train_gpt.py: the config declares pipeline.stages with tensor_parallel or "
                         "sequence_parallel_size; drop --pipeline_stages, --tensor_parallel and "
                         "--sequence_parallel (the degrees come from the config)")
    stages, tensor, sequence = degrees
    model = (moe_gpt_pipeline(full.cfg, stages, args.moe_experts, args.moe_ep_size, args.moe_top_k)
             if args.moe_experts else gpt_pipeline(full.cfg, stages))
    load_gpt_weights(model, full)
    if tensor > 1:
        shard_stage(model, current())
    if sequence > 1:
        sequence_parallel_pipeline(model)
    return model


def run_config(args: argparse.Namespace) -> dict | None:
    """The config file of --config (JSON or YAML) fitted to this run, or
    None without --config: its SCRIPT_SECTION taken out, a scheduler's
    total_num_steps becomes --steps (its warmup_num_steps scaled alike), so
    the LR schedule and the launcher's progress line ("step 3/3") follow
    the run's length; with
    --curriculum_seqlen a seqlen curriculum is added: fixed_linear from
    curriculum_seqlen to seq_len in multiples of 8 over curriculum_steps,
    the LR schedule advanced by tokens (lr_schedule_in_tokens).

    Raises:
        SystemExit: --curriculum_seqlen without --config.
    """
    if not args.deepspeed_config:
        if args.curriculum_seqlen:
            raise SystemExit("train_gpt.py: --curriculum_seqlen needs --config (the curriculum is added to it)")
        return None
    config = config_file(args)
    config.pop(SCRIPT_SECTION, None)  # the script's own settings (parse_args read them), not dsrun's
    params = (config.get("scheduler") or {}).get("params", {})
    planned = params.get("total_num_steps")
    if planned:
        params["total_num_steps"] = args.steps
        if params.get("warmup_num_steps"):  # the same fraction of the run, at least one step
            params["warmup_num_steps"] = max(1, round(params["warmup_num_steps"] * args.steps / planned))
    if args.curriculum_seqlen:
        config["curriculum_learning"] = {
            "enabled": True, "curriculum_type": "seqlen", "min_difficulty": args.curriculum_seqlen,
            "max_difficulty": args.seq_len, "schedule_type": "fixed_linear", "lr_schedule_in_tokens": True,
            "schedule_config": {"total_curriculum_step": args.curriculum_steps or max(1, args.steps // 2),
                                "difficulty_step": 8}}
    return config


def set_threads() -> None:
    """Give each rank an equal share of this node's cores unless OMP_NUM_THREADS says otherwise.

    [Note: threads per rank]
    torch starts one intra-op thread per core in every process, so two ranks
    on two cores would run four threads and thrash. Measured for this demo
    (2 ranks, 2 cores): 1 thread per rank is the fastest setting.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return  # torch already read it at import
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))


@torch.no_grad()
def evaluate(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean loss (nats per byte) of the model on the fixed validation windows.

    Data-parallel rank d scores windows d, d + replicas, ... (the
    tensor-parallel ranks of one model copy score the same ones together);
    the loss sums and window counts are summed over all ranks, so every
    window counts tensor-parallel-size times in both and the result is the
    mean over all windows, the same on every rank. Every window has seq_len
    tokens, so the mean over windows equals the mean over tokens.

    Args:
        x, y: (count, seq_len) int64, the same on every rank.
    """
    data_rank, replicas = groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
    mine_x, mine_y = x[data_rank::replicas], y[data_rank::replicas]
    micro = engine.train_micro_batch_size_per_gpu()
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)  # [sum of window losses, windows]
    for i in range(0, mine_x.shape[0], micro):
        xb, yb = mine_x[i:i + micro].to(engine.device), mine_y[i:i + micro].to(engine.device)
        total += torch.tensor([engine(xb, yb).item() * xb.shape[0], xb.shape[0]], dtype=torch.float64)
    engine.train()
    if dist.is_initialized():
        total = total.to(engine.device)  # NCCL reduces device tensors only
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def evaluate_pipeline(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """`evaluate` for a PipelineEngine: data-parallel replica d scores windows
    d, d + replicas, ... with `engine.eval_batch`; the last stages' sums of
    window losses and window counts are summed over all ranks (other stages
    add zeros), so the result is the same mean on every rank.

    Args:
        x, y: (count, seq_len) int64, the same on every rank.
    """
    grid = engine.grid
    data_rank, replicas = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
    mine_x, mine_y = x[data_rank::replicas], y[data_rank::replicas]
    micro = engine.train_micro_batch_size_per_gpu()
    batches = [(mine_x[i:i + micro], mine_y[i:i + micro]) for i in range(0, mine_x.shape[0], micro)]
    total = torch.zeros(2, dtype=torch.float64)  # [sum of window losses, windows]
    if batches:
        losses = engine.eval_batch(iter(batches), reduce_output=None, bcast_loss=False,
                                   num_micro_batches=len(batches))
        if engine.is_last_stage():
            for loss, (xb, _) in zip(losses, batches):
                total += torch.tensor([loss.item() * xb.shape[0], xb.shape[0]], dtype=torch.float64)
    if dist.is_initialized():
        total = total.to(engine.device)  # NCCL reduces device tensors only
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def train_step(engine, sampler: WindowSampler, micro: int, accum: int) -> float:
    """One optimizer step: `accum` micro-batches of `micro` windows through forward, backward, step.

    Returns:
        The mean loss of this rank's micro-batches (nats per byte).
    """
    loss_sum = 0.0
    for _ in range(accum):
        x, y = sampler.sample(micro)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()  # updates the weights only at the accumulation boundary
        loss_sum += loss.item()
    return loss_sum / accum


def windows_forever(sampler: WindowSampler, micro: int):
    """Endless (x, y) micro-batches of `micro` windows each, (micro, seq_len) int64, for train_batch."""
    while True:
        yield sampler.sample(micro)


def make_progress(console: Console) -> Progress:
    """Rank 0's progress bar: steps done, last loss, global tokens/s, learning rate, elapsed time."""
    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
        TextColumn("lr {task.fields[lr]:.2e}"),
        TimeElapsedColumn(),
        console=console,
    )


def train(args: argparse.Namespace) -> None:
    """Build the model and engine, score the validation set, train, score it again, print both.

    Raises:
        SystemExit: --data names nothing usable (before any process group exists).
        ConfigError: the config is invalid (from dsrun.initialize).
    """
    set_threads()
    try:  # before initialize(): a bad --data stops every rank before any process group exists
        corpus = load_corpus(args.data, args.seq_len)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"train_gpt.py: {exc}") from None
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    degrees = config_degrees(args)
    declared = degrees[0] > 1 and max(degrees[1:]) > 1  # pipe x tensor/sequence from the config alone
    pipeline = args.pipeline_stages > 0 or declared
    config = run_config(args)
    if declared:  # the whole mesh, before the model (the MoE layers' expert groups live on its data axis)
        dsrun.init_distributed(config=config)
    if args.moe_experts:
        dsrun.init_distributed()  # the MoE layers make their expert groups as they are built
        model = MoEGPT(cfg, args.moe_experts, args.moe_ep_size, args.moe_top_k)
    else:
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # the tied head/embedding weight once
    if declared:
        model = declared_pipeline(args, model, degrees)
    elif pipeline:  # each rank keeps its stage's layers, starting from the GPT's weights
        dsrun.init_distributed()  # a PipelineModule reads its stage from the process group
        full = model
        if args.tensor_parallel > 1:  # and its slices of the stage's blocks
            model = tensor_parallel_gpt_pipeline(full, args.pipeline_stages, args.tensor_parallel)
        else:
            model = (moe_gpt_pipeline(cfg, args.pipeline_stages, args.moe_experts, args.moe_ep_size,
                                      args.moe_top_k) if args.moe_experts else gpt_pipeline(cfg, args.pipeline_stages))
            load_gpt_weights(model, full)
        del full
    elif args.tensor_parallel > 1:  # each rank keeps its slices of the attention and MLP layers
        dsrun.tp_model_init(model, args.tensor_parallel)
    elif args.sequence_parallel > 1:  # each rank keeps its slice of every window's tokens (gpt_sequence.py)
        model = sequence_parallel_gpt(model, args.sequence_parallel)
    if pipeline:
        parameters = param_groups(model)
        if args.moe_experts:
            parameters = split_params_into_different_moe_groups_for_optimizer(parameters)
    elif args.moe_experts:  # expert parameters in groups of their own, as DeepSpeed requires
        parameters = split_params_into_different_moe_groups_for_optimizer(model.param_groups())
    else:
        parameters = model.param_groups()
    if config is not None:  # the file's config fitted to the run, passed as a dict
        args.deepspeed_config = None
    mesh = ({"mesh_param": (dsrun.comm.get_world_size() // args.sequence_parallel, args.sequence_parallel)}
            if args.sequence_parallel > 1 else {})  # DeepSpeed's (data, sequence); older DeepSpeed lacks it
    engine, _, _, _ = dsrun.initialize(args=args, model=model, config=config, model_parameters=parameters, **mesh)
    rank, world = engine.global_rank, engine.world_size
    # Data-parallel replicas draw different windows; the stages of one replica the same ones.
    data_rank, replicas = ((engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size())
                           if pipeline else (groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()))
    console = Console(soft_wrap=True)  # log lines stay whole when output is piped
    log = console.print if rank == 0 else (lambda *a, **k: None)

    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    sampler = WindowSampler(corpus.train, args.seq_len, seed=args.seed * 100_003 + data_rank)
    train_iter = windows_forever(sampler, micro)
    if declared and degrees[2] > 1:  # each sequence rank keeps its slice of the windows
        engine.set_batch_fn(shard_window)
    score = evaluate_pipeline if pipeline else evaluate
    if args.moe_experts and (args.eval_batches * micro) % replicas:
        # an expert-parallel group exchanges blocks sized by each rank's tokens: equal shares only
        raise SystemExit(f"train_gpt.py: --eval_batches {args.eval_batches} x micro-batch {micro} windows do not "
                         f"split evenly over {replicas} data-parallel ranks, which MoE layers need; change "
                         "--eval_batches")
    val_x, val_y = eval_windows(corpus.val, args.eval_batches * micro, args.seq_len, EVAL_SEED)
    log(f"data: {corpus.describe()}")
    layout = " x ".join([f"MoE {args.moe_experts} experts top-{args.moe_top_k} over "
                         f"{args.moe_ep_size} expert-parallel ranks"] * bool(args.moe_experts) +
                        [f"{degrees[0] if declared else args.pipeline_stages} pipeline stages"] * pipeline +
                        [f"tensor parallel {args.tensor_parallel}"] * (args.tensor_parallel > 1) +
                        [f"(from the config) tensor parallel {degrees[1]}"
                         + f" x sequence parallel {degrees[2]}" * (degrees[2] > 1)] * declared +
                        [f"{replicas} data-parallel replicas"] * (pipeline or args.tensor_parallel > 1))
    log(f"model: {n_params / 1e6:.2f}M parameters; world size {world}{', ' + layout if layout else ''}, "
        f"torch threads per rank {torch.get_num_threads()}; "
        f"global batch {engine.train_batch_size()} windows of {args.seq_len} bytes "
        f"(micro-batch {micro} x accumulation {accum} x {replicas} {'replicas' if layout else 'ranks'})")

    val_before = score(engine, val_x, val_y)
    log(f"validation loss before training: {val_before:.4f}")

    curriculum = engine.curriculum_scheduler_legacy  # None without --curriculum_seqlen
    tokens = 0  # trained on so far, all ranks together
    progress = make_progress(console)
    task = progress.add_task("train", total=args.steps, loss=math.nan, tok_s=0.0, lr=engine.get_lr()[0])
    # Under dsrun's launcher the output is a pipe and the launcher draws rank 0's
    # live progress itself (from the engine's progress records): no bar here then.
    live = rank == 0 and console.is_terminal
    if live:
        progress.start()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        if pipeline:
            loss = engine.train_batch(train_iter).item()  # the mean over the step's micro-batches and replicas
        else:
            loss = train_step(engine, sampler, micro, accum)
        tokens += engine.train_batch_size() * (curriculum.get_current_difficulty() if curriculum else args.seq_len)
        tok_s = tokens / (time.perf_counter() - start)
        if rank == 0:
            progress.update(task, advance=1, loss=loss, tok_s=tok_s, lr=engine.get_lr()[0])
            if step % args.log_every == 0 or step == args.steps:
                progress.console.print(f"step {step}/{args.steps}  loss {loss:.4f}  "
                                       f"{tok_s:,.0f} tok/s  lr {engine.get_lr()[0]:.3e}")
    elapsed = time.perf_counter() - start
    if live:
        progress.stop()

    val_after = score(engine, val_x, val_y)
    log(f"trained {args.steps} steps ({tokens:,} tokens) in {elapsed:.1f} s: {tokens / elapsed:,.0f} tok/s "
        f"(all ranks), {elapsed / args.steps * 1000:.0f} ms/step")
    log(f"validation loss: before {val_before:.4f}  after {val_after:.4f}  "
        f"drop {val_before - val_after:.4f} (nats/byte)")


if __name__ == "__main__":
    train(parse_args())
