"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/lora_layouts.py --work-dir W --out R.pt

One 2-rank gloo launch for tests/test_lora.py: the tiny HF model in W/hf with the PEFT adapters
in W/ref.pt (written by the pytest side, with HF + PEFT's logits and adapter gradients), at TP1
(dp 2), TP2, TP2 with sequence parallelism and PP2 (logits and merged weights; the PEFT names
carry global layer indices, so each stage loads its own layers' adapters). Rank 0 records into R.pt (torch.save):

* logits[layout]: packed-batch logits with the adapters loaded (last stage, TP-gathered);
* base[layout]: the same model before the adapters are loaded (B = 0: adapters not applied);
* grads[layout]: adapter gradients (PEFT names, full shapes) of sum(logits * R);
* merged[layout]: {HF name: W + scaling * B A} as the merged-weight sync sends it;
* W/merged_hf, W/peft: the TP2 engine checkpoint exported (merged HF dir; PEFT adapter dir).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.lora import LoraConfig, adapter_params, apply_lora, gather_peft_state, load_peft_state
from areal_mega.megatron.model import MegatronModelConfig, export_hf_weights, build_model, forward_logits, load_hf_weights, packed_causal_mask
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.parallel import ParallelConfig, ParallelLayout
from tests.support.dist import finish, last_stage_value, start_layouts_run

LAYOUTS = [("tp1", 1, 1, False), ("tp2", 2, 1, False), ("tp2sp", 2, 1, True), ("pp2", 1, 2, False)]


def main() -> None:
    work, res_path, _, ref = start_layouts_run()
    hf_dir = f"{work}/hf"
    ids, cu, R = ref["input_ids"], ref["cu_seqlens"], ref["R"]
    lcfg = LoraConfig(**ref["lora"])
    res: dict = {"logits": {}, "base": {}, "grads": {}, "merged": {}}
    for key, tp, pp, sp in LAYOUTS:
        lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), dist.get_world_size())
        groups = init_model_parallel(lay, backend="gloo")
        model = build_model(hf_dir, groups, MegatronModelConfig(layer_spec="local", sequence_parallel=sp))
        load_hf_weights(model, hf_dir)
        apply_lora(model, lcfg)
        assert all(not p.requires_grad for n, p in model.chunks[0].named_parameters() if ".lora." not in n)
        res["base"][key] = last_stage_value(forward_logits(model, ids, cu))
        load_peft_state(model, ref["adapters"])
        res["logits"][key] = last_stage_value(forward_logits(model, ids, cu))
        if pp > 1:  # each stage merges its own layers: rank 0 records the union (no gradients here)
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, dict(export_hf_weights(model)))
            res["merged"][key] = {k: v for part in parts for k, v in part.items()} if dist.get_rank() == 0 else None
            destroy_model_parallel()
            continue
        # adapter gradients of sum(logits * R): each TP rank holds its vocab slice of the logits
        T = int(ids.numel())
        out = model.chunks[0](ids.view(1, T), torch.arange(T).view(1, T), packed_causal_mask(cu, T))
        Rp = torch.zeros(T, model.padded_vocab_size)
        Rp[:, : R.shape[1]] = R
        (out[0] * Rp.chunk(tp, dim=1)[groups.coords.tp]).sum().backward()
        if sp:  # what finalize_model_grads does for sequence-parallel replicated params (the norms too)
            for p in model.chunks[0].parameters():
                if p.grad is not None and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=groups.tp)
        g = gather_peft_state(model, grads=True)
        res["grads"][key] = g if dist.get_rank() == 0 else None
        merged = dict(export_hf_weights(model))  # the LoRA-merged export every sync transport reads
        res["merged"][key] = merged if dist.get_rank() == 0 else None
        if key == "tp2":  # the engine: base frozen, only the adapters in DDP and the optimizer
            ecfg = MegatronEngineConfig(model=MegatronModelConfig(layer_spec="local", sequence_parallel=False),
                                        optimizer=OptimizerConfig(use_distributed_optimizer=False), lora=lcfg)
            eng = MegatronTrainEngine.create(ecfg, hf_dir, groups, hf_weights_dir=hf_dir)
            in_opt = sum(p.numel() for grp in eng.optimizer.param_groups for p in grp["params"])
            adapters = sum(p.numel() for _, _, p, _ in adapter_params(eng.model))
            trainable = sum(p.numel() for c in eng.model.chunks for p in c.parameters() if p.requires_grad)
            res["engine"] = (in_opt, adapters, trainable)
            load_peft_state(eng.model, ref["adapters"])
            eng.optimizer.zero_grad()
            eng.optimizer.step()  # zero gradients: Adam state exists, the adapters do not move
            eng.save(f"{work}/ckpt")  # TP2 -> loaded at TP2 + SP below
        if key == "tp2sp":
            ecfg = MegatronEngineConfig(model=MegatronModelConfig(layer_spec="local", sequence_parallel=True),
                                        optimizer=OptimizerConfig(use_distributed_optimizer=False), lora=lcfg)
            eng = MegatronTrainEngine.create(ecfg, hf_dir, groups, hf_weights_dir=hf_dir)
            eng.load(f"{work}/ckpt")
            back = gather_peft_state(eng.model)
            res["ckpt"] = {k: torch.equal(v, ref["adapters"][k]) for k, v in back.items()} if dist.get_rank() == 0 else None
        destroy_model_parallel()
    # the conversion tool's path: the TP2 LoRA checkpoint as merged HF weights (loaded at TP2) and
    # as a PEFT adapter directory (loaded at PP2: every stage's adapters reach rank 0)
    from areal_mega.megatron.hf_export import export_checkpoint

    export_checkpoint(f"{work}/ckpt", f"{work}/merged_hf", tp=2)
    export_checkpoint(f"{work}/ckpt", f"{work}/peft", pp=2, peft=True)
    finish(res, res_path)


if __name__ == "__main__":
    main()
