"""The trainer's real checkpoint format, written and resumed by the trainer's own functions, on 2
gloo ranks (driven and asserted by tests/test_checkpoint.py, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/dist/checkpoint_run.py --work-dir W --out R.json

* W/src: a tiny random Qwen2 (untied lm_head, qkv bias; fp32) plus a marker tokenizer_config.json;
* TP2: actor + critic engines from W/src (what Trainer.create builds); two optimizer steps, each
  followed by ``save_run_checkpoint`` -- the function ``Trainer.save`` calls -- into
  W/run/checkpoints (step000001, step000002, latest); then ``save_hf_checkpoint`` into W/run/hf,
  the call ``Trainer.close`` makes for the final HF export. A third step gives the reference
  continuation.
* crash leftovers, written by rank 0: step000003 = step000002's files without its metadata (a
  checkpoint that died before completing), and a stale staging dir .step000004.partial;
* PP2: fresh engines with random weights; ``resume_run_checkpoint`` -- the function
  ``Trainer.create`` calls -- must pick step000002 and skip step000003; the resumed engines'
  version, step count, log-probs, values and third step must equal the TP2 run's;
* refusals: the actor engine loading the critic checkpoint, and a weights-only checkpoint.

The pytest side converts W/run/checkpoints/latest with tools/convert_mcore_to_hf.py at TP1 and
compares it with W/run/hf. ``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from areal_mega.megatron.checkpoint import METADATA_FILE, CheckpointError, save_checkpoint
from areal_mega.trainer.run_state import resume_run_checkpoint, save_run_checkpoint
from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.hf_export import save_hf_checkpoint
from areal_mega.megatron.model import MegatronModelConfig
from areal_mega.batching.packing import pack_sequences, shift_to_next_token
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.trainer.critic import CriticConfig, CriticEngine
from tests.support.models import save_tiny_model
from tests.support.dist import finish

VOCAB = 200
MARKER = {"marker": "checkpoint_run"}


def make_tiny_qwen2(path: Path) -> None:
    """The 2-layer fp32 Qwen2 (tests/support/models.py), HF's init widened x1.5 so that the
    steps move log-probs, with a marker tokenizer_config.json (the exports must carry it)."""
    save_tiny_model(path, vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
                    scale=1.5)
    (path / "tokenizer_config.json").write_text(json.dumps(MARKER))


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    seqs = []
    for n in (11, 5, 23, 9):
        prompt = max(1, n // 3)
        seqs.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                     "loss_mask": [0] * prompt + [1] * (n - prompt)})
    batch = pack_sequences(seqs)
    batch["loss_mask"] = shift_to_next_token(batch["loss_mask"], batch["cu_seqlens"])
    return batch


def nll(batch):
    total = float(batch["loss_mask"].sum())

    def fn(lp, ent, mb):
        m = mb["loss_mask"].float()
        return -(lp * m).sum() / total, {"n_tokens": m.sum()}

    return fn


def value_loss(batch):
    total = float(batch["loss_mask"].sum())

    def fn(values, _zeros, mb):
        m = mb["loss_mask"].float()
        return ((values - 0.5) ** 2 * m).sum() / total, {"n_tokens": m.sum()}

    return fn


def engines(tp: int, pp: int, src: Path, load_weights: bool) -> tuple[MegatronTrainEngine, CriticEngine]:
    """What Trainer.create builds (actor from ``src``, critic with a seeded value head); with
    ``load_weights`` False every weight is random."""
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1234)
    ecfg = MegatronEngineConfig(model=MegatronModelConfig(dtype="float32"), max_tokens_per_microbatch=64,
                                optimizer=OptimizerConfig(lr=1e-3, lr_warmup_steps=2, adam_eps=1e-5))
    hf = str(src) if load_weights else None
    actor = MegatronTrainEngine.create(ecfg, str(src), groups, hf_weights_dir=hf)
    critic = CriticEngine.create(CriticConfig(model=MegatronModelConfig(dtype="float32")), str(src), groups,
                                 hf_weights_dir=hf, seed=7 if load_weights else 8)
    return actor, critic


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = Path(args.work_dir)
    src = work / "src"
    root = work / "run" / "checkpoints"
    if rank == 0:
        make_tiny_qwen2(src)
    dist.barrier()
    batch = make_batch()
    loss_fn, critic_loss = nll(batch), value_loss(batch)
    res: dict = {"timing_s": {}}

    t0 = time.perf_counter()
    actor, critic = engines(2, 1, src, load_weights=True)
    res["steps"] = []
    for step in (1, 2):
        res["steps"].append(actor.train_batch(batch, loss_fn))
        critic.train_batch(batch, critic_loss)  # as the trainer does (an untrained dist-opt cannot save)
        actor.set_version(step)
        critic.set_version(step)
        save_run_checkpoint(root, step, actor, critic, extra={"model_path": str(src)})  # Trainer.save
    save_hf_checkpoint(actor.model, str(work / "run" / "hf"), source_dir=str(src))  # Trainer.close
    res["tp2"] = {"logprobs": actor.forward_logprobs(batch).tolist(), "values": critic.compute_values(batch).tolist()}
    res["tp2"]["step3"] = actor.train_batch(batch, loss_fn)
    res["timing_s"]["tp2_train_save"] = time.perf_counter() - t0
    destroy_model_parallel()

    if rank == 0:  # what a crash leaves behind
        shutil.copytree(root / "step000002", root / "step000003")
        (root / "step000003" / METADATA_FILE).unlink()
        (root / ".step000004.partial").mkdir()
        (root / ".step000004.partial" / "junk").write_text("x")
    dist.barrier()

    t0 = time.perf_counter()
    actor, critic = engines(1, 2, src, load_weights=False)  # random weights: everything must come from the checkpoint
    res["random_logprobs"] = actor.forward_logprobs(batch).tolist()
    path = resume_run_checkpoint(root, actor, critic)  # Trainer.create
    res["pp2"] = {
        "resumed_from": path.name if path else None,
        "version": actor.get_version(), "num_steps": actor._num_steps, "critic_version": critic.get_version(),
        "logprobs": actor.forward_logprobs(batch).tolist(), "values": critic.compute_values(batch).tolist(),
        "step3": actor.train_batch(batch, loss_fn),
    }
    res["timing_s"]["pp2_resume"] = time.perf_counter() - t0

    refusals = {}
    save_checkpoint(actor.model, work / "weights_only", step=3, version=3, source_hf_dir=src)
    for name, call in (("critic_into_actor", lambda: actor.load(str(root / "step000002" / "critic"))),
                       ("actor_into_critic", lambda: critic.load(str(root / "step000002"))),
                       ("weights_only", lambda: actor.load(str(work / "weights_only"))),
                       ("incomplete", lambda: actor.load(str(root / "step000003")))):
        try:
            call()
            refusals[name] = None
        except CheckpointError as e:
            refusals[name] = str(e)
    res["refusals"] = refusals
    destroy_model_parallel()

    finish(res, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
