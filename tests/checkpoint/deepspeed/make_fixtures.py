"""Make the DeepSpeed checkpoint fixtures of tests/checkpoint/test_import_deepspeed.py
with the real DeepSpeed (CPU, 2 gloo ranks).

    DS_BUILD_OPS=0 .venv/bin/pip install --target /tmp/ds_pkgs --no-deps deepspeed==0.19.8 \\
        hjson py-cpuinfo msgpack tqdm einops nvidia-ml-py
    PYTHONPATH=/tmp/ds_pkgs DS_ACCELERATOR=cpu .venv/bin/python \\
        tests/checkpoint/deepspeed/make_fixtures.py tests/checkpoint/deepspeed/fixtures

For each case (ZeRO stage, precision) two ranks train TinyNet for STEPS_BEFORE
steps with torch.optim.AdamW, call engine.save_checkpoint(OUT/<case>), then
train STEPS_AFTER more steps. OUT/<case>/expected.json records, from
DeepSpeed itself: the fp32 weights its zero_to_fp32 assembles from the
checkpoint, the full Adam states (exp_avg, exp_avg_sq, step) at the save, and
the losses of the steps after it (what a resumed run must reproduce).
"""
import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyNet, batch  # noqa: E402

CASES = {"stage0_fp32": (0, "fp32"), "stage1_fp32": (1, "fp32"), "stage2_fp32": (2, "fp32"),
         "stage3_fp32": (3, "fp32"), "stage0_bf16": (0, "bf16"), "stage1_bf16": (1, "bf16"),
         "stage2_bf16": (2, "bf16"), "stage3_bf16": (3, "bf16")}
STEPS_BEFORE, STEPS_AFTER, WORLD = 3, 3, 2
LR = 0.05


def config(stage: int, precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
                                 "stage3_param_persistence_threshold": 0},
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 1:  # DeepSpeed's BF16_Optimizer: "bf16_zero_pp_rank_*" files
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _loss(engine, step, rank):
    idx, tgt = batch(step, rank)
    loss = engine(idx, tgt)
    engine.backward(loss)
    engine.step()
    t = loss.detach().float().clone()
    torch.distributed.all_reduce(t)
    return t.item() / WORLD


def _stage0_states(engine, opt):
    """{name: {"fp32", "exp_avg", "exp_avg_sq"}} without ZeRO: the torch
    optimizer's own states (fp32), or those of the fp32 copies kept by
    DeepSpeed's 16-bit optimizer wrapper (bf16), matched in parameter order."""
    names = {p: n for n, p in engine.module.named_parameters()}
    masters = getattr(engine.optimizer, "fp32_groups", None)
    pairs = (zip(names, names) if masters is None else
             ((p, q) for lows, highs in zip(engine.optimizer.fp16_groups, masters) for p, q in zip(lows, highs)))
    return {names[p]: {"fp32": q.detach(), **{k: opt.state[q][k] for k in ("exp_avg", "exp_avg_sq")}}
            for p, q in pairs}


def _case(deepspeed, rank, out, case):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage, precision = CASES[case]
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage, precision))
    for step in range(STEPS_BEFORE):
        _loss(engine, step, rank)
    save_dir = os.path.join(out, case)
    engine.save_checkpoint(save_dir)
    if stage == 0:
        states = _stage0_states(engine, opt)
    else:
        states = {}
        for name, p in engine.module.named_parameters():
            states[name] = {"fp32": safe_get_full_fp32_param(p),
                            **{key: safe_get_full_optimizer_state(p, key) for key in ("exp_avg", "exp_avg_sq")}}
    states = {name: {k: v.float().reshape(-1).tolist() for k, v in full.items()} for name, full in states.items()}
    after = [_loss(engine, STEPS_BEFORE + i, rank) for i in range(STEPS_AFTER)]
    torch.distributed.barrier()
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        try:
            fp32 = {k: v.float().reshape(-1).tolist()
                    for k, v in get_fp32_state_dict_from_zero_checkpoint(save_dir).items()}
        except (TypeError, ValueError):  # it reads ZeRO optimizer files only (not stage 0, not BF16_Optimizer)
            fp32 = None
        expected = {"stage": stage, "precision": precision, "world_size": WORLD, "lr": LR,
                    "steps_before": STEPS_BEFORE, "deepspeed_version": deepspeed.__version__,
                    "zero_to_fp32": fp32, "engine": states, "losses_after": after}
        with open(os.path.join(save_dir, "expected.json"), "w") as f:
            json.dump(expected, f)
    torch.distributed.barrier()


def _rank(rank, port, out, cases):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (the attribute deepspeed.comm.torch is torch itself)

    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (minutes) at
    # init; plain gloo collectives give the same checkpoints.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for case in cases:
        _case(deepspeed, rank, out, case)


def main(out: str, cases: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, out, cases)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"a DeepSpeed rank exited with {p.exitcode}")
    for case in cases:
        print(case, sorted(os.listdir(os.path.join(out, case))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(CASES))
