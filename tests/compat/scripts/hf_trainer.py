"""Hugging Face Trainer on dsrun through the `deepspeed` alias: a tiny GPT-2
built from a config (no download) trained a few steps under ZeRO-3 bf16
with an "auto" ds_config, then saved, then resumed from its checkpoint.

    dsrun --num_procs 2 hf_trainer.py --out DIR [--resume]

Prints one line "RESULT {json}" per rank.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments, set_seed

import deepspeed

DS_CONFIG = {  # HF's "auto" values, filled by the Trainer
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 1000,
}


class Patterns(torch.utils.data.Dataset):
    """Sequences counting up from a random start modulo the vocabulary: learnable."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (starts + torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                             learning_rate=3e-3, warmup_steps=2, max_steps=a.steps, bf16=True,
                             logging_steps=1, save_steps=a.steps // 2, save_strategy="steps", report_to=[],
                             deepspeed=DS_CONFIG, use_cpu=deepspeed.get_accelerator().device_name() == "cpu", seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    set_seed(0)  # the same initial weights in every run
    model = AutoModelForCausalLM.from_config(config)  # after TrainingArguments: HF's zero.Init path
    with deepspeed.zero.GatheredParameters([model.transformer.wte.weight]):
        wte_std = model.transformer.wte.weight.float().std().item()
    partitioned = model.transformer.wte.weight.numel() == 0  # zero.Init left an empty placeholder
    trainer = Trainer(model=model, args=args, train_dataset=Patterns(256, 32, 64))
    result = trainer.train(resume_from_checkpoint=True if a.resume else None)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    trainer.save_model(os.path.join(a.out, "final"))
    engine = trainer.model_wrapped
    print("RESULT " + json.dumps({
        "rank": int(os.environ.get("RANK", 0)), "losses": losses, "steps": trainer.state.global_step,
        "wte_std": wte_std, "partitioned_at_build": partitioned, "engine": type(engine).__name__,
        "stage": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled(),
        "train_batch_size": engine.train_batch_size(), "lr_after": engine.get_lr()[0],
        "training_loss": result.training_loss}), flush=True)


if __name__ == "__main__":
    main()
