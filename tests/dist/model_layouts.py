"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 tests/dist/model_layouts.py --work-dir W --out R.pt

One 4-rank gloo launch that, for each tiny HF model in W (written by tests/test_megatron_model.py
together with HF reference logits in W/ref.pt), walks the layouts TP1, TP2, PP2, TP2xPP2, PP2xVPP2 (dp fills
the rest), re-initialising megatron's parallel state each time, and records on rank 0 into
R.pt (torch.save):

* logits[model][layout]: packed-batch logits from megatron (last stage, TP-gathered);
* export[model][layout]: per rank (pp, tp, dp, #tensors bit-identical to the HF file,
  #differing, names) from ModelAdapter.export_hf -- the weight-sync code path;
* negative[model]: logits at TP2 with gate/up swapped (qwen2) or q/k swapped (llama);
* ckpt[model]: logits after saving a dist checkpoint at TP2 and loading it at PP2;
* errors: messages from loading into models with a different hidden / ffn size;
* W/tool_ckpt, W/tool_hf: llama_tied converted HF -> megatron (TP2 x PP2) -> HF (PP2) by the
  conversion tools' main() functions, run inside this world (saves two torchrun launches).

The pytest side asserts the numbers. ``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from areal_mega.megatron.checkpoint import load_checkpoint, save_checkpoint
from areal_mega.megatron.model import (
    HFCheckpointReader,
    MegatronModelConfig,
    build_model,
    export_hf_weights,
    forward_logits,
    load_hf_weights,
)
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from tests.support.dist import gather, last_stage_value
from areal_mega.models import load_hf_config
from areal_mega.models.llama import LlamaAdapter
from areal_mega.models.qwen2 import Qwen2Adapter
from areal_mega.parallel import ParallelConfig, ParallelLayout

LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]  # (tp, pp, vpp)


class SwapGateUpQwen2(Qwen2Adapter):
    """Deliberately wrong mapping (negative control): fc1 built as [up; gate]."""

    def from_hf(self, prm, hf, shape=None):
        if prm.fusion == "gate_up":
            hf = [hf[1], hf[0]]
        return super().from_hf(prm, hf, shape)


class SwapQKLlama(LlamaAdapter):
    """Deliberately wrong mapping (negative control): q and k exchanged within each query group
    (k is tiled to q's heads-per-group, q's first head of the group becomes k)."""

    def from_hf(self, prm, hf, shape=None):
        if prm.fusion == "qkv":
            q, k, v = hf
            d, hpg = self.arch.head_dim, self.arch.heads_per_group
            ng = k.shape[0] // d  # query groups in this TP slice
            qg = q.reshape(ng, hpg * d, *q.shape[1:])
            kg = k.reshape(ng, d, *k.shape[1:])
            hf = [torch.cat([kg] * hpg, dim=1).reshape(q.shape), qg[:, :d].reshape(k.shape), v]
        return super().from_hf(prm, hf, shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work_dir)
    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    ref = torch.load(work / "ref.pt")
    res: dict = {"logits": {}, "export": {}, "negative": {}, "ckpt": {}, "errors": {}}
    for name, r in ref.items():
        hf_dir = work / name
        cfg = load_hf_config(hf_dir)
        ids, cu = r["input_ids"], r["cu_seqlens"]
        hf_file = HFCheckpointReader(hf_dir)
        res["logits"][name], res["export"][name] = {}, {}
        for tp, pp, vpp in LAYOUTS:
            lay = ParallelLayout.build(
                ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline_parallel=vpp), ws
            )
            key = f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")
            groups = init_model_parallel(lay, backend="gloo")
            model = build_model(hf_dir, groups, MegatronModelConfig(layer_spec="local"))
            load_hf_weights(model, hf_dir)
            res["logits"][name][key] = last_stage_value(forward_logits(model, ids, cu))
            same, diff, names = 0, 0, []
            if groups.coords.dp == 0:
                for n, t in export_hf_weights(model):
                    names.append(n)
                    same, diff = (same + 1, diff) if torch.equal(t, hf_file.read(n)) else (same, diff + 1)
            c = groups.coords
            res["export"][name][key] = gather((c.pp, c.tp, c.dp, same, diff, names))

            if key == "tp1pp1":
                wider = {**cfg, "hidden_size": cfg["hidden_size"] * 2, "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}
                wrong = build_model(wider, groups)
                before = [p.detach().clone() for p in wrong.chunks[0].parameters()]
                try:
                    load_hf_weights(wrong, hf_dir)
                    res["errors"][f"{name}/hf"] = None
                except ValueError as e:
                    res["errors"][f"{name}/hf"] = str(e)
                res["errors"][f"{name}/hf_untouched"] = all(
                    torch.equal(a, b) for a, b in zip(before, wrong.chunks[0].parameters())
                )
            if key == "tp2pp1":
                save_checkpoint(model, work / f"ckpt_{name}", step=3, version=3, source_hf_dir=hf_dir)
                bad = SwapGateUpQwen2 if cfg["model_type"] == "qwen2" else SwapQKLlama
                neg = build_model(hf_dir, groups, adapter=bad(cfg))
                load_hf_weights(neg, hf_dir)
                res["negative"][name] = (bad.__name__, last_stage_value(forward_logits(neg, ids, cu)))
            if key == "tp1pp2":
                fresh = build_model(hf_dir, groups)  # random init, then the TP2 checkpoint
                meta = load_checkpoint(fresh, work / f"ckpt_{name}")
                res["ckpt"][name] = (meta["step"], meta["saved_layout"], last_stage_value(forward_logits(fresh, ids, cu)))
                wrong = build_model({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}, groups)
                try:
                    load_checkpoint(wrong, work / f"ckpt_{name}")
                    res["errors"][f"{name}/ckpt"] = None
                except ValueError as e:
                    res["errors"][f"{name}/ckpt"] = str(e)
            destroy_model_parallel(groups)
    # HF -> megatron (TP2 x PP2) -> HF through the conversion tools' own main(), in this world.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import convert_hf_to_mcore
    import convert_mcore_to_hf

    src = work / "llama_tied"
    convert_hf_to_mcore.main(["--hf-dir", str(src), "--out", str(work / "tool_ckpt"), "--tp", "2", "--pp", "2"])
    convert_mcore_to_hf.main(["--ckpt", str(work / "tool_ckpt"), "--out", str(work / "tool_hf"), "--pp", "2"])
    if dist.get_rank() == 0:
        torch.save(res, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
