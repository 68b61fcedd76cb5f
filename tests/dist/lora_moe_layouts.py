"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/lora_moe_layouts.py --work-dir W --out R.pt

LoRA on the tiny Qwen3-MoE (tests/test_lora.py::test_lora_moe_*): the HF model in W/hf with PEFT's
adapters in W/ref.pt (attention + per-expert target_parameters), at TP1 (dp 2), EP2 and
TP2 + sequence parallelism x EP2 (expert-TP 1). Rank 0
records logits / base (adapters not applied) / adapter grads of sum(logits * R) in PEFT names
(expert grads / (ep etp / tp): at EP the expert gets the tokens of every rank of its expert-parallel
group, which here run ep etp / tp copies of the batch; megatron's DDP divides them by the data-parallel size) / merged export / peft_state_on_rank0.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.lora import LoraConfig, expert_adapter_params, apply_lora, gather_peft_state, load_peft_state, peft_state_on_rank0
from areal_mega.megatron.model import MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights, packed_causal_mask
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.parallel import ParallelConfig, ParallelLayout
from tests.support.dist import finish, last_stage_value, start_layouts_run

LAYOUTS = [("ep2", 1, 2), ("tp1", 1, 1), ("tp2ep2", 2, 2)]  # the engine checkpoint saved at EP2 is loaded at TP1 (dp 2)


def main() -> None:
    work, res_path, _, ref = start_layouts_run()
    hf_dir = f"{work}/hf"
    ids, cu, R = ref["input_ids"], ref["cu_seqlens"], ref["R"]
    lcfg = LoraConfig(**ref["lora"])
    res: dict = {"logits": {}, "base": {}, "grads": {}, "merged": {}, "peft": {}}
    for key, tp, ep in LAYOUTS:
        lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, expert_parallel=ep, expert_tensor_parallel=1), dist.get_world_size())
        groups = init_model_parallel(lay, backend="gloo")
        model = build_model(hf_dir, groups, MegatronModelConfig(layer_spec="local", sequence_parallel=tp > 1))
        load_hf_weights(model, hf_dir)
        apply_lora(model, lcfg)
        res["base"][key] = last_stage_value(forward_logits(model, ids, cu))
        load_peft_state(model, ref["adapters"])
        res["logits"][key] = last_stage_value(forward_logits(model, ids, cu))
        T = int(ids.numel())
        out = model.chunks[0](ids.view(1, T), torch.arange(T).view(1, T), packed_causal_mask(cu, T))
        Rp = torch.zeros(T, model.padded_vocab_size)
        Rp[:, : R.shape[1]] = R
        (out[0] * Rp.chunk(tp, dim=1)[groups.coords.tp]).sum().backward()
        if tp > 1:  # what finalize_model_grads does for sequence-parallel replicated params
            for p in model.chunks[0].parameters():
                if p.grad is not None and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=groups.tp)
        g = gather_peft_state(model, grads=True)
        res["grads"][key] = {k: (v / max(1, lay.ep * lay.etp // tp) if ".experts." in k else v) for k, v in g.items()} if dist.get_rank() == 0 else None
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {k: v for k, v in export_hf_weights(model) if v is not None})
        res["merged"][key] = {k: v for p in parts for k, v in p.items()} if dist.get_rank() == 0 else None
        res["peft"][key] = peft_state_on_rank0(model)
        with torch.no_grad():  # control: attention adapters applied, the expert adapters not (B = 0)
            for _, ab, _, _, prm in expert_adapter_params(model):
                if ab == "B":
                    prm.zero_()
        res.setdefault("no_experts", {})[key] = last_stage_value(forward_logits(model, ids, cu))
        if key == "tp2ep2":
            destroy_model_parallel()
            continue
        ecfg = MegatronEngineConfig(model=MegatronModelConfig(layer_spec="local"),
                                    optimizer=OptimizerConfig(use_distributed_optimizer=False), lora=lcfg)
        eng = MegatronTrainEngine.create(ecfg, hf_dir, groups, hf_weights_dir=hf_dir)
        if key == "ep2":  # the engine: base frozen, only the adapters (expert ones too) in DDP and the optimizer
            in_opt = sum(p.numel() for grp in eng.optimizer.param_groups for p in grp["params"])
            trainable = [p for c in eng.model.chunks for p in c.parameters() if p.requires_grad]
            experts = sum(p.numel() for p in trainable if not getattr(p, "allreduce", True))
            res["engine"] = (in_opt, sum(p.numel() for p in trainable), experts)
            load_peft_state(eng.model, ref["adapters"])
            eng.optimizer.zero_grad()
            eng.optimizer.step()  # zero gradients: Adam state exists, the adapters do not move
            eng.save(f"{work}/ckpt")
        else:
            eng.load(f"{work}/ckpt")
            back = gather_peft_state(eng.model)
            res["ckpt"] = {k: torch.equal(v, ref["adapters"][k]) for k, v in back.items()} if dist.get_rank() == 0 else None
        destroy_model_parallel()
    # the conversion tool's path: the EP2 LoRA checkpoint as a PEFT adapter directory (loaded at EP2)
    # and as merged HF weights (loaded at TP1)
    from areal_mega.megatron.hf_export import export_checkpoint

    export_checkpoint(f"{work}/ckpt", f"{work}/peft", ep=2, peft=True)
    export_checkpoint(f"{work}/ckpt", f"{work}/merged_hf")
    finish(res, res_path)


if __name__ == "__main__":
    main()
