"""Numeric tolerances derived from the dtype and the size of the computation.

A tolerance here is never a difference measured on one CPU: bf16 and fp32 kernels round
differently on AVX2, AVX512 and AVX512-BF16/AMX machines (and on GPUs), so a measured value says
nothing about the next machine. Instead:

* a format with p significand bits rounds each result to a relative error of at most its unit
  roundoff u = 2^-p: bf16 2^-8 = 3.9e-3, fp16 and TF32 (GPU matmul inputs) 2^-11 = 4.9e-4,
  fp32 2^-24 = 6.0e-8, fp64 2^-53 = 1.1e-16;
* a K-term reduction (dot product, sum, softmax normaliser) rounds once per term; independent
  round-to-nearest errors add like a random walk, so it is off by about u * sqrt(K) times the
  magnitude of its terms (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
  sections 2.8 and 3.1; the worst case, u * K, needs every rounding to go the same way);
* a quantity produced by a chain of ``ops`` such reductions (layers, forward and backward)
  carries all of them: u * sqrt(ops * K) * magnitude;
* two computations of the same quantity that differ only in rounding (another TP/PP layout,
  micro-batch split, attention kernel, CPU) each carry that error: their difference is at most
  twice it.

``rounding_tol`` is that last bound. Each use names K, ops and the magnitude, and keeps the
assertion able to fail by stating (or asserting) the size of the effect it guards against.
Comparisons of quantities that are exact by construction (same kernels on the same inputs,
integer counts, powers of two) use ``==`` instead.
"""

from __future__ import annotations

import math

UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "tfloat32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def unit_roundoff(dtype) -> float:
    """u = 2^-p of ``dtype`` (a torch dtype or its name: "bfloat16", "float32", ...)."""
    name = str(dtype).removeprefix("torch.")
    try:
        return UNIT_ROUNDOFF[name]
    except KeyError:
        raise ValueError(f"no unit roundoff for dtype {dtype!r}; known: {sorted(UNIT_ROUNDOFF)}") from None


def rounding_tol(dtype, reduction_size: int = 1, magnitude: float = 1.0, *, ops: int = 1) -> float:
    """Bound on |a - b| for two evaluations of one quantity that differ only in rounding:
    2 (both sides) * u(dtype) * sqrt(ops * reduction_size) * magnitude, where ``magnitude`` is
    the size of the terms reduced (for a relative bound, 1.0)."""
    if reduction_size < 1 or ops < 1 or magnitude < 0:
        raise ValueError(f"rounding_tol: need reduction_size >= 1, ops >= 1, magnitude >= 0; "
                         f"got {reduction_size}, {ops}, {magnitude}")
    return 2.0 * unit_roundoff(dtype) * math.sqrt(ops * reduction_size) * float(magnitude)


def bf16_tol(reduction_size: int = 1, magnitude: float = 1.0, *, ops: int = 1) -> float:
    """``rounding_tol`` in bf16 (u = 2^-8 = 3.9e-3)."""
    return rounding_tol("bfloat16", reduction_size, magnitude, ops=ops)


def fp32_tol(reduction_size: int = 1, magnitude: float = 1.0, *, ops: int = 1) -> float:
    """``rounding_tol`` in fp32 (u = 2^-24 = 6.0e-8)."""
    return rounding_tol("float32", reduction_size, magnitude, ops=ops)


def fp64_tol(reduction_size: int = 1, magnitude: float = 1.0, *, ops: int = 1) -> float:
    """``rounding_tol`` in fp64 (u = 2^-53 = 1.1e-16)."""
    return rounding_tol("float64", reduction_size, magnitude, ops=ops)


def adam_step_rel(grad_rel: float, grad_norm: float, num_params: int, eps: float) -> float:
    """How much of an Adam step's effect two runs may disagree on when their gradients differ by
    ``grad_rel`` (relative, e.g. another layout's rounding): a quantity that the step moved by
    ``moved`` lands within ``moved * adam_step_rel(...)`` of the other run's.

    Adam's update lr * m/(sqrt(v) + eps) has derivative <= lr / eps in each gradient element, so
    while the gradients' rounding error is below eps -- rms error d = grad_rel * |g| / sqrt(N)
    for N parameters (fp32) -- the update (~lr per element: |g| >> eps for most) moves by at most
    d / eps of its size. Above eps (bf16 gradients) that bound is vacuous; there the update is, to
    first order, invariant to the gradient's scale, and a relative error grad_rel moves it by
    ~grad_rel of its size."""
    d = grad_rel * grad_norm / math.sqrt(num_params)
    return d / eps if d < eps else grad_rel


# The tiny transformers of these tests, counted for ``ops`` (per layer, forward):
REDUCTIONS_PER_LAYER = 6  # q/k/v projection, q.k scores, softmax . v, output projection, MLP gate/up, MLP down
WEIGHTED_MATMULS_PER_LAYER = 4  # the four of them that multiply by weights
ROW_PARALLEL_PER_LAYER = 2  # TP-split reductions: output projection and MLP down forward; q/k/v and gate/up input grads backward


def transformer_reductions(num_layers: int, *, backward: bool = False) -> int:
    """Reductions on the path from the weights to a token's log-prob: REDUCTIONS_PER_LAYER per
    layer, the LM head and the log-softmax normaliser; the backward pass runs the chain again."""
    forward = REDUCTIONS_PER_LAYER * num_layers + 2
    return 2 * forward if backward else forward


def printed_tol(decimals: int) -> float:
    """Half a unit of the last digit: a number written with ``decimals`` decimals (an expected
    value rounded by hand, or a value parsed from printed text) stands for anything within this."""
    return 0.5 * 10.0**-decimals
