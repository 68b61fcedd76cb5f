"""Supervised fine-tuning on (prompt, answer) pairs with the same megatron engine RL uses.

    torchrun --nproc-per-node 2 -m areal_mega.cli sft --config configs/sft_tiny.yaml

Loss: mean negative log-likelihood of the answer tokens (and EOS), over all answer tokens of
the global batch. Prompts are tokenized exactly as the RL workflows do (``tokenizer.encode``
of the formatted prompt), so an SFT'd model continues RL prompts the way it was taught.
The result is written as an HF checkpoint (``<output_dir>/hf``) that SGLang and the RL trainer
load directly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from areal_mega.batching.packing import pack_sequences, shift_to_next_token
from areal_mega.config import load_config
from areal_mega.data import DatasetConfig, load_dataset
from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine
from areal_mega.megatron.hf_export import save_hf_checkpoint
from areal_mega.megatron.parallel_state import init_learner
from areal_mega.parallel import ParallelConfig


@dataclass
class SFTLoopConfig:
    num_steps: int = 100
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step (global, over all data-parallel ranks)."""
    log_every: int = 20
    """Print the loss every this many steps."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend of the ranks: "auto" = nccl with CUDA, else gloo (as the RL trainer's)."""

    def validate(self) -> None:
        if self.num_steps < 1 or self.batch_size < 1:
            raise ValueError("num_steps / batch_size: must be >= 1")


@dataclass
class SFTConfig:
    model_path: str = ""
    """HF model directory to start from."""
    output_dir: str = "runs/sft"
    """Where the HF checkpoint (``hf/``) and ``sft_log.jsonl`` go."""
    seed: int = 1
    """Seed of the model RNG and the data order."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Learner layout."""
    actor: MegatronEngineConfig = field(default_factory=MegatronEngineConfig)
    """Engine: model build, optimizer, micro-batching."""
    data: DatasetConfig = field(default_factory=DatasetConfig)
    """(prompt, answer) pairs; the answer field is the target completion."""
    trainer: SFTLoopConfig = field(default_factory=SFTLoopConfig)
    """Run length and batch size."""

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: must name an HF model directory")


def sft_sequence(tok: Any, prompt: str, answer: str) -> dict[str, list]:
    """One training sequence: prompt tokens (not trained) + answer tokens + EOS (trained)."""
    p = tok.encode(prompt, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    return {"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)}


def nll_loss(total_tokens: float):
    """loss_fn for TrainEngine.train_batch: summed NLL of masked next tokens / global count."""

    def fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: dict[str, Any]):
        mask = mb["loss_mask"].float()
        loss = -(logprobs * mask).sum() / total_tokens
        return loss, {"nll": -(logprobs.detach() * mask).sum() / mask.sum().clamp(min=1), "n_tokens": mask.sum()}

    return fn


def run_sft(config_path: str, overrides: list[str]) -> int:
    from transformers import AutoTokenizer

    cfg = load_config(SFTConfig, config_path, overrides)
    groups, _ = init_learner(cfg.parallel, backend=cfg.trainer.backend, seed=cfg.seed)
    engine = MegatronTrainEngine.create(cfg.actor, cfg.model_path, groups, hf_weights_dir=cfg.model_path)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    samples = list(load_dataset(cfg.data, tokenizer=tok).train)
    rng = random.Random(cfg.seed)  # same on every rank: every rank builds the same global batch
    out = Path(cfg.output_dir)
    if groups.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    log = open(out / "sft_log.jsonl", "a") if groups.rank == 0 else None
    for step in range(1, cfg.trainer.num_steps + 1):
        seqs = [sft_sequence(tok, s["prompt"], s["answer"]) for s in rng.sample(samples, min(cfg.trainer.batch_size, len(samples)))]
        batch = pack_sequences(seqs)
        batch["loss_mask"] = shift_to_next_token(batch["loss_mask"], batch["cu_seqlens"])
        stats = engine.train_batch(batch, nll_loss(float(batch["loss_mask"].sum())))
        if log is not None and (step % cfg.trainer.log_every == 0 or step == cfg.trainer.num_steps):
            row = {"step": step, "nll": stats.get("nll"), "grad_norm": stats["grad_norm"], "lr": stats["lr"]}
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    save_hf_checkpoint(engine.model, str(out / "hf"), source_dir=cfg.model_path)
    if log is not None:
        log.close()
        print(json.dumps({"sft_hf_checkpoint": str(out / "hf")}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0
