"""Several optimizer steps per rollout batch, checked on real megatron-core ranks, in ONE torchrun
launch (2 gloo ranks; driven and asserted by tests/test_minibatches.py, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/dist/minibatch_checks.py --work-dir D --out R.json

A tiny random Qwen2 (fp32) and one GRPO batch of 4 groups x 2 sequences. Per layout (TP1 x DP2,
then TP2): three engines from the same weights --

* A, the product path: pi_prox = A's forward, GRPO advantages on the WHOLE batch, then
  ``train_on_minibatches(num_minibatches=2)`` (the trainer's own function);
* B, by hand: the same pi_prox and advantages, the batch cut by hand into groups {0, 1} and
  {2, 3} (token slices written out here, not by ``split_minibatches``), two ``train_batch``
  calls in order, each with a PPOActorLoss normalised by its own half's token count;
* C, the negative control: ONE step on the whole batch.

Reported: max |A - B| and max |A - C| over every parameter (all ranks), A's per-step PPO ratio
stats (step 1 must see ratio 1: pi_theta == pi_prox; step 2 must not: the clip can act), and
the version of A (train steps never bump it; the trainer does once per batch).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from areal_mega.algo.advantages import compute_advantages
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.algo.losses import PPOActorLoss, global_counts
from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.model import MegatronModelConfig
from areal_mega.batching.packing import pack_sequences, shift_to_next_token
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.trainer.trainer import train_on_minibatches
from tests.dist.engine_checks import start_launch
from tests.support.models import DEFAULTS, save_tiny_model

VOCAB = DEFAULTS["vocab_size"]
TEMPERATURE = 1.0
LR = 2e-3  # large enough that step 1 visibly moves the policy that step 2 sees (ratio != 1)
LENS = [11, 14, 9, 20, 13, 8, 17, 12]  # 4 groups of 2, group g = sequences 2g, 2g+1
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]  # every group mixed: every advantage nonzero
ALGO = AlgorithmConfig(adv_estimator="grpo", decoupled=True, eps_clip_low=0.2, eps_clip_high=0.2,
                       aggregation="token_mean", behav_imp_weight_cap=None, num_minibatches=2)


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    seqs = []
    for n in LENS:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        prompt = 4
        seqs.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt),
                     "logprobs": [0.0] * prompt + (-5.0 - torch.rand(n - prompt, generator=g)).tolist()})
    b = pack_sequences(seqs)
    cu = b["cu_seqlens"]
    b["loss_mask"] = shift_to_next_token(b["loss_mask"], cu)
    b["logprobs"] = shift_to_next_token(b["logprobs"], cu)
    b["rewards"] = torch.tensor(REWARDS)
    b["group_index"] = torch.tensor([i // 2 for i in range(len(LENS))])
    return b


def by_hand(batch: dict[str, torch.Tensor], seqs: range) -> dict[str, torch.Tensor]:
    """Sequences ``seqs`` (contiguous) of ``batch`` as a packed batch, written out independently."""
    cu = batch["cu_seqlens"].tolist()
    t0, t1 = cu[seqs.start], cu[seqs.stop]
    out = {k: v[t0:t1].clone() for k, v in batch.items() if k not in ("cu_seqlens", "rewards", "group_index")}
    out["cu_seqlens"] = torch.tensor([c - t0 for c in cu[seqs.start:seqs.stop + 1]])
    out["rewards"] = batch["rewards"][seqs.start:seqs.stop].clone()
    out["group_index"] = batch["group_index"][seqs.start:seqs.stop].clone()
    return out


def loss_for(mb: dict[str, torch.Tensor]) -> PPOActorLoss:
    tokens, seqs = global_counts(mb["loss_mask"], mb["cu_seqlens"])
    return PPOActorLoss(ALGO, total_tokens=tokens, total_seqs=seqs)


def engine_cfg() -> MegatronEngineConfig:
    # adam_eps 1e-5 as in engine_checks.py: keeps O(eps) gradient elements from turning fp32
    # reduction-order noise into O(lr) weight differences (A and B run the same ops anyway).
    return MegatronEngineConfig(model=MegatronModelConfig(dtype="float32"),
                                optimizer=OptimizerConfig(lr=LR, lr_warmup_steps=0, clip_grad=1.0, adam_eps=1e-5,
                                                          use_distributed_optimizer=False),
                                max_tokens_per_microbatch=32, compute_entropy=False)


def params(engine: MegatronTrainEngine) -> list[torch.Tensor]:
    return [p.detach().clone().float() for c in engine.chunks for _, p in sorted(c.named_parameters())]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    d = torch.tensor([max(float((x - y).abs().max()) for x, y in zip(a, b))])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def run_layout(tp: int, hf_dir: str) -> dict:
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1234)
    hf = load_hf_config(hf_dir)
    engines = [MegatronTrainEngine.create(engine_cfg(), hf, groups, hf_dir) for _ in range(3)]
    a, b, c = engines
    batch = make_batch()
    batch["prox_logprobs"] = a.forward_logprobs(batch, TEMPERATURE)  # once, before the first update
    batch.update(compute_advantages(batch, ALGO))  # once, on the whole batch
    init = params(a)

    _, steps_a = train_on_minibatches(a, batch, loss_for, TEMPERATURE, num_minibatches=2)
    first, second = by_hand(batch, range(0, 4)), by_hand(batch, range(4, 8))
    for half in (first, second):
        b.train_batch(half, loss_for(half), TEMPERATURE)
    c.train_batch(batch, loss_for(batch), TEMPERATURE)
    pa, pb, pc = params(a), params(b), params(c)
    res = {
        "a_vs_b": max_diff(pa, pb), "a_vs_c": max_diff(pa, pc), "a_moved": max_diff(pa, init),
        "steps": [{k: s[k] for k in ("ratio/mean", "ratio/max", "clip_frac", "n_tokens", "step")} for s in steps_a],
        "half_tokens": [float(first["loss_mask"].sum()), float(second["loss_mask"].sum())],
        "version_after": a.get_version(),
    }
    destroy_model_parallel(groups)
    return res


def main() -> None:
    args = start_launch()
    hf_dir = f"{args.work_dir}/tiny"
    if dist.get_rank() == 0:
        save_tiny_model(hf_dir, scale=1.5)
    dist.barrier()
    out = {f"tp{tp}": run_layout(tp, hf_dir) for tp in (1, 2)}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
