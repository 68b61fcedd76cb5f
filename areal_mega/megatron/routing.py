"""MoE routing replay, learner side: record the experts each token was routed to, or force them.

    model = build_model(hf, groups, MegatronModelConfig(moe_routing_replay=True))
    with record_routes(model) as routes:        # routes.layers: [this rank's MoE layers][T_local, k]
        forward_logits(model, ids, cu)
    with replay_routes(model, routes.layers):   # the router's top-k is replaced by these experts;
        forward_logits(model, ids, cu)          # the gate values still come from this model's router

Only the routers of the model passed in are touched. Why, dataflow, conventions: docs/routing_replay.md.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Iterator

import torch
from areal_mega.models.base import unwrap


def _replays(model) -> list:
    out = [router.router_replay for _, router in routers_of(model.chunks) if router.router_replay is not None]
    if not out and model.arch.is_moe:
        raise ValueError("actor.model.moe_routing_replay: the model was built without routing replay")
    return out


@dataclass
class Routes:
    layers: list[torch.Tensor] = field(default_factory=list)
    """Per MoE layer of this rank (chunk order, then layer order): expert ids [tokens, k]."""


@contextlib.contextmanager
def record_routes(model) -> Iterator[Routes]:
    """Record the experts every MoE layer of ``model`` chose in the forwards run inside."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    reps = _replays(model)
    routes = Routes()
    for r in reps:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield routes
        routes.layers = [r.get_recorded_indices().detach().clone() for r in reps]
    finally:
        for r in reps:
            r.clear_router_replay_action()
            r.clear_indices()


@contextlib.contextmanager
def replay_routes(model, layers: list[torch.Tensor]) -> Iterator[None]:
    """Forwards inside route every token of every MoE layer to ``layers[i]`` (as recorded by
    :func:`record_routes`, or converted from a server's routes); gate values are this model's
    router probabilities at those experts (renormalised as configured)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    reps = _replays(model)
    if len(layers) != len(reps):
        raise ValueError(f"routes: {len(layers)} layers given, this rank's model has {len(reps)} MoE layers")
    for r, idx in zip(reps, layers):
        r.clear_indices()
        r.set_target_indices(idx)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in reps:
            r.clear_router_replay_action()
            r.clear_indices()


def route_disagreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Fraction of (token, layer) pairs whose SET of top-k experts differs between two routings
    (the metric for how often learner and server routes disagree when replay is off)."""
    if len(a) != len(b):
        raise ValueError(f"routes: {len(a)} vs {len(b)} layers")
    diff = total = 0
    for x, y in zip(a, b):
        xs, ys = x.sort(dim=-1).values, y.sort(dim=-1).values
        diff += int((xs != ys).any(dim=-1).sum())
        total += xs.shape[0]
    return diff / max(total, 1)


# -- replay of a packed batch's routes inside the engine --------------------------------------------

@functools.cache
def observed_replay_class():
    """megatron's ``RouterReplay`` that, while replaying, also keeps the experts the router itself
    would have chosen (``natural``, one [tokens, k] per forward): the learner-vs-server
    disagreement metric needs both from ONE forward. Built once, on first use (megatron is
    imported lazily)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class ObservedReplay(RouterReplay):
        def __init__(self) -> None:
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # ours, not megatron's global list
            self.natural: list[torch.Tensor] = []

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            action = self.router_replay_action
            if action == RouterReplayAction.REPLAY_FORWARD:
                _, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self.natural.append(idx.detach())
            out = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if action == RouterReplayAction.RECORD:
                self.natural.append(out[1].detach())
            return out

    return ObservedReplay


def install_observed_replay(chunks) -> None:
    """Give every router of ``chunks`` an ObservedReplay (build time, replay on)."""
    cls = observed_replay_class()
    for _, router in routers_of(chunks):
        router.router_replay = cls()


def routers_of(chunks) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer number, router) of every MoE layer in ``chunks``, in forward order."""
    out = []
    for chunk in chunks:
        for mod in unwrap(chunk).modules():
            mlp = getattr(mod, "mlp", None)
            if hasattr(mod, "layer_number") and mlp is not None and hasattr(mlp, "router"):
                out.append((int(mod.layer_number) - 1, mlp.router))
    return out


@dataclass
class BatchReplay:
    """Replays ``routed_experts`` of packed micro-batches in the engine's token layout.

    ``routed_experts`` [T, layers * top_k] is in batch token order ("this-token": row i = the
    router input of token i). Per micro-batch this selects the chunk's layers, pads the row to
    the length the model runs at (SP padding, VPP's fixed shape) and keeps this rank's sequence
    shard under SP -- the tokens this rank's routers see. -1 rows (tokens no server fed) and pad
    rows get experts 0..k-1: only outputs the loss never reads depend on them (causal attention,
    no expert capacity, so no cross-token effect)."""

    num_layers: int
    top_k: int
    tp_rank: int
    tp_size: int
    sequence_parallel: bool

    def routes_for(self, routes: torch.Tensor, padded_len: int) -> torch.Tensor:
        """[T, L*k] int -> [rows this rank's routers see, L, k] int64."""
        T, width = routes.shape
        if width != self.num_layers * self.top_k:
            raise ValueError(
                f"actor.model.moe_routing_replay: the servers' routes carry {width} expert ids per token; "
                f"the learner's model routes {self.num_layers} layers x top-{self.top_k} = "
                f"{self.num_layers * self.top_k} (same model and num_experts_per_tok on both sides?)")
        r = routes.to(torch.int64).view(T, self.num_layers, self.top_k)
        filler = torch.arange(self.top_k, dtype=torch.int64).expand(self.num_layers, self.top_k)
        r = torch.where((r < 0).any(dim=-1, keepdim=True), filler, r)
        if padded_len > T:
            r = torch.cat([r, filler.expand(padded_len - T, -1, -1)])
        if self.sequence_parallel and self.tp_size > 1:
            n = padded_len // self.tp_size
            r = r[self.tp_rank * n:(self.tp_rank + 1) * n]
        return r

    def set_targets(self, chunk, routes: torch.Tensor, padded_len: int) -> None:
        """Before a forward of ``chunk`` over one micro-batch: its routers replay ``routes``."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        r = self.routes_for(routes, padded_len)
        for layer, router in routers_of([chunk]):
            rep = router.router_replay
            rep.target_topk_idx = r[:, layer].contiguous()
            rep.replay_backward_list = []  # recompute under replay is refused (no REPLAY_BACKWARD)
            rep.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    @staticmethod
    def observe(chunk) -> None:
        """Before a forward of ``chunk`` without routes: plain routing, natural top-k recorded."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, router in routers_of([chunk]):
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    @staticmethod
    def reset(chunks) -> None:
        for _, router in routers_of(chunks):
            rep = router.router_replay
            rep.clear_router_replay_action()
            rep.clear_indices()
            rep.natural = []

    def natural_rows(self, chunks, row_tokens: list[torch.Tensor], total: int) -> torch.Tensor:
        """The experts the routers chose themselves in the forwards since :meth:`reset`, scattered
        into batch token order: int32 [total, layers, top_k], zeros where this rank did not route
        (other stages' layers, other DP ranks' sequences, other CP ranks' chunks, other SP shards;
        and all of them on TP ranks > 0 without SP, whose tokens rank 0 already holds). Summing
        over every rank gives each (token, layer) exactly once. ``row_tokens[i]``: the batch token
        of every position of micro-batch i's row as this rank ran it, -1 at pads."""
        out = torch.zeros(total, self.num_layers, self.top_k, dtype=torch.int32)
        if not self.sequence_parallel and self.tp_rank > 0:
            return out
        for layer, router in routers_of(chunks):
            nat = router.router_replay.natural
            assert len(nat) == len(row_tokens), (len(nat), len(row_tokens))
            for tok, idx in zip(row_tokens, nat):
                # under SP every rank routes an equal shard of the row: rank r's starts at r * len
                start = self.tp_rank * idx.shape[0] if self.sequence_parallel and self.tp_size > 1 else 0
                t = tok[start:start + idx.shape[0]]
                keep = t >= 0
                out[t[keep], layer] = idx[:t.numel()][keep].to(torch.int32).cpu()
        return out


def replay_metrics(batch: dict[str, torch.Tensor], prox_logprobs: torch.Tensor, natural: torch.Tensor | None,
                   version: int, num_layers: int) -> dict[str, float]:
    """Per-step train/inference mismatch metrics (docs/routing_replay.md), with replay on or off:

    * ``routing/disagreement``: fraction of (token, layer) pairs whose expert SET differs between
      the server (the batch's ``routed_experts``) and the learner's own router in the proximal
      forward (``natural``), over tokens the server routed;
    * ``routing/mismatch_{mean,p99,max}``: |behaviour - proximal log-prob| over trained tokens
      sampled by the current ``version`` -- on-policy tokens, so the gap is the train/inference
      mismatch alone, not staleness (engine alignment: ``versions`` are next-token shifted)."""
    out: dict[str, float] = {}
    on_policy = (batch["loss_mask"] > 0) & (batch["versions"] == version)
    if on_policy.any():
        d = (batch["logprobs"] - prox_logprobs).abs()[on_policy].double()
        out.update({"routing/mismatch_mean": float(d.mean()), "routing/mismatch_p99": float(torch.quantile(d, 0.99)),
                    "routing/mismatch_max": float(d.max()), "routing/mismatch_tokens": float(d.numel())})
    server = batch.get("routed_experts")
    if server is not None and natural is not None:
        routed = (server >= 0).all(dim=-1)
        if routed.any():
            # (token, layer) cells of top_k ids: the width is layers * top_k on both sides (checked at replay)
            a = server[routed].long().view(-1, num_layers, server.shape[1] // num_layers)
            b = natural[routed].long().view(-1, num_layers, server.shape[1] // num_layers)
            out["routing/disagreement"] = route_disagreement([a[:, i] for i in range(num_layers)],
                                                             [b[:, i] for i in range(num_layers)])
    return out

