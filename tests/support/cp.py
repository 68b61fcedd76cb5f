"""Assertions shared by the context-parallel checks (tests/test_context_parallel.py, and the cheap
subset in tests/test_engine_sp.py): a CP layout's run equals its CP1 reference within bounds
derived from the computation (tests/support/numerics.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import DEFAULTS, count_params
from tests.support.numerics import adam_step_rel, fp32_tol, transformer_reductions

VOCAB = DEFAULTS["vocab_size"]  # the tiny models' (tests/dist/engine_sp.py)
FWD = transformer_reductions(DEFAULTS["num_hidden_layers"])
FWD_BWD = transformer_reductions(DEFAULTS["num_hidden_layers"], backward=True)
GRAD_REL_TOL = fp32_tol(VOCAB, 1.0, ops=FWD_BWD)
ADAM_EPS = 1e-5  # engine_sp.engine_cfg


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def maxdiff(a, b) -> float:
    return float((_t(a) - _t(b)).abs().max())


def lp_tol(ref) -> float:
    """Two fp32 evaluations of the same log-probs differing in reduction order only (the CP rank's
    attention sums its keys in the gathered order; RoPE per sequence instead of over the row):
    FWD chained reductions of up to K = VOCAB terms, relative to the largest |value|
    (tests/support/numerics.py; as tests/test_engine_sp.py)."""
    return fp32_tol(VOCAB, float(_t(ref).abs().max()), ops=FWD)


def after_tol(ref_after, ref_before, stats, num_params=None) -> float:
    """After one Adam step: the same-weights bound plus the share of the step's effect that the
    gradients' rounding can change (numerics.adam_step_rel)."""
    n = num_params or count_params()
    return lp_tol(ref_after) + maxdiff(ref_after, ref_before) * adam_step_rel(GRAD_REL_TOL, stats["grad_norm"], n, ADAM_EPS)


def assert_cp_equal(ref: dict, cp: dict, what: str, *, num_params=None) -> None:
    """A CP layout's run equals its CP1 reference: log-probs, entropy, loss, grad norm, every
    gradient (when recorded), and the policy after the step."""
    assert cp["cp"] == 2 and ref["cp"] == 1, what
    assert maxdiff(cp["logprobs"], ref["logprobs"]) <= lp_tol(ref["logprobs"]), what
    assert maxdiff(cp["entropy"], ref["entropy"]) <= lp_tol(ref["entropy"]), what
    s, r = cp["stats"], ref["stats"]
    assert s["n_tokens"] == r["n_tokens"], what  # token counts over CP: every loss token once, no pad
    assert s["num_microbatches"] == r["num_microbatches"] or cp["dp"] != ref["dp"], what
    # the loss: the same token mean from log-probs within lp_tol (|dL| <= mean|A ratio| dlp + c dH)
    l_tol = s["abs_ratio_term"] * lp_tol(ref["logprobs"]) + 0.01 * lp_tol(ref["entropy"]) + fp32_tol(int(r["n_tokens"]))
    assert abs(s["loss"] - r["loss"]) <= l_tol, what
    # a CP rank's tokens counted twice (or dropped) would move the norm by ~x sqrt(2) (measured 2.0x
    # before the engine undid megatron's x cp)
    assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=GRAD_REL_TOL), what
    if "grad_maxdiff" in cp:
        # every gradient element of every rank's shard (after clipping, which both share): a
        # forward-backward chain of FWD_BWD reductions relative to the largest element
        assert cp["grad_maxdiff"] <= fp32_tol(VOCAB, cp["grad_absmax"], ops=FWD_BWD), what
    a_t = after_tol(ref["after"], ref["logprobs"], r, num_params)
    assert maxdiff(cp["after"], ref["after"]) <= a_t, what
    assert maxdiff(cp["after"], cp["logprobs"]) > a_t, what  # the step moved the policy by more than that


