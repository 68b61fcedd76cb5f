"""The compat registry: workarounds for megatron-core problems the learner engine hits on EVERY
device (the CPU-only CUDA shims are :mod:`areal_mega.megatron.cpu_compat`, same rules).

Each workaround is one :class:`Entry` in :data:`ENTRIES`: the symptom, the megatron-core versions
it applies to (a PEP 440 specifier; applied only there, never tried and caught) and the test that
shows it. Ranges, how each was found, the upgrade procedure:
docs/environments.md#megatron-core-compat-registry.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from areal_mega.batching.packing import PAD_TOKEN_ID

# The megatron-core versions the registry was verified on (the two tiers; docs/environments.md).
VERIFIED_VERSIONS = ("0.16.1", "0.19.2")


@functools.cache
def megatron_core_version() -> Version:
    """The installed megatron-core's version (``package_info``: also set in a source checkout)."""
    from megatron.core import package_info

    return Version(package_info.__version__)


@dataclass(frozen=True)
class Entry:
    """One workaround of a megatron-core problem."""

    symptom: str
    """What breaks without it (the error or the wrong number seen)."""
    versions: str
    """PEP 440 specifier of the megatron-core versions it applies to (pre-releases included)."""
    test: str
    """The pytest node id that shows it (fails without the workaround where it applies)."""

    def applies(self, version: Version | None = None) -> bool:
        v = megatron_core_version() if version is None else version
        return SpecifierSet(self.versions).contains(v, prereleases=True)


ENTRIES: dict[int, Entry] = {
    1: Entry(
        "distributed optimizer + torch Adam (no TE/apex), fresh optimizer: DistributedOptimizer."
        "state_dict() asserts all Adam states share one 'step' -- fails with no state yet, i.e. "
        "loading a checkpoint into a new engine (materialise_optimizer_state, in engine.load)",
        ">=0.16.1",
        "tests/test_engine.py::test_save_tp2_load_pp2_continues",
    ),
    2: Entry(
        "distributed optimizer + torch Adam, load: load_parameter_state_from_fully_reshardable "
        "copies every key of each Adam state, its source has no 'step' -> KeyError 'step' "
        "(skip_adam_step_on_param_state_load hides it during the copy; engine.load)",
        ">=0.16.1",
        "tests/test_engine.py::test_save_tp2_load_pp2_continues",
    ),
    3: Entry(
        "distributed optimizer + torch Adam, after load: ONE 'step' tensor object in every param's "
        "state; torch Adam increments it in place per param (advances by #params per step, breaks "
        "bias correction: the 2nd step after a resume diverged by 0.27 nats). Each state gets its "
        "own copy (on exit of skip_adam_step_on_param_state_load)",
        ">=0.16.1",
        "tests/test_engine.py::test_bf16_resume_is_exact",
    ),
    4: Entry(
        "distributed optimizer, a param group mixing fp32 and bf16 params (fp32 norms, Qwen2's bf16 "
        "qkv bias): model_param_group_index_map goes stale, checkpointing reads another param's "
        "state -- 'The size of tensor a (128) must match the size of tensor b (64)', or silently "
        "swapped state where sizes agree (NVIDIA/Megatron-LM#2777; fix_param_group_index_map)",
        ">=0.16.1",
        "tests/test_engine.py::test_bf16_resume_is_exact",
    ),
    5: Entry(
        "NON-distributed bf16 optimizer (Float16OptimizerWithFloat16Params) with fp32 params: "
        "sharded_state_dict numbers state ids over 16-bit params only -- 'Param id 10 does not "
        "match any model sharded param' (Llama), 'Optimizer shape ((64,) does not match model "
        "shape ((128,))' (Qwen2), load 'Cannot merge two lists with different lengths (0 and 10)' "
        "(fix_float16_optimizer_sharded_state_dict)",
        ">=0.16.1",
        "tests/test_engine.py::test_bf16_resume_is_exact",
    ),
    6: Entry(
        "interleaved pipeline (VPP) at PP = 2 with the default batch_p2p_comm=True: send-next and "
        "send-prev to the same peer cross, activations land in gradient buffers -- silently, grad "
        "norm 54.3 instead of 0.974 (configure_interleaved_p2p: unbatched, overlapped p2p)",
        ">=0.16.1",
        "tests/test_engine.py::test_vpp_negative_control_batched_p2p_is_wrong",
    ),
    7: Entry(
        "VPP with variable_seq_lengths: the shape exchange is always batched in the crossing order "
        "-- 'size of tensor a (70) must match ... b (49)', gloo 'Received data size doesn't match "
        "expected size', once a hang (fixed shapes: pad_microbatch + trimmed_loss under VPP)",
        ">=0.16.1",
        "tests/test_engine.py::test_vpp_training_matches_plain_pp",
    ),
    8: Entry(
        "the interleaved schedule raises unless pp <= N <= M and M % N == 0 or >= pp for "
        "microbatch_group_size_per_vp_stage = N ('The remainder of M ... should be 0, or larger "
        "than or equal to the pipeline-parallel size'); its default N = pp fails for M = 5 at PP2 "
        "(microbatch_group_size: the smallest valid N)",
        ">=0.16.1",
        "tests/test_engine.py::test_vpp_training_matches_plain_pp",
    ),
    9: Entry(
        "sequence parallelism with the local spec: WrappedTorchNorm asserts 'sequence parallel not "
        "supported by torch LayerNorm' (SequenceParallelRMSNorm swapped into the local layer spec, "
        "the final norm and gated DeltaNet's out_norm; marked sequence_parallel so "
        "finalize_model_grads sums its grads over TP)",
        ">=0.16.1",
        "tests/test_engine_sp.py::test_sp_forward_and_step_equal_sp_off_and_hf",
    ),
    10: Entry(
        "MoE router without transformer-engine: moe_utils.te_general_gemm is defined only inside "
        "the 'import transformer_engine' try-block -> NameError on every MoE forward "
        "(define_missing_te_gemm sets it to None)",
        ">=0.16.1,<0.17",
        "tests/test_megatron_moe.py::test_logprobs_match_hf_every_layout",
    ),
    11: Entry(
        "multi-latent attention without transformer-engine: multi_latent_attention.HAVE_TE is True "
        "whenever megatron.core.extensions.transformer_engine imports (it does without TE), so "
        "MLASelfAttention raises 'isinstance() arg 2 must be a type' on the local spec "
        "(fix_mla_have_te sets HAVE_TE = False when transformer_engine does not import)",
        ">=0.16.1",
        "tests/test_megatron_families.py::test_logprobs_match_hf_every_family_and_layout",
    ),
    12: Entry(
        "multi-latent attention at TP > 1 without sequence parallelism: finalize_model_grads sums "
        "every *q_layernorm* grad over TP, but MLA's q-latent norm gradient is already complete on "
        "each rank -> summed tp times (build_model refuses MLA at TP > 1 with sequence_parallel "
        "false; under SP the grads are partial and the sum is right)",
        ">=0.16.1",
        "tests/test_moe_families_plan.py::test_refusals_name_the_key",
    ),
    13: Entry(
        "gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) without flash-linear-attention "
        "(triton, GPU only): GatedDeltaNet.__init__ raises 'FLA is not installed' and its forward "
        "calls fla's l2norm / chunk_gated_delta_rule (enable_torch_gated_delta_net puts in the "
        "file's own torch_chunk_gated_delta_rule and a torch l2norm equal to fla's)",
        ">=0.16.1",
        "tests/test_qwen3_5.py::test_whole_text_model_logprobs_match_hf_packed",
    ),
    14: Entry(
        "gated DeltaNet at TP > 1 without SP: out_norm (one weight shared by all value heads, replicated) gets "
        "only its rank's heads' gradient, and finalize_model_grads sums it over TP only under "
        "sequence parallelism -> a wrong gradient and TP copies that drift apart after a step "
        "(PackedGatedDeltaNet applies the weight through copy_to_tensor_model_parallel_region)",
        ">=0.16.1",
        "tests/test_qwen3_5.py::test_tp2_out_norm_gradient_matches_hf",
    ),
    15: Entry(
        "YaRN on standard (non-MLA) attention, gpt-oss: GPTModel(position_embedding_type='yarn') and "
        "SelfAttention's mscale read yarn_* fields that only MLATransformerConfig declares -> "
        "AttributeError building the model (set them on the TransformerConfig instance)",
        ">=0.16.1",
        "tests/test_gpt_oss.py::test_tiny_model_logprobs_match_hf_packed",
    ),
    16: Entry(
        "biased experts (gpt-oss) without expert parallelism, with autograd: MLP.forward adds the "
        "weighted fc2 bias IN PLACE (mlp.py ~247) to the RowParallelLinear output, which "
        "_ReduceFromModelParallelRegion returns as a view of its input on a one-rank group -> "
        "RuntimeError 'Output 0 of _ReduceFromModelParallelRegion is a view and is being modified "
        "inplace' in every training forward (the expert's fc2 output is cloned when it is such a view)",
        ">=0.16.1",
        "tests/test_gpt_oss.py::test_gradients_of_sinks_and_biases_match_hf",
    ),
    17: Entry(
        "DeepSeek sparse attention (DSAIndexer.forward_with_scores): rotate_activation asserts 'only "
        "support bf16 input' and that fast_hadamard_transform (CUDA) is installed -> AssertionError in "
        "fp32, on CPU, or without the package. The Hadamard rotation is orthogonal and applied to both "
        "q and k, so every index score q . k is unchanged; HF's DeepseekV32Indexer skips it too "
        "(identity_rotate_activation)",
        ">=0.16.1",
        "tests/test_dsa.py::test_v32_tp1_logprobs_match_hf_sparse_and_controls",
    ),
}


def check_megatron_core_version() -> None:
    """Refuse a megatron-core older than the registry covers (its entries start at 0.16.1)."""
    v = megatron_core_version()
    if v < Version(VERIFIED_VERSIONS[0]):
        raise ValueError(
            f"megatron-core {v}: areal_mega needs >= {VERIFIED_VERSIONS[0]} (verified: {', '.join(VERIFIED_VERSIONS)})"
        )


def applies(entry: int) -> bool:
    """Whether compat entry ``entry`` applies to the installed megatron-core."""
    return ENTRIES[entry].applies()


# ---------------------------------------------------------------- torch Adam state (entries 1-3)

def materialise_optimizer_state(optimizer: Any) -> None:
    """Entry 1: give every parameter zero Adam state (step 0) if it has none yet.

    Without TE/apex, megatron-core 0.16.1's DistributedOptimizer.state_dict() asserts that
    all torch-Adam states share one 'step', which fails on a fresh optimizer (no state):
    the very case of loading a checkpoint into a new engine. Values are overwritten by load.
    """
    if not applies(1):
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


@contextlib.contextmanager
def skip_adam_step_on_param_state_load(optimizer: Any):
    """Entries 2 and 3: two megatron-core 0.16.1 bugs on the torch-Adam (no TE/apex) path.

    DistributedOptimizer.load_state_dict writes the common ``step`` into every Adam state --
    the SAME tensor object for all parameters -- then load_parameter_state_from_fully_reshardable
    copies per-parameter tensors for every key of that state, but its source dict skips
    "step" -> KeyError. We hide "step" during the per-parameter copy only (it was already set
    from the common state). Afterwards every state gets its own copy of ``step``: torch Adam
    increments it in place once per parameter, so a shared tensor would advance by
    #params per optimizer step and break Adam's bias correction after a resume (caught by
    the resume test: the second step diverged by 0.27 nats).
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if applies(2) else []:
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if orig is None:  # not a DistributedOptimizer
            continue

        def set_states(model_param, tensors, _opt=opt, _orig=orig):
            gi, go = _opt.model_param_group_index_map[model_param]
            state = _opt.optimizer.state[_opt.optimizer.param_groups[gi]["params"][go]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                _orig(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if applies(3) else []:
        for st in opt.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].detach().clone()


# ---------------------------------------------------------------- bf16 with fp32 norms (entries 4-5)

def fix_param_group_index_map(optimizer: Any) -> None:
    """Entry 4: a megatron-core 0.16.1 DistributedOptimizer bug with mixed-dtype param groups.

    Our bf16 models are mixed-dtype: the "local" layer spec's torch RMSNorm weights stay fp32
    (megatron's own training loop would cast the whole model with Float16Module; we do not),
    while linears, embeddings and Qwen2's qkv bias are bf16. megatron puts biases and norms in
    the same (no weight-decay) param group, so for Qwen2 one group holds fp32 AND bf16 params
    (Llama has no biases: each of its groups has one dtype, which is why only Qwen2 failed).

    ``_build_optimizer_group_ranges`` records every param's (group_index, group_order) in
    grad-buffer order (fp32 and bf16 params live in different buffers), but
    ``_build_model_and_main_param_groups`` then installs each inner-optimizer group as
    ``[*fp32 shards, *fp32-from-bf16 shards]`` and never rebuilds the map. Training is
    unaffected (the step uses the parallel model/shard group lists), but checkpointing looks up
    ``optimizer.param_groups[g]["params"][order]`` through the stale map and gets ANOTHER
    param's main param / Adam state: ``get_parameter_state_dp_zero`` (behind
    fully_reshardable save) fails with "The size of tensor a (128) must match the size of
    tensor b (64)" (qkv bias vs an RMSNorm weight), and where sizes happen to agree the state
    would be silently swapped; load (``_set_main_param_and_optimizer_states``) has the same flaw.
    Upstream: NVIDIA/Megatron-LM issue #2777, fixed the same way in PR #5835 (rebuild the map
    in the installed order). For single-dtype groups and fixed megatron versions the rebuilt
    map is identical to megatron's, so this is a no-op there.
    """
    if not applies(4):
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "model_param_group_index_map"):  # not a DistributedOptimizer
            continue
        fixed = {}
        for g, (fp32, f16) in enumerate(zip(opt.model_fp32_groups, opt.model_float16_groups)):
            for order, p in enumerate([*fp32, *f16]):  # the order installed in param_groups[g]
                fixed[p] = (g, order)
        assert fixed.keys() == opt.model_param_group_index_map.keys()
        for g, group in enumerate(opt.optimizer.param_groups):
            assert len(group["params"]) == sum(1 for gi, _ in fixed.values() if gi == g)
        opt.model_param_group_index_map = fixed


def fix_float16_optimizer_sharded_state_dict(optimizer: Any) -> None:
    """Entry 5: work around megatron-core 0.16.1's NON-distributed bf16/fp16 optimizer
    (Float16OptimizerWithFloat16Params) being unable to checkpoint fp32 params.

    Same root cause as :func:`fix_param_group_index_map`: our bf16 models keep the RMSNorm
    weights in fp32. ``Float16OptimizerWithFloat16Params.sharded_state_dict`` assumes every
    optimized param is 16-bit: it numbers optimizer state ids by iterating ``float16_groups``
    only, while torch numbers them over ALL params of ``param_groups`` (fp32 ones included, in
    place), and it pairs each group's state ids with that group's fp32 master copies by
    position. With fp32 params present the ids shift: Llama bf16 fails with "Param id 10 does
    not match any model sharded param", Qwen2 bf16 with "Optimizer shape ((64,) does not match
    model shape ((128,))" -- so no bf16 checkpoint could be saved without the distributed
    optimizer. This replacement builds both mappings from the inner optimizer's real order; the
    tensor keys (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>`` + common_step)
    are megatron's, only the fp32-master container becomes a dict (see below) and
    ``load_state_dict`` converts it back before calling megatron's. Installed only on instances
    that hold fp32 params (single-dtype models keep megatron's code path and format).
    """
    if not applies(5):
        return
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, Float16OptimizerWithFloat16Params) or not any(opt.fp32_from_fp32_groups):
            continue

        def sharded_state_dict(model_sharded_state_dict, is_loading=False, metadata=None, _opt=opt):
            if is_loading:
                _opt.init_state_fn(_opt.optimizer, _opt.config)
            state_dict = _opt.state_dict()
            # torch's state ids: params enumerated over param_groups in order. For 16-bit params
            # the optimizer holds the fp32 master copy; map it back to the model param, whose
            # sharded tensor (same id(.data)) carries the key/sharding.
            model_of_main = {
                id(main): p
                for g16, g32 in zip(_opt.float16_groups, _opt.fp32_from_float16_groups)
                for p, main in zip(g16, g32)
            }
            optim_params = [q for g in _opt.optimizer.param_groups for q in g["params"]]
            state_id = {id(q): i for i, q in enumerate(optim_params)}
            id_to_sharded = get_param_id_to_sharded_param_map(
                model_sharded_state_dict, [model_of_main.get(id(q), q) for q in optim_params]
            )
            # A dict {group index: [...]}, not megatron's list of lists: a group with no 16-bit
            # params (Llama's norms-only group) gives an empty inner list, and
            # dist_checkpointing's extract_matching_values/merge shift list positions around
            # empty lists, so load failed with "Cannot merge two lists with different lengths
            # (0 and 10)". Dicts keep their keys; load_state_dict below turns it back.
            state_dict["fp32_from_fp16_params"] = {
                g: [
                    make_sharded_optimizer_tensor(
                        id_to_sharded[state_id[id(main)]], main, prefix="optimizer.state.fp32_param"
                    )
                    for main in g32
                ]
                for g, g32 in enumerate(_opt.fp32_from_float16_groups)
            }
            step = _opt._extract_common_per_param_step(state_dict["optimizer"])
            optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded, exclude_keys="step")
            if step:
                state_dict["optimizer"]["state"]["common_step"] = step
            return state_dict

        def load_state_dict(state_dict, _opt=opt):
            saved = state_dict.get("fp32_from_fp16_params")
            if isinstance(saved, dict):
                groups = [saved[g] for g in range(len(_opt.fp32_from_float16_groups))]
                state_dict = {**state_dict, "fp32_from_fp16_params": groups}
            return type(_opt).load_state_dict(_opt, state_dict)

        opt.sharded_state_dict = sharded_state_dict
        opt.load_state_dict = load_state_dict


# ---------------------------------------------------------------- interleaved pipeline (entries 6-8)

def configure_interleaved_p2p(tcfg: Any) -> None:
    """Entries 6 and 7: pipeline p2p settings under which megatron-core 0.16.1's interleaved (VPP)
    schedule trains correctly; applied to the model's (shared) TransformerConfig.

    Why megatron's defaults give wrong gradients: in steady-state interleaved 1F1B a stage sends
    activations to the NEXT stage and gradients to the PREVIOUS stage in one p2p call, and with
    pp == 2 next and previous are the SAME rank. The default ``batch_p2p_comm=True`` posts every
    rank's ops as send_prev, recv_prev, send_next, recv_next, so rank A sends (gradient,
    activation) to B while B receives (activation, gradient) from A; messages between two ranks
    match in posting order (gloo: same peer, same tag), so the activation lands in the gradient
    buffer and vice versa. With one fixed shape this is silent: measured at PP2 x VPP2 with 4
    micro-batches, grad norm 54.3 instead of 0.974 and loss off by 9.9e-4 (activations swapped
    too). It needs M > pp micro-batches: with M == pp every step is warm-up or cool-down and no
    call sends both ways. Megatron-LM's own argument check forbids it ("When interleaved schedule
    is used and p2p communication overlap is disabled, pipeline-model-parallel size should be
    greater than 2 ..."); its default for interleaving is overlap_p2p_comm=True and
    batch_p2p_comm=False, which we use: ``_p2p_ops`` orders the ops by even/odd rank and, in a
    2-rank pipeline group, sends the two directions over different process groups (pp vs
    WORLD), so they cannot cross (tests/dist/engine_vpp.py: equal to plain PP2 within 1e-6).

    Why no variable lengths: ``variable_seq_lengths`` first exchanges shapes, and that exchange is
    always batched in the same crossing order, whatever ``batch_p2p_comm`` says. Measured with
    packed micro-batches: batched p2p -> a rank receives another micro-batch's activation
    ("size of tensor a (70) must match ... b (49)"); unbatched p2p -> the swapped shapes no
    longer match the data (gloo "Received data size doesn't match expected size", 17920 vs 12544
    bytes); an earlier attempt saw a hang. So under VPP ``model.run_schedule`` pads every
    micro-batch to the longest one of the step (fixed p2p shape; :func:`pad_microbatch`,
    :func:`trimmed_loss`). Cost: M * T_max token positions computed instead of sum(T_i), plus a
    [T_max, T_max] mask per micro-batch on the mask path -- on the test batch +24% (4
    micro-batches: 70/61/49/45 tokens) and +56% (5: 70/61/40/28/26); a filler micro-batch (fewer
    real ones than pp) costs a whole padded micro-batch. Keep micro-batches even (sequences no
    longer than max_tokens_per_microbatch) to keep the waste small.
    """
    if applies(6):
        tcfg.batch_p2p_comm = False
        tcfg.overlap_p2p_comm = True
    # Entry 7 has no "off" branch yet: model.run_schedule pads every VPP micro-batch.
    assert applies(7), f"compat entry 7: no unpadded VPP path for megatron-core {megatron_core_version()}"
    tcfg.variable_seq_lengths = False


def pad_microbatch(mb: dict[str, torch.Tensor], seq_length: int) -> dict[str, torch.Tensor]:
    """Entry 7: the model inputs of micro-batch ``mb`` padded to ``seq_length`` tokens (VPP's fixed
    p2p shape). Pair it with :func:`trimmed_loss` so the loss sees only the real tokens.

    Padding = one extra "sequence" of pad tokens after the real ones: the block-diagonal
    mask keeps it out of the real tokens' attention, RoPE is relative, so the real
    positions compute exactly what they would unpadded; the loss sees only those.
    """
    T = int(mb["input_ids"].numel())
    out = {
        "input_ids": torch.cat([mb["input_ids"], mb["input_ids"].new_full((seq_length - T,), PAD_TOKEN_ID)]),
        "cu_seqlens": torch.cat([mb["cu_seqlens"], mb["cu_seqlens"].new_full((1,), seq_length)]),
    }
    if "routed_experts" in mb:  # MoE routing replay is a model input too: pad rows -1 (no route)
        r = mb["routed_experts"]
        out["routed_experts"] = torch.cat([r, r.new_full((seq_length - T, *r.shape[1:]), -1)])
    return out


def trimmed_loss(loss_func: Callable, mb: dict[str, torch.Tensor], num_tokens: int, output: torch.Tensor):
    """Entry 7: loss_func on the real tokens of a padded micro-batch's output [1, T_pad, ...]."""
    return loss_func(mb, output[:, :num_tokens])


def microbatch_group_size(num_microbatches: int, pp: int) -> int:
    """Entry 8: megatron's ``microbatch_group_size_per_vp_stage`` for the interleaved schedule:
    micro-batches each model chunk runs back to back. 0.16.1 requires pp <= N <= M and M % N == 0
    or >= pp; the smallest valid N (megatron's default is pp) keeps the warm-up, and so activation
    memory, lowest."""
    if not applies(8):
        return pp  # megatron's default
    for n in range(pp, num_microbatches + 1):
        r = num_microbatches % n
        if r == 0 or r >= pp:
            return n
    raise ValueError(f"interleaved pipeline: needs >= pp ({pp}) micro-batches, got {num_microbatches}")


# ---------------------------------------------------------------- sequence parallelism, local spec (entry 9)

class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """Entry 9: torch RMSNorm built from megatron's norm arguments, usable under sequence
    parallelism: identical math and parameters to what ``WrappedTorchNorm`` builds (torch
    ``RMSNorm(hidden_size, eps)``, weight in torch's default dtype), plus
    ``weight.sequence_parallel = config.sequence_parallel`` so that finalize_model_grads
    all-reduces its gradient over the TP group when each rank saw only its sequence shard."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"SequenceParallelRMSNorm: only plain RMSNorm, got {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def define_missing_te_gemm() -> None:
    """Entry 10: ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` without TE."""
    from megatron.core.transformer.moe import moe_utils

    if applies(10) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def fix_mla_have_te() -> None:
    """Entry 11: ``multi_latent_attention.HAVE_TE = False`` when transformer_engine does not import."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not applies(11):
        return
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE install raises RuntimeError, not ImportError
        mla.HAVE_TE = False


def local_spec_with_sp_norms(layer_spec: Any) -> Any:
    """Entry 9: the local layer spec with its (input, pre-MLP) norms replaced by
    :class:`SequenceParallelRMSNorm` (IdentityOp slots stay identity)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not applies(9):
        return layer_spec
    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
        if getattr(sub, name, None) is WrappedTorchNorm:
            setattr(sub, name, SequenceParallelRMSNorm)
    # Qwen3's per-head q/k norms (qk_layernorm): WrappedTorchNorm asserts under SP too. The same
    # torch RMSNorm over head_dim; finalize_model_grads sums their grads over TP (each TP rank
    # normalised only its heads) by name ("q_layernorm" / "k_layernorm") or the SP flag, once.
    attn = getattr(sub.self_attention, "submodules", None)
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # kv_layernorm: MLA's latent norm
        if getattr(attn, name, None) is WrappedTorchNorm:
            setattr(attn, name, SequenceParallelRMSNorm)
    return spec


def block_spec_with_sp_final_norm(layer_specs: list[Any], tcfg: Any, vp_stage: int | None, pp_rank: int) -> Any:
    """Entry 9: a TransformerBlockSubmodules for this pipeline chunk -- the specs of its layers
    (``layer_specs`` has one per GLOBAL layer: dense and MoE layers differ), as megatron's
    ``_get_block_submodules`` would pick them -- whose final norm is
    :class:`SequenceParallelRMSNorm` instead of the module-level ``LayerNormImpl``."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not applies(9):
        return layer_spec  # megatron builds the block (and its final norm) from the layer spec
    n = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    off = get_transformer_layer_offset(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=list(layer_specs[off:off + n]), layer_norm=SequenceParallelRMSNorm)


def identity_rotate_activation() -> None:
    """Entry 17: megatron's DSA indexer without its Hadamard rotation (q . k unchanged, as HF)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    if applies(17):
        dsa.rotate_activation = lambda x: x


def _torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla.modules.l2norm's formula (transformers' Qwen3.5 fallback uses the same)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def enable_torch_gated_delta_net() -> None:
    """Entry 13: run megatron-core's GatedDeltaNet on its pure-torch delta rule when fla is absent."""
    from megatron.core.ssm import gated_delta_net as gdn

    if not applies(13) or gdn.HAVE_FLA:
        return
    gdn.l2norm = _torch_l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    gdn.HAVE_FLA = True


# ---------------------------------------------------------------- YaRN on GPT attention (entry 15)
def set_gpt_yarn(tcfg: Any, yarn: Any) -> None:
    """Entry 15: the yarn_* fields GPTModel's YarnRotaryEmbedding and SelfAttention's mscale read,
    from the adapter's YarnArch (HF's attention_factor = 0.1 ln(factor) + 1: mscale fields None)."""
    if not applies(15):
        return
    for k, v in dict(yarn_rotary_scaling_factor=yarn.factor,
                     yarn_original_max_position_embeddings=yarn.original_max_position_embeddings,
                     yarn_beta_fast=yarn.beta_fast, yarn_beta_slow=yarn.beta_slow, yarn_mscale=None,
                     yarn_mscale_all_dim=None, yarn_correction_range_round_to_int=yarn.truncate).items():
        setattr(tcfg, k, v)


# ---------------------------------------------------------------- biased experts, autograd (entry 16)
def fix_expert_bias_inplace() -> None:
    """Entry 16: an expert RowParallelLinear with a bias returns a fresh tensor, not the view a
    one-rank reduce hands back, so MLP.forward's in-place bias add is legal under autograd."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if not applies(16) or getattr(RowParallelLinear.forward, "_areal_expert_bias", False):
        return
    orig = RowParallelLinear.forward

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        out, bias = orig(self, *args, **kwargs)
        if self.is_expert and bias is not None and out._is_view() and torch.is_grad_enabled():
            out = out.clone()
        return out, bias

    forward._areal_expert_bias = True
    RowParallelLinear.forward = forward
