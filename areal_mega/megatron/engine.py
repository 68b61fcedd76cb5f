"""MegatronTrainEngine: the learner side of areal_mega on megatron-core (TP / PP / VPP / CP / DP).

    global packed batch ─plan_microbatches (pure; same on all ranks)─► this DP rank's micro-batches
    ─forward_backward_func (megatron schedule)─► last stage: vocab-parallel logits
    ─logprobs.py (3 TP all-reduces)─► loss_fn(logprobs, entropy, mb) ─► backward
    ─finalize_model_grads (DP / tied-embedding all-reduce)─► optimizer.step (LR scheduler)

Invariant: ``loss_fn`` returns its micro-batch's SHARE of the global objective and the engine sums
shares, so gradients do not depend on the micro-batch split, DP or CP size. Outputs are
next-token aligned. Details (normalisation, attention, SP, recompute): docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from areal_mega.api.engine import TrainEngine
from areal_mega.megatron import compat
from areal_mega.megatron.logprobs import vocab_parallel_logprobs
from areal_mega.utils.stats import LAST, reduction
from areal_mega.megatron.lora import LoraConfig, apply_lora, check_lora
from areal_mega.megatron.model import (
    MegatronModel, MegatronModelConfig, build_model, check_context_parallel, check_moe_sequence_parallel, context_forward,
    load_hf_weights, microbatch_shard, packed_causal_mask, row_lengths, run_schedule,
)
from areal_mega.megatron.context_parallel import gather_tokens
from areal_mega.megatron.routing import BatchReplay, replay_metrics
from areal_mega.batching.packing import (
    last_token_mask,
    next_token_labels,
    plan_microbatches,
    scatter_to_batch,
    slice_microbatch,
    validate_batch,
)
from areal_mega.megatron.checkpoint import load_training_checkpoint, read_metadata, save_checkpoint

LossFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(logprobs [T_mb], entropy [T_mb], micro_batch) -> (loss, stats)``.

``logprobs`` / ``entropy`` carry gradients (fp32, next-token aligned, 0 at sequence ends);
``micro_batch`` is the packed micro-batch dict (all batch fields sliced to its sequences, own
``cu_seqlens``, plus ``seq_indices``). ``loss`` is a scalar: this micro-batch's share of the
global objective (the engine sums shares). ``stats``: scalar tensors, the same keys for every
micro-batch; reduced as documented in :meth:`MegatronTrainEngine.train_batch`.
A filler micro-batch (one pad token, every field 0) may be passed: return a zero share.
"""


@dataclass
class OptimizerConfig:
    """Adam + LR schedule for the learner (megatron's get_megatron_optimizer)."""

    lr: float = 1e-6
    """Peak learning rate (reached after the warm-up)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; megatron skips biases and norms."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all TP/PP/DP ranks); 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state and fp32 master weights over the DP ranks (ZeRO-1)."""
    lr_warmup_steps: int = 0
    """Linear warm-up: optimizer step k (1-based) uses lr * k / lr_warmup_steps for k <= it."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """LR after the warm-up: constant, or decayed to min_lr at lr_decay_steps."""
    lr_decay_steps: int | None = None
    """Step at which the decay reaches min_lr (counted from step 0, includes the warm-up);
    required for linear/cosine decay."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr: must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad: must be >= 0, got {self.clip_grad}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps: must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None or self.lr_decay_steps <= self.lr_warmup_steps:
                raise ValueError(
                    f"lr_decay_steps: {self.lr_decay_style} decay needs lr_decay_steps > "
                    f"lr_warmup_steps ({self.lr_warmup_steps}), got {self.lr_decay_steps}"
                )


@dataclass
class MegatronEngineConfig:
    """The learner engine: model instantiation, optimizer, micro-batching."""

    model: MegatronModelConfig = field(default_factory=MegatronModelConfig)
    """How the megatron model is built (layer spec, dtype float32/bfloat16, vocab padding)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Adam and learning-rate schedule."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed micro-batch; a longer sequence gets a micro-batch of its
    own (never split). Memory per micro-batch ~ this (x T with the CPU attention mask)."""
    attention: Literal["auto", "mask", "thd"] = "auto"
    """Packed attention: "thd" = PackedSeqParams for transformer-engine's variable-length fused
    kernels (no [T, T] mask, no cross-sequence FLOPs, linear memory; GPU + TE spec only, untested
    on CPU); "mask" = block-diagonal causal mask (works everywhere, keeps [T, T] scores per head:
    the CPU/test path); "auto" = "thd" with the TE spec (except under VPP, where thd is refused),
    else "mask" (:func:`resolve_attention`)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 even for bf16 parameters."""
    compute_entropy: bool = True
    """Compute the per-token entropy (with gradient) for loss_fn in train_batch; costs one
    extra pass over the [T_mb, V/tp] logits."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA (docs/lora.md): rank > 0 freezes the base and trains low-rank adapters only (the
    optimizer, its state and the gradients hold just them); the frozen reference is the base."""

    def validate(self) -> None:
        if self.max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch: must be >= 1, got {self.max_tokens_per_microbatch}")
        if self.attention not in ("auto", "mask", "thd"):
            raise ValueError(f"attention: {self.attention!r} is not one of auto, mask, thd")
        self.lora.validate()


def resolve_attention(attention: str, layer_spec: str, vpp: int | None) -> Literal["mask", "thd"]:
    """``attention`` "auto" resolved: "thd" (fused varlen) with the TE spec unless interleaved,
    else "mask"; explicit values unchanged (the engine validates them)."""
    if attention == "auto":
        return "thd" if layer_spec == "te" and not vpp else "mask"
    return attention  # type: ignore[return-value]


def check_attention(attention: str, layer_spec: str) -> None:
    """The resolved ``attention`` refused where the layer spec cannot run it (start-up and dry run)."""
    if attention == "thd" and layer_spec != "te":
        raise ValueError("attention: 'thd' needs the transformer-engine layer spec (model.layer_spec='te')")


class MegatronTrainEngine(TrainEngine):
    """A megatron-core policy/critic with Megatron DDP, optimizer and LR schedule.

    Every method is collective over ALL learner ranks and must be called with the same
    arguments (the same global batch) on every rank. Results (log-probs, stats) are returned
    on every rank.
    """

    def __init__(self, cfg: MegatronEngineConfig, model: MegatronModel, *, trainable: bool = True):
        """``trainable=False`` builds a forward-only engine (e.g. the frozen reference policy for
        the KL penalty): parameters are frozen and there is no DDP wrapper, optimizer (no fp32
        master weights, no Adam moments: 12 bytes/param saved on GPU) or LR schedule;
        ``forward``/``forward_logprobs`` work as usual, ``train_batch``/``save``/``load`` raise."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig as MOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        cfg.validate()
        cfg.optimizer.validate()
        if trainable:
            check_lora(cfg.lora, model.arch, model.groups.layout, model.layer_spec,
                       critic=getattr(self, "checkpoint_role", "policy") == "critic")
        self.attention = resolve_attention(cfg.attention, model.layer_spec, model.groups.layout.vpp)
        check_attention(self.attention, model.layer_spec)
        check_context_parallel(model.groups.layout, model.layer_spec, self.attention,
                               cp_comm_type=cfg.model.cp_comm_type, vpp=model.groups.layout.vpp,
                               mla=model.arch.mla is not None)
        if model.groups.layout.vpp:
            if self.attention == "thd":
                raise ValueError(
                    "attention: 'thd' with virtual_pipeline_parallel is not supported (the interleaved "
                    "schedule pads micro-batches to one length; untested with TE's packed kernels)"
                )
            # megatron-core 0.16.1 VPP p2p crosses at PP = 2: unbatched, fixed-shape p2p (compat entries 6-7).
            compat.configure_interleaved_p2p(model.config)
        self.cfg = cfg
        self.model = model
        self.groups = model.groups
        self.layout = model.groups.layout
        self._version = 0
        self._num_steps = 0
        self.trainable = trainable
        self._device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # MoE routing replay: a batch's routed_experts are replayed; forwards record the natural routes.
        self.replay: BatchReplay | None = None
        if model.arch.is_moe and cfg.model.moe_routing_replay != "off":
            self.replay = BatchReplay(model.arch.num_layers, model.arch.moe_topk, self.groups.coords.tp, self.layout.tp,
                                      bool(model.config.sequence_parallel))
        if not trainable:
            for m in model.chunks:
                m.requires_grad_(False)
            self.chunks = list(model.chunks)
            self.optimizer = self.scheduler = None
            return
        tcfg = model.config
        # Packed micro-batches differ in length: PP p2p must send shapes -- except under VPP,
        # where _run_schedule pads them to one length instead (see compat.configure_interleaved_p2p).
        assert tcfg.variable_seq_lengths != bool(self.layout.vpp)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        )
        self.chunks = [
            # Only the first chunk gets buckets: megatron's own rule for interleaved models.
            DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(model.chunks)
        ]
        o = cfg.optimizer
        self.optimizer = get_megatron_optimizer(
            MOptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                bf16=model.dtype == "bfloat16",
                fp16=model.dtype == "float16",
                params_dtype=tcfg.params_dtype,
                use_distributed_optimizer=o.use_distributed_optimizer,
            ),
            self.chunks,
        )
        # megatron-core 0.16.1 checkpointing bugs with our mixed fp32/bf16 params (compat entries 4, 5).
        compat.fix_param_group_index_map(self.optimizer)  # dist-opt: stale param -> state map
        compat.fix_float16_optimizer_sharded_state_dict(self.optimizer)  # non-dist bf16: state ids
        # megatron's scheduler asserts decay_steps > warmup even for "constant".
        decay_steps = o.lr_decay_steps if o.lr_decay_steps is not None else o.lr_warmup_steps + 1
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        # Hooks the schedules call (same wiring as megatron's training loop).
        tcfg.grad_scale_func = self.optimizer.scale_loss
        tcfg.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.chunks]
        tcfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def create(
        cls, cfg: MegatronEngineConfig, hf_config: Any, groups: Any, hf_weights_dir: str | None = None,
        *, trainable: bool = True,
    ) -> "MegatronTrainEngine":
        """Build the model for ``hf_config`` under ``groups`` (from parallel_state.init_model_parallel),
        load HF weights if ``hf_weights_dir`` is given, and wrap it in an engine
        (forward-only when ``trainable`` is False, see ``__init__``)."""
        import dataclasses


        model_cfg = cfg.model
        if not trainable and model_cfg.recompute != "none":
            # Forward-only (no_grad): nothing is saved for backward, so recompute would only add
            # checkpoint wrappers; the reference is built without it.
            model_cfg = dataclasses.replace(model_cfg, recompute="none")
        model = build_model(hf_config, groups, model_cfg)
        if trainable:
            check_moe_sequence_parallel(model.arch, model_cfg, groups.layout)
        if hf_weights_dir is not None:
            load_hf_weights(model, hf_weights_dir)
        if trainable and cfg.lora.enabled:
            check_lora(cfg.lora, model.arch, groups.layout, model.layer_spec)
            apply_lora(model, cfg.lora)  # freezes the base: DDP and the optimizer see adapters only
        engine = cls(cfg, model, trainable=trainable)
        engine.source_hf_dir = str(hf_weights_dir) if hf_weights_dir is not None else None  # checkpoint metadata
        return engine

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise ValueError(f"{what}: this engine was built forward-only (trainable=False)")

    # ------------------------------------------------------------------ internals
    def _plan(self, batch: dict[str, torch.Tensor]):
        lens = validate_batch(batch)
        # The interleaved schedule needs >= pp micro-batches (its micro-batch groups hold >= pp):
        # fewer real ones get filler micro-batches (one pad token, zero share).
        min_mb = self.layout.pp if self.layout.vpp else 1
        plan = plan_microbatches(lens, self.cfg.max_tokens_per_microbatch, self.layout.dp, min_microbatches=min_mb)
        mine = plan.per_rank[self.groups.coords.dp]
        return plan, [slice_microbatch(batch, mb) for mb in mine]

    def _model_forward(self, chunk: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        T = int(mb["input_ids"].numel())
        if self.replay is not None:  # MoE routing replay: this chunk's routers, this micro-batch
            if "routed_experts" in mb:
                self.replay.set_targets(chunk, mb["routed_experts"], T)
            else:
                self.replay.observe(chunk)
        if "context_shard" in mb:  # context parallelism: this rank's chunks, THD over the whole row
            return context_forward(chunk, mb, self._device, self.groups.cp)
        tokens = mb["input_ids"].view(1, T).to(self._device)
        positions = torch.arange(T, device=self._device).view(1, T)
        if self.attention == "thd":
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = mb["cu_seqlens"].to(self._device, torch.int32)
            max_len = int((cu[1:] - cu[:-1]).max())
            psp = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
            )
            return chunk(tokens, positions, None, packed_seq_params=psp)
        mask = packed_causal_mask(mb["cu_seqlens"], T).to(self._device)
        return chunk(tokens, positions, mask)

    def _token_outputs(self, output: torch.Tensor, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
        """Last stage: logits [1, T, V/tp] -> (logprobs [T], entropy [T]), 0 at sequence ends.
        Under context parallelism ``output`` holds this CP rank's tokens; the log-probs are
        computed on them and gathered back into row order (:meth:`_gather_tokens`)."""
        labels = next_token_labels(mb["input_ids"], mb["cu_seqlens"])
        shard = self._shard(mb, output)
        lp, ent = vocab_parallel_logprobs(
            output[0],
            labels if shard is None else shard.to_local(labels, 0),
            tp_group=self.groups.tp,
            temperature=temperature,
            with_entropy=with_entropy,
            vocab_size=self.model.arch.vocab_size,
        )
        if shard is not None:
            lp, ent = gather_tokens(lp, shard, self.groups.cp), gather_tokens(ent, shard, self.groups.cp)
        ends = last_token_mask(mb["cu_seqlens"], labels.numel())
        return lp.masked_fill(ends, 0.0), ent.masked_fill(ends, 0.0)

    def _shard(self, mb: dict[str, torch.Tensor], output: torch.Tensor):
        """The ContextShard ``output`` [1, t_local, ...] of micro-batch ``mb`` was computed on
        (None at cp 1): the row ran at t_local * cp tokens."""
        if self.layout.cp <= 1:
            return None
        return microbatch_shard(self.model, mb, output.shape[1] * self.layout.cp)

    def _run_schedule(self, mbs: list[dict[str, torch.Tensor]], loss_func: Callable, forward_only: bool) -> list[Any]:
        return run_schedule(self.model, self.chunks, mbs, loss_func, self._model_forward, device=self._device,
                            forward_only=forward_only)

    def _last_stage_rank(self) -> int:
        c = self.groups.coords
        return self.layout.rank(dp=c.dp, pp=self.layout.pp - 1, cp=c.cp, tp=c.tp)

    def _share_from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.layout.pp > 1:
            dist.broadcast(tensor, src=self._last_stage_rank(), group=self.groups.pp)
        return tensor

    # ------------------------------------------------------------------ TrainEngine API
    def forward(self, batch: dict[str, torch.Tensor], temperature: float = 1.0, with_entropy: bool = True) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` [T] (fp32, batch order, next-token aligned).

        Computed on the last stage of each DP replica for its share of the sequences, summed
        over the DP group (other positions are 0 there) and broadcast from the last stage to
        the other stages: every rank returns the full tensors.
        """
        if temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        _, mbs = self._plan(batch)
        pieces: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        if self.replay is not None:
            self.replay.reset(self.chunks)

        def loss_func(mb, output):
            lp, ent = self._token_outputs(output, mb, temperature, with_entropy)
            if mb["seq_indices"].numel():
                pieces.append((mb["seq_indices"].tolist(), lp.detach().cpu(), ent.detach().cpu()))
            return torch.zeros((), device=output.device), {}

        for c in self.chunks:
            c.eval()
        with torch.no_grad():
            self._run_schedule(mbs, loss_func, forward_only=True)
        cu = batch["cu_seqlens"]
        both = torch.zeros(2, int(cu[-1]), dtype=torch.float32)
        scatter_to_batch(cu, [(s, lp) for s, lp, _ in pieces], out=both[0])
        scatter_to_batch(cu, [(s, e) for s, _, e in pieces], out=both[1])
        both = both.to(self._device)
        if self.layout.dp > 1:  # disjoint positions: the sum is an exact gather
            dist.all_reduce(both, group=self.groups.dp)
        self._share_from_last_stage(both)
        both = both.cpu()
        out = {"logprobs": both[0], "entropy": both[1]}
        if self.replay is not None:
            out["routes"] = self._natural_routes(batch, mbs)
        return out

    def _natural_routes(self, batch: dict[str, torch.Tensor], mbs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The experts this model's routers chose themselves in the forward just run (whatever was
        replayed), int16 [T, layers * top_k] in batch order on every rank."""
        rows = self.replay.natural_rows(self.chunks, self._row_tokens(batch, mbs), int(batch["cu_seqlens"][-1]))
        self.replay.reset(self.chunks)
        rows = rows.to(self._device)
        for g in (self.groups.tp, self.groups.pp, self.groups.dp_cp):  # one contribution per (token, layer)
            if dist.get_world_size(g) > 1:
                dist.all_reduce(rows, group=g)
        return rows.cpu().view(rows.shape[0], -1).to(torch.int16)

    def _row_tokens(self, batch: dict[str, torch.Tensor], mbs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per micro-batch: the batch token index of every position of the row this rank ran
        (its CP share under context parallelism), -1 at pads and fillers."""
        cu = batch["cu_seqlens"].tolist()
        out = []
        for mb, n in zip(mbs, row_lengths(self.model, mbs)):
            idx = mb["seq_indices"].tolist()
            tok = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in idx]) if idx else torch.full((1,), -1)
            if self.layout.cp > 1:
                out.append(microbatch_shard(self.model, mb, n).to_local(tok, -1))
            else:
                out.append(torch.cat([tok, tok.new_full((n - tok.numel(),), -1)]))
        return out

    def proximal_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> dict[str, float]:
        """pi_prox (the policy before this update; one extra forward) into ``batch["prox_logprobs"]``.
        MoE routing replay (``actor.model.moe_routing_replay``): the servers' routes in the batch
        are replayed here ("rollout"); with "proximal" the routes this forward chose become the
        batch's, for the training forward. "observe": the servers' routes are measured, never
        replayed (dropped from the batch after the metrics), plus one more forward replaying them
        on the same tokens: the mismatch replay would have left (``routing/mismatch_if_replayed_*``),
        paired with the one trained on. Returns the train/inference mismatch metrics
        (routing.replay_metrics)."""
        mode = self.cfg.model.moe_routing_replay
        server_routes = batch.pop("routed_experts", None) if mode == "observe" else None
        out = self.forward(batch, temperature, with_entropy=False)
        batch["prox_logprobs"] = out["logprobs"]
        natural = out.get("routes")
        if mode == "proximal":
            batch["routed_experts"] = natural
        version, layers = self.get_version(), self.model.arch.num_layers
        if server_routes is None:
            return replay_metrics(batch, out["logprobs"], natural, version, layers)
        measured = {**batch, "routed_experts": server_routes}
        replayed = self.forward(measured, temperature, with_entropy=False)["logprobs"]
        metrics = replay_metrics(measured, out["logprobs"], natural, version, layers)
        metrics.update({k.replace("routing/mismatch_", "routing/mismatch_if_replayed_"): v
                        for k, v in replay_metrics(measured, replayed, None, version, layers).items()
                        if k != "routing/mismatch_tokens"})
        return metrics

    def forward_logprobs(self, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        """log softmax(logits / temperature)[next token], flat [T] on every rank (see forward)."""
        return self.forward(batch, temperature, with_entropy=False)["logprobs"]

    def train_batch(self, batch: dict[str, torch.Tensor], loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over the global ``batch`` (same on every rank).

        Returns (on every rank): ``loss`` (sum of loss_fn shares over all micro-batches and DP
        ranks = the global objective), ``grad_norm`` (before clipping), ``lr`` (used by this
        step), ``num_microbatches`` (per DP rank), ``num_tokens`` (global), ``step``, and
        loss_fn's stats reduced over all micro-batches and DP ranks by the one rule of
        ``areal_mega.utils.stats`` (totals summed, "/max" "/min" by max/min, the rest by an
        ``n_tokens``-weighted mean when stats contain "n_tokens", else a plain mean).
        """
        self._require_trainable("train_batch")
        if temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        plan, mbs = self._plan(batch)
        num_mb = len(mbs)
        dp = self.layout.dp

        def loss_func(mb, output):
            lp, ent = self._token_outputs(output, mb, temperature, self.cfg.compute_entropy)
            loss, stats = loss_fn(lp, ent, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn: loss must be a scalar, got shape {tuple(loss.shape)}")
            reported = {"loss": loss.detach().clone().float()}
            reported.update({k: torch.as_tensor(v).detach().float().reshape(()).cpu() for k, v in stats.items()})
            # Undo the schedule's 1/num_microbatches and DDP's 1/dp averaging: shares are summed.
            # (Under CP the schedule multiplies by cp and DDP averages over dp x cp: that cancels;
            # every CP rank returns the same share, its gradient flowing through its own tokens.)
            return loss * (num_mb * dp), reported

        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.replay is not None:
            self.replay.reset(self.chunks)
        records = self._run_schedule(mbs, loss_func, forward_only=False)
        if self.replay is not None:
            self.replay.reset(self.chunks)
        # Step k uses the LR of step k (megatron's own loop would use step k-1's, i.e. lr=0 first).
        self.scheduler.step(increment=1)
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        self._num_steps += 1
        stats = self._reduce_stats(records)
        stats.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            update_successful=float(bool(ok)),
            num_microbatches=float(num_mb),
            num_tokens=float(batch["input_ids"].numel()),
            step=float(self._num_steps),
        )
        return stats

    def _reduce_stats(self, records: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Last stage: reduce per-micro-batch stats over micro-batches and the DP group, then
        broadcast the resulting dict to the other pipeline stages."""
        out: list[Any] = [None]
        if self.groups.is_last_stage:
            records = [{k: v.float().cpu() for k, v in r.items()} for r in records]
            keys = sorted(records[0])
            how = {k: reduction(k) for k in keys}
            assert "last" not in how.values(), f"loss_fn stats must not use the names {sorted(LAST)}"
            weights = torch.stack([r["n_tokens"] if "n_tokens" in r else torch.ones(()) for r in records])
            sum_keys = [k for k in keys if how[k] in ("sum", "mean")]
            max_keys = [k for k in keys if how[k] == "max"]
            min_keys = [k for k in keys if how[k] == "min"]
            # Means travel as weighted sums (plus the total weight) through one all-reduce.
            sums = [torch.stack([r[k] for r in records]) * (1.0 if how[k] == "sum" else weights) for k in sum_keys]
            s = torch.stack([v.sum() for v in sums] + [weights.sum()])
            mx = torch.stack([torch.stack([r[k] for r in records]).max() for k in max_keys]) if max_keys else torch.zeros(0)
            mn = torch.stack([torch.stack([r[k] for r in records]).min() for k in min_keys]) if min_keys else torch.zeros(0)
            if self.layout.dp > 1:
                s, mx, mn = s.to(self._device), mx.to(self._device), mn.to(self._device)
                dist.all_reduce(s, group=self.groups.dp)
                if mx.numel():
                    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=self.groups.dp)
                if mn.numel():
                    dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=self.groups.dp)
                s, mx, mn = s.cpu(), mx.cpu(), mn.cpu()
            total_w = float(s[-1])
            res: dict[str, float] = {}
            for i, k in enumerate(sum_keys):
                res[k] = float(s[i]) if how[k] == "sum" else float(s[i]) / max(total_w, 1e-12)
            res.update({k: float(mx[i]) for i, k in enumerate(max_keys)})
            res.update({k: float(mn[i]) for i, k in enumerate(min_keys)})
            out[0] = res
        if self.layout.pp > 1:
            dist.broadcast_object_list(out, src=self._last_stage_rank(), group=self.groups.pp)
        return out[0]

    # ------------------------------------------------------------------ checkpoints
    checkpoint_role = "policy"
    """``role`` in this engine's checkpoint metadata (the critic's is "critic")."""
    source_hf_dir: str | None = None
    """The HF directory the weights were loaded from (set by :meth:`create`); recorded in the
    checkpoint metadata, tokenizer files are copied from it on HF export."""

    def _optimizer_sharded_state_dict(self, is_loading: bool) -> Callable[[dict], dict]:
        # fully_reshardable: optimizer state keyed by model parameter in its canonical shape
        # (not by DP buffer layout), so a checkpoint saved at one TP/PP/DP loads at another.
        # (megatron's default, fully_sharded_model_space, uses flattened_range, which 0.16.1's
        # dist_checkpointing rejects; see the note at the end of compat's docstring.)
        return lambda model_sd: self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )

    def save(self, path: str, *, step: int | None = None, source_hf_dir: str | None = None,
             extra: dict[str, Any] | None = None, atomic: bool = True) -> None:
        """Model + optimizer + LR schedule + version as an areal_mega checkpoint in ``path``
        (areal_mega.megatron.checkpoint.save_checkpoint: megatron distributed checkpoint,
        loadable under any TP/PP/DP layout of the same model, plus areal_mega.json). ``step``
        defaults to the optimizer step count, ``source_hf_dir`` to the one :meth:`create` loaded;
        ``atomic``: staged and renamed into place (an existing ``path`` is replaced), else
        written straight into ``path``. The calling script must be
        ``if __name__ == "__main__"``-guarded (dist_checkpointing spawns a Manager)."""
        self._require_trainable("save")
        save_checkpoint(
            self.model, path,
            step=self._num_steps if step is None else step,
            version=self._version,
            source_hf_dir=source_hf_dir or self.source_hf_dir,
            role=self.checkpoint_role,
            optimizer=self._optimizer_sharded_state_dict(is_loading=False),
            train_state={"num_steps": self._num_steps, "lr_scheduler": self.scheduler.state_dict()},
            extra=extra,
            atomic=atomic,
            replace=True,
        )

    def load(self, path: str) -> None:
        """Inverse of :meth:`save`, into this engine's (possibly different) layout. Refuses
        (CheckpointError, one line) a missing or incomplete checkpoint, another format version,
        another role (policy vs critic) and a weights-only checkpoint."""
        self._require_trainable("load")
        read_metadata(path, role=self.checkpoint_role, training=True)  # clean errors before any optimizer work
        # megatron-core 0.16.1 dist-opt + torch Adam: state_dict() needs Adam state (compat entry 1).
        compat.materialise_optimizer_state(self.optimizer)
        meta, optimizer_state = load_training_checkpoint(
            self.model, path, self._optimizer_sharded_state_dict(is_loading=True), role=self.checkpoint_role
        )
        # megatron-core 0.16.1 dist-opt + torch Adam: 'step' KeyError, shared step (compat entries 2-3).
        with compat.skip_adam_step_on_param_state_load(self.optimizer):
            self.optimizer.load_state_dict(optimizer_state)
        state = meta["train_state"]
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self._version = int(meta["version"])
        self._num_steps = int(state["num_steps"])
        dist.barrier()

    def get_version(self) -> int:
        return self._version

    def snapshot_weights(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """A CPU copy of this rank's model weights, in ``dtype`` if given (``trainer.study_delay``
        keeps a few)."""
        return [p.detach().to("cpu", dtype=dtype or p.dtype, copy=True)
                for m in self.model.chunks for p in m.parameters()]

    def restore_weights(self, weights: list[torch.Tensor]) -> None:
        """Copy a ``snapshot_weights`` result back into this rank's model, in place."""
        params = [p for m in self.model.chunks for p in m.parameters()]
        if len(params) != len(weights):
            raise ValueError(f"restore_weights: {len(weights)} tensors for {len(params)} parameters")
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)

    def set_version(self, version: int) -> None:
        self._version = int(version)
