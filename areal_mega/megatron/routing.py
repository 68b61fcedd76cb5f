"""MoE routing replay, learner side: record the experts each token was routed to, or force them.

    model = build_model(hf, groups, MegatronModelConfig(moe_routing_replay=True))
    with record_routes(model) as routes:        # routes.layers: [this rank's MoE layers][T_local, k]
        forward_logits(model, ids, cu)
    with replay_routes(model, routes.layers):   # the router's top-k is replaced by these experts;
        forward_logits(model, ids, cu)          # the gate values still come from this model's router

Why: the policy that generated a rollout (the SGLang server's weights, kernels) and the learner
can route a token to different experts -- a discrete jump in the learner's log-prob of that token.
Replaying the server's routes evaluates (and trains) the learner on the routes that produced the
data. The server side (SGLang's ``enable_return_routed_experts``, per-token expert ids in the
response's meta_info) is not wired: docs/engine.md says what it needs.

Built on megatron-core 0.16.1's own router replay (``moe_enable_routing_replay``: every router
gets a ``RouterReplay`` whose action is RECORD / REPLAY_FORWARD / REPLAY_BACKWARD, consulted in
``topk_routing_with_score_function``). Megatron keeps a process-wide list of them; this module
addresses only the routers of the model passed in (``chunk.modules()``, in layer order), so a
reference model or critic in the same process is never touched.

Token order: what the router of each MoE layer sees on this rank -- the packed row in order
(TP1), or this rank's sequence shard under sequence parallelism. Each layer's indices are
[tokens, k] int64.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from areal_mega.models.base import unwrap


def _replays(model) -> list:

    out = []
    for chunk in model.chunks:
        for mod in unwrap(chunk).modules():
            r = getattr(mod, "router_replay", None)
            if r is not None:
                out.append(r)
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
