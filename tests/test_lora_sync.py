"""``weight_sync.lora`` (docs/lora.md, "Weight sync"): the one choice between adapter-only and
merged LoRA sync, what it asks of the servers (launch arguments, the adapter every request names)
and its one-line refusals -- no process started. The end-to-end run (real trainer, torchrun
learner, real SGLang server) is ``test_lora_adapter_sync_in_the_trainer`` (slow, ``lora_e2e``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_mega.inference.config import SGLangServerConfig
from areal_mega.inference.server import ServedLora, build_launch_command
from areal_mega.inference.sglang_api import capabilities_from
from areal_mega.megatron.lora import LoraConfig
from areal_mega.weight_sync.config import ADAPTER, WeightSyncConfig
from tests.support.launch import SGLANG_PYTHON, child_env, needs_sglang, run_checked
from tests.support.numerics import fp32_tol, transformer_reductions

TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", *TARGETS, "--lora-backend",
             "torch_native", "--max-loras-per-batch", "1"]


def test_weight_sync_lora_choice_launch_args_and_refusals():
    lora = LoraConfig(rank=16, alpha=32, target_modules=TARGETS)
    served = ServedLora(ADAPTER, 16, tuple(TARGETS))
    # the choice: auto and adapter serve the adapter; merged, no LoRA, or auto on an fp8 base do not
    assert WeightSyncConfig().served_lora(lora) == served
    assert WeightSyncConfig(lora="adapter").served_lora(lora) == served
    assert WeightSyncConfig(lora="merged").served_lora(lora) is None
    assert WeightSyncConfig(lora="adapter").served_lora(LoraConfig(rank=0)) is None
    assert WeightSyncConfig().served_lora(None) is None
    assert WeightSyncConfig().served_lora(lora, "fp8") is None
    with pytest.raises(ValueError, match=r"^weight_sync\.lora: adapter cannot serve adapters on an fp8 base") as e:
        WeightSyncConfig(lora="adapter").served_lora(lora, "fp8")
    assert "\n" not in str(e.value)
    # requests held across the adapter swap (retract / in_place) would keep the old adapter
    assert WeightSyncConfig().served_lora(lora, "none", "retract") is None
    with pytest.raises(ValueError, match=r"^weight_sync\.lora: adapter needs inference\.client\.pause_mode: abort"):
        WeightSyncConfig(lora="adapter").served_lora(lora, "none", "in_place")
    # MoE expert adapters: merged (SGLang's MoE LoRA unverified); asking for adapter is refused
    moe = LoraConfig(rank=16, alpha=32, target_modules=["q_proj", "experts.gate_up_proj"])
    assert WeightSyncConfig().served_lora(moe) is None
    with pytest.raises(ValueError, match=r"^weight_sync\.lora: adapter does not serve MoE expert adapters"):
        WeightSyncConfig(lora="adapter").served_lora(moe)
    with pytest.raises(ValueError, match="lora: 'both' is not one of auto, merged, adapter"):
        WeightSyncConfig(lora="both").validate()

    # the server command carries the LoRA arguments when (and only when) the adapter is served
    cfg = SGLangServerConfig(model_path="m", device="cpu")
    with_lora = build_launch_command(cfg, 30000, lora=served)
    assert with_lora[-len(LORA_ARGS):] == LORA_ARGS
    assert build_launch_command(cfg, 30000) == with_lora[:-len(LORA_ARGS)]
    # extra_args come after: a GPU run may choose another --lora-backend (argparse keeps the last)
    cfg.extra_args = ["--lora-backend", "triton"]
    assert build_launch_command(cfg, 30000, lora=served)[-2:] == ["--lora-backend", "triton"]

    # what a server says it serves (/server_info): the adapter sync's start-up check reads it
    assert capabilities_from({"enable_lora": True, "max_lora_rank": 16}, None).max_lora_rank == 16
    assert capabilities_from({"enable_lora": False, "max_lora_rank": 16}, None).max_lora_rank == 0
    assert capabilities_from({}, None).max_lora_rank == 0


class _Server:
    url = "http://s:1"

    def __init__(self, max_lora_rank: int, routes=("/load_lora_adapter_from_tensors",)) -> None:
        self.cap = capabilities_from({"enable_lora": max_lora_rank > 0, "max_lora_rank": max_lora_rank,
                                      "tp_size": 2, "version": "0.5.23"}, {"paths": dict.fromkeys(routes)})

    def capabilities(self):
        return self.cap


def test_adapter_sync_refuses_servers_that_cannot_take_the_adapter():
    """Servers the run did not start (inference.addresses) are checked before the first load,
    i.e. before any rollout: one line naming weight_sync.lora."""
    from areal_mega.weight_sync.lora_sync import LoraAdapterSync

    sync = LoraAdapterSync(SimpleNamespace(lora=LoraConfig(rank=16, alpha=32)))
    assert sync.lora == ServedLora(ADAPTER, 16, tuple(LoraConfig().target_modules))
    assert sync._check(_Server(16)) == 2  # its TP size: one copy of the adapter per rank
    assert sync._check(_Server(64)) == 2
    for server, why in [(_Server(0), "started without --enable-lora"), (_Server(8), "max LoRA rank 8"),
                        (_Server(16, routes=()), "needs SGLang >= 0.5.23")]:
        with pytest.raises(ValueError, match=r"^weight_sync\.lora: adapter needs") as e:
            sync._check(server)
        assert why in str(e.value) and "set weight_sync.lora: merged" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.families_serve
@needs_sglang
def test_lora_adapter_sync_in_the_trainer(tmp_path):
    """The real trainer (local launcher, torchrun megatron learner, one real SGLang CPU server, fp32
    on both sides) with weight_sync.lora auto -> adapter: the server is launched with LoRA, the
    first adapter is loaded before the first rollout (SGLang refuses requests naming an unloaded
    adapter, so the run would fail otherwise), and after every sync the server's log-probs of the
    tokens it samples (behaviour) equal the learner's (proximal forward, same version) within the
    fp32 bound: routing/mismatch_max, over the on-policy tokens (max_staleness 0: all of them).
    Each sync moves the adapters only (weight_sync/bytes = their fp32 size). Control: the learner
    really moved off the base (a high LR on a reward that always has a signal): the base model's
    log-probs -- what a server serving without the adapter would give -- are far off the trained
    policy's (the run's merged HF export) on the task's prompts. Two learner ranks (DP2, the
    distributed optimizer: the adapters' Adam state sharded over DP): before
    apply_lora drew A from (init_seed, HF name) the DP replicas started from different adapters and
    diverged after the first update (mismatch 0.40 / 0.64 at steps 2-3 against this bound)."""
    import json
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_mega.demo.run import make_task

    make_task(tmp_path / "tiny", learner_python=sys.executable, env=child_env())
    base_dir, out, steps, rank = tmp_path / "tiny/model", tmp_path / "run", 3, 4
    run_checked([sys.executable, "-m", "areal_mega.launcher", "local", "--config", "configs/grpo_tiny.yaml",
                 f"model_path={base_dir}", f"output_dir={out}", f"launch.run_dir={tmp_path / 'launch'}",
                 f"data.path={tmp_path / 'tiny/data/train.jsonl'}", f"eval_data.path={tmp_path / 'tiny/data/test.jsonl'}",
                 f"inference.server.python={SGLANG_PYTHON}", f"trainer.num_steps={steps}", "trainer.resume=false",
                 "trainer.eval_at_start=false", "trainer.eval_at_end=false", "trainer.export_hf_at_end=true",
                 "parallel.tensor_parallel=1", "launch.learner.nproc_per_node=2", "rollout.batch_size=4", "workflow.group_size=4", "rollout.max_staleness=0",
                 "reward.options.function=tests.support.rewards:digit_fraction", "inference.client.pause_mode=abort", "actor.optimizer.lr=1.0e-2",
                 "actor.model.layer_spec=local", "actor.optimizer.use_distributed_optimizer=true", f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}"],
                timeout_s=1500)
    launch_log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "launch").rglob("*.log"))
    assert "weight sync: LoRA adapter-only (weight_sync.lora auto" in launch_log
    assert "--enable-lora --max-lora-rank 4 --lora-target-modules q_proj" in launch_log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, steps + 1))

    hf = json.loads((base_dir / "config.json").read_text())
    h, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    adapter_bytes = 4 * layers * rank * ((h + q) * 2 + (h + kv) * 2 + (h + f) * 3)  # fp32 A and B, 7 projections

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(out / "hf", torch_dtype=torch.float32)
    prompts = [json.loads(x)["prompt"] for x in (tmp_path / "tiny/data/test.jsonl").read_text().splitlines()[:16]]
    tok = AutoTokenizer.from_pretrained(base_dir)
    control, scale = 0.0, 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"]])
            logits = trained(ids).logits.float()
            lp_base = torch.log_softmax(base(ids).logits.float(), -1)
            control = max(control, float((lp_base - torch.log_softmax(logits, -1)).abs().max()))
            scale = max(scale, float(logits.abs().max()))
    # fp32 on both sides: 2 x fp32_tol over the longest reduction (the MLP's f), the transformer's
    # reductions plus two per adapter (x A, then B) on 7 projections per layer, at the logits' scale
    lp_tol = 2 * fp32_tol(f, scale, ops=transformer_reductions(layers) + 2 * 7 * layers)
    print(json.dumps({"mismatch_max": [r.get("routing/mismatch_max") for r in rows], "bound": lp_tol,
                      "bytes": [r["weight_sync/bytes"] for r in rows], "adapter_bytes": adapter_bytes,
                      "sync_s": [r["weight_sync/seconds"] for r in rows], "control": control}))
    for r in rows:
        assert r["routing/mismatch_tokens"] > 0 and r["routing/mismatch_max"] <= lp_tol, r
        assert r["weight_sync/bytes"] == adapter_bytes, r
    assert control > 100 * lp_tol, f"the trained policy is within {control} of the base"
