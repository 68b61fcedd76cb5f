"""MoE routing replay, the pure pieces (docs/routing_replay.md): routes across the calls of one
trajectory, through the batch, into one rank's router layout, and the per-step metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_mega.api.io import GenerationResult
from areal_mega.megatron.routing import BatchReplay, replay_metrics
from areal_mega.rollout.batch import split_minibatches, to_engine_alignment, trajectories_to_batch
from areal_mega.workflows.base import TrajectoryBuilder

W = 4  # 2 layers x top-2


def _result(inp: list[int], out: list[int], mark: int) -> GenerationResult:
    rows = len(inp) + len(out) - 1
    return GenerationResult(inp, out, [-0.5] * len(out), [0] * len(out), "stop",
                            routes=np.full((rows, W), mark, dtype=np.int16))


def test_two_calls_a_row_comes_from_the_call_that_first_fed_it():
    b = TrajectoryBuilder([1, 2, 3])
    b.add_generated(_result([1, 2, 3], [4, 5, 6, 7], mark=1))       # feeds tokens 0..5
    b.add_env([8, 9])
    b.add_generated(_result(b.input_ids, [10, 11, 12], mark=2))     # feeds 0..10; 6..10 are new
    t = b.build(1.0, "g", {})
    assert t.routes.shape == (12, W)
    assert t.routes[:6, 0].tolist() == [1] * 6 and t.routes[6:11, 0].tolist() == [2] * 5
    assert t.routes[11].tolist() == [-1] * W  # the last sampled token was never fed
    # a truncated call (keep) contributes rows only for what is kept
    b2 = TrajectoryBuilder([1, 2])
    b2.add_generated(_result([1, 2], [3, 4, 5], mark=3), keep=2)
    assert b2.build(0.0, "g", {}).routes[:, 0].tolist() == [3, 3, 3, -1]


def test_batch_carries_routes_unshifted_and_splits_them():
    trajs = []
    for gid, n in (("a", 3), ("a", 5), ("b", 4)):
        b = TrajectoryBuilder([7] * 2)
        b.add_generated(_result([7] * 2, list(range(n)), mark=n))
        trajs.append(b.build(0.0, gid, {}))
    batch = to_engine_alignment(trajectories_to_batch(trajs))
    r = batch["routed_experts"]
    assert r.shape == (5 + 7 + 6, W) and r.dtype == torch.int16
    assert r[:4, 0].tolist() == [3] * 4 and r[4, 0] == -1  # "this-token": not shifted like loss_mask
    first, second = split_minibatches(batch, 2)
    assert torch.equal(torch.cat([first["routed_experts"], second["routed_experts"]]), r)
    trajs[1].routes = None
    with pytest.raises(ValueError, match="^routed_experts: some trajectories carry MoE routes and some do not"):
        trajectories_to_batch(trajs)


def test_batch_replay_pads_shards_and_fills_missing_rows():
    routes = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0], [-1, -1, -1, -1]], dtype=torch.int16)
    one = BatchReplay(num_layers=2, top_k=2, tp_rank=0, tp_size=1, sequence_parallel=False)
    r = one.routes_for(routes, padded_len=3)
    assert r.shape == (3, 2, 2) and r[0].tolist() == [[1, 2], [3, 4]] and r[2].tolist() == [[0, 1], [0, 1]]
    # SP over 2 ranks: the row padded to 4 (pad rows -> experts 0..k-1), rank 1 sees rows 2..3
    sp1 = BatchReplay(num_layers=2, top_k=2, tp_rank=1, tp_size=2, sequence_parallel=True)
    r = sp1.routes_for(routes, padded_len=4)
    assert r.shape == (2, 2, 2) and r.tolist() == [[[0, 1], [0, 1]]] * 2
    sp0 = BatchReplay(num_layers=2, top_k=2, tp_rank=0, tp_size=2, sequence_parallel=True)
    assert sp0.routes_for(routes, padded_len=4)[1].tolist() == [[5, 6], [7, 0]]
    with pytest.raises(ValueError, match="routes carry 4 expert ids per token; the learner's model routes 3 layers"):
        BatchReplay(num_layers=3, top_k=2, tp_rank=0, tp_size=1, sequence_parallel=False).routes_for(routes, 3)


def test_replay_metrics_by_hand():
    batch = {
        "loss_mask": torch.tensor([0, 1, 1, 1]),
        "versions": torch.tensor([-1, 3, 3, 2]),  # the last token is stale: not a mismatch sample
        "logprobs": torch.tensor([0.0, -1.0, -2.0, -3.0]),
        "routed_experts": torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1]]),
    }
    prox = torch.tensor([0.0, -1.5, -2.25, -9.0])
    natural = torch.tensor([[0, 1, 2, 3], [0, 1, 3, 4], [4, 5, 6, 7], [0, 1, 0, 1]])
    m = replay_metrics(batch, prox, natural, version=3, num_layers=2)
    assert m["routing/mismatch_max"] == pytest.approx(0.5) and m["routing/mismatch_mean"] == pytest.approx(0.375)
    assert m["routing/mismatch_tokens"] == 2
    # routed rows 0..2 (row 3 is -1): 6 (token, layer) cells, one differs (row 1, layer 1);
    # order within a cell does not matter (row 1, layer 0 is {0, 1} on both sides)
    assert m["routing/disagreement"] == pytest.approx(1 / 6)


def test_observe_mode_measures_server_routes_and_never_trains_on_them():
    """The engine's proximal_logprobs under "observe": the proximal forward routes freely (no routes
    in its batch), a second forward gets the servers' routes (the counterfactual replayed mismatch),
    and the batch left for the training forward carries no routes; "rollout" replays in one forward."""
    from types import SimpleNamespace

    from areal_mega.megatron.engine import MegatronTrainEngine

    server = torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3], [4, 5, 6, 7]])
    behav = torch.tensor([0.0, -1.0, -2.0])

    class Actor:
        model = SimpleNamespace(arch=SimpleNamespace(num_layers=2))
        seen: list = []

        def get_version(self):
            return 3

        def forward(self, batch, temperature, with_entropy):
            replayed = "routed_experts" in batch
            self.seen.append(replayed)
            lp = behav - (0.0 if replayed else 0.5) * batch["loss_mask"]  # replay closes the gap here
            return {"logprobs": lp, "routes": torch.tensor([[0, 1, 2, 3], [0, 1, 3, 4], [4, 5, 6, 7]])}

    def run(mode):
        actor = Actor()
        actor.cfg = SimpleNamespace(model=SimpleNamespace(moe_routing_replay=mode))
        Actor.seen = []
        batch = {"loss_mask": torch.tensor([0, 1, 1]), "versions": torch.tensor([-1, 3, 3]), "logprobs": behav,
                 "routed_experts": server.clone()}
        return MegatronTrainEngine.proximal_logprobs(actor, batch, 1.0), batch, list(Actor.seen)

    m, batch, seen = run("observe")
    assert seen == [False, True] and "routed_experts" not in batch
    assert torch.equal(batch["prox_logprobs"], behav - 0.5 * torch.tensor([0, 1, 1]))  # the free-routing forward's
    assert m["routing/mismatch_mean"] == pytest.approx(0.5) and m["routing/mismatch_if_replayed_max"] == 0.0
    assert m["routing/disagreement"] == pytest.approx(1 / 6)
    m, batch, seen = run("rollout")
    assert seen == [True] and torch.equal(batch["routed_experts"], server)
    assert m["routing/mismatch_max"] == 0.0 and not any("if_replayed" in k for k in m)
