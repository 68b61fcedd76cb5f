"""bf16 save -> load -> exact continuation, 2 gloo ranks (TP1 x PP1 x DP2), one torchrun launch
(driven and asserted by tests/test_engine.py::test_bf16_resume_is_exact, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/dist/engine_bf16_resume.py --work-dir D --out R.json

Regression check for megatron-core 0.16.1 optimizer-checkpoint bugs with our bf16 models, whose
RMSNorm weights stay fp32 (local layer spec, no Float16Module) -- see
areal_mega.megatron.compat.fix_param_group_index_map and fix_float16_optimizer_sharded_state_dict:

    qwen2_distopt   Qwen2 (qkv bias: fp32 norms + bf16 biases share a param group), distributed
                    optimizer -- save used to fail in get_parameter_state_dp_zero with
                    "The size of tensor a (128) must match the size of tensor b (64)".
    qwen2_plain     Qwen2, non-distributed optimizer -- save failed ("Optimizer shape ((64,)
                    does not match model shape ((128,))").
    llama_plain     Llama, non-distributed optimizer (a norms-only param group: no 16-bit params)
                    -- save failed ("Param id 10 does not match any model sharded param").

Per case: engine from the HF weights -> step 1 -> save -> step 2 -> forward -> step 3 (the
uninterrupted run); then a fresh engine with random weights loads the checkpoint and takes
steps 2 and 3. Step 2's loss checks the restored weights; the post-step-2 log-probs and step 3's
loss check the restored fp32 master weights, Adam moments and step count. Also recorded: step 1's
stats and post-step log-probs (what a resume from the pre-step weights would reproduce: the size
of the effect the step-2 comparison guards against) and the post-step-2 logit scale (for the
tolerances of the resharded resume).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.lora import LoraConfig
from areal_mega.megatron.model import MegatronModelConfig, forward_logits
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from engine_checks import TEMPERATURE, make_batch, make_loss_fn, start_launch  # sibling script
from tests.support.models import save_tiny_model
from tests.support.dist import finish

# (name, family, distributed optimizer, TP of the resumed engine: 2 = saved at TP1 x DP2, loaded
# at TP2 x DP1, so weights AND optimizer state are resharded)
CASES = (
    ("qwen2_distopt", "qwen2", True, 1),
    ("qwen2_plain", "qwen2", False, 1),
    ("llama_plain", "llama", False, 1),
    ("qwen2_distopt_to_tp2", "qwen2", True, 2),
    ("qwen2_distopt_lora", "qwen2", True, 1),  # LoRA r4: frozen base, adapters + their Adam state restored
)


def build(hf_dir: str, distributed_optimizer: bool, load_weights: bool, tp: int = 1,
          lora: LoraConfig | None = None) -> MegatronTrainEngine:
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=1), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1234)
    cfg = MegatronEngineConfig(
        model=MegatronModelConfig(dtype="bfloat16"),
        # lr 1e-3 so that bf16 weights visibly move every step; weight decay exercises both groups.
        optimizer=OptimizerConfig(
            lr=1e-3, lr_warmup_steps=1, weight_decay=0.01, adam_eps=1e-5, clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer,
        ),
        max_tokens_per_microbatch=64,
        lora=lora or LoraConfig(),
    )
    return MegatronTrainEngine.create(cfg, load_hf_config(hf_dir), groups, hf_dir if load_weights else None)


def main() -> None:
    args = start_launch()
    rank = dist.get_rank()
    batch = make_batch()
    loss_fn, _ = make_loss_fn(batch)
    res: dict = {}
    for name, arch, distopt, resume_tp in CASES:
        t0 = time.perf_counter()
        hf_dir = os.path.join(args.work_dir, f"tiny_{arch}")
        ckpt = os.path.join(args.work_dir, f"ckpt_{name}")
        if rank == 0 and not os.path.isdir(hf_dir):
            save_tiny_model(hf_dir, arch, num_hidden_layers=2, dtype="bfloat16")  # HF init, unscaled
        dist.barrier()
        lora = LoraConfig(rank=4, alpha=8) if name.endswith("_lora") else None
        engine = build(hf_dir, distopt, load_weights=True, lora=lora)
        assert engine.model.chunks[0].decoder.final_layernorm.weight.dtype == torch.float32  # mixed model
        before = engine.forward_logprobs(batch, temperature=TEMPERATURE)
        step1 = engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)
        after1 = engine.forward_logprobs(batch, temperature=TEMPERATURE)
        engine.set_version(3)
        engine.save(ckpt)
        ref = {"step2": engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)}
        ref["after2"] = engine.forward_logprobs(batch, temperature=TEMPERATURE).tolist()
        # max |logits| / T of the post-step-2 model: the scale of the log-probs' rounding error
        ref["logit_scale"] = float(forward_logits(engine.model, batch["input_ids"], batch["cu_seqlens"]).abs().max()) / TEMPERATURE
        ref["step3"] = engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)
        destroy_model_parallel()

        resumed = build(hf_dir, distopt, load_weights=False, tp=resume_tp, lora=lora)
        resumed.load(ckpt)
        got = {"version": resumed.get_version(), "step2": resumed.train_batch(batch, loss_fn, temperature=TEMPERATURE)}
        got["after2"] = resumed.forward_logprobs(batch, temperature=TEMPERATURE).tolist()
        got["step3"] = resumed.train_batch(batch, loss_fn, temperature=TEMPERATURE)
        destroy_model_parallel()
        res[name] = {
            "arch": arch, "distributed_optimizer": distopt, "resume_tp": resume_tp, "before": before.tolist(), "step1": step1,
            "after1": after1.tolist(),
            "ref": ref, "resumed": got, "seconds": time.perf_counter() - t0,
        }
    finish(res, args.out)


if __name__ == "__main__":
    main()
