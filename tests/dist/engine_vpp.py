"""Interleaved pipeline (PP2 x VPP2) training vs plain PP2, in ONE 2-rank gloo launch
(driven and asserted by tests/test_engine.py::test_vpp_*, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/dist/engine_vpp.py --work-dir D --out R.json

The tiny fp32 Qwen2 of engine_checks.py (4 layers: one per virtual stage at PP2 x VPP2) and its
packed batch (7 sequences of 3..70 tokens). Per case (token budget -> micro-batch count), the
same step -- forward, one train_batch (Adam, warm-up, distributed optimizer, clip), forward,
second train_batch -- runs first at PP2 (non-interleaved, the reference: same micro-batches)
and then at PP2 x VPP2:

    mb4: budget 64     -> 4 micro-batches (> pp: steady-state 1F1B steps with both p2p directions)
    mb5: budget 48     -> 5 micro-batches (odd: micro-batch group size 3 instead of pp=2)
    mb1: budget 10^4   -> 1 micro-batch (+ 1 filler under VPP: all steps are warm-up/cool-down)

Also: "tied_mb4" = the mb4 case for a tiny Llama with TIED embeddings (the embedding lives in
chunk 0 of stage 0 and the output layer in chunk 1 of stage 1: finalize_model_grads must
all-reduce their grads); "resume" = the mb4 VPP engine saved after step 1 and loaded into a
fresh plain-PP2 engine, whose second step must continue the VPP run (checkpoint keys of the
chunked model are layout independent).

Negative control ("mb4_batched_p2p"): the VPP engine with megatron's default batched p2p
(batch_p2p_comm=True), the setting that swaps activations and gradients between the two ranks
of a 2-stage pipeline; its numbers must differ from the reference (so the test would catch it).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronTrainEngine
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from engine_checks import (  # sibling script
    SCALE, TEMPERATURE, engine_cfg, make_batch, make_loss_fn, start_launch,
)
from tests.support.models import save_tiny_model
from tests.support.dist import finish

CASES = {"mb4": 64, "mb5": 48, "mb1": 10_000}  # case -> token budget per micro-batch


def build(hf_dir: str, budget: int, vpp: int | None, load_weights: bool = True) -> MegatronTrainEngine:
    pcfg = ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=vpp)
    layout = ParallelLayout.build(pcfg, dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1234)
    return MegatronTrainEngine.create(engine_cfg(budget), load_hf_config(hf_dir), groups, hf_dir if load_weights else None)


def run(engine: MegatronTrainEngine, batch, loss_fn, save_to: str | None = None) -> dict:
    before = engine.forward(batch, temperature=TEMPERATURE)
    s1 = engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)
    after = engine.forward_logprobs(batch, temperature=TEMPERATURE)
    if save_to is not None:
        engine.save(save_to)
    s2 = engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)
    after2 = engine.forward_logprobs(batch, temperature=TEMPERATURE)
    return {
        "logprobs": before["logprobs"].tolist(),
        "entropy": before["entropy"].tolist(),
        "stats": s1,
        "after": after.tolist(),
        "step2": s2,
        "after2": after2.tolist(),
        "num_chunks": len(engine.chunks),
    }


def main() -> None:
    args = start_launch()
    rank = dist.get_rank()
    torch.manual_seed(0)
    hf_dir = os.path.join(args.work_dir, "tiny_qwen2")
    tied_dir = os.path.join(args.work_dir, "tiny_llama_tied")
    ckpt = os.path.join(args.work_dir, "ckpt_vpp2")
    if rank == 0:
        save_tiny_model(hf_dir, scale=SCALE)
        save_tiny_model(tied_dir, "llama", scale=SCALE, tie_word_embeddings=True)
    dist.barrier()
    batch = make_batch()
    loss_fn, _ = make_loss_fn(batch)
    res: dict = {"cases": {}, "timing_s": {}}
    runs = [(c, hf_dir, b) for c, b in CASES.items()] + [("tied_mb4", tied_dir, CASES["mb4"])]
    for case, model_dir, budget in runs:
        for name, vpp in (("pp2", None), ("vpp2", 2)):
            t0 = time.perf_counter()
            save_to = ckpt if (case, name) == ("mb4", "vpp2") else None
            res["cases"].setdefault(case, {})[name] = run(build(model_dir, budget, vpp), batch, loss_fn, save_to)
            res["timing_s"][f"{case}/{name}"] = time.perf_counter() - t0
            destroy_model_parallel()
    # Resume the VPP run's checkpoint (saved after step 1) in a plain PP2 engine.
    t0 = time.perf_counter()
    resumed = build(hf_dir, CASES["mb4"], None, load_weights=False)
    resumed.load(ckpt)
    res["resume"] = {
        "logprobs": resumed.forward_logprobs(batch, temperature=TEMPERATURE).tolist(),
        "step2": resumed.train_batch(batch, loss_fn, temperature=TEMPERATURE),
        "after2": resumed.forward_logprobs(batch, temperature=TEMPERATURE).tolist(),
    }
    res["timing_s"]["resume"] = time.perf_counter() - t0
    destroy_model_parallel()
    # Negative control: megatron's default batched p2p under VPP with pp == 2.
    t0 = time.perf_counter()
    bad = build(hf_dir, CASES["mb4"], 2)
    bad.model.config.overlap_p2p_comm, bad.model.config.batch_p2p_comm = False, True
    res["cases"]["mb4_batched_p2p"] = {"vpp2": run(bad, batch, loss_fn)}
    res["timing_s"]["mb4_batched_p2p"] = time.perf_counter() - t0
    destroy_model_parallel()
    finish(res, args.out)


if __name__ == "__main__":
    main()
