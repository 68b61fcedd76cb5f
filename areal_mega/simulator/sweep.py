"""Cost models identified from measurements: short sweeps and their least-squares fits.

    decode_sweep(url, ...)  -> [DecodePoint]   n concurrent /generate requests against a real server
    fit_decode_sweep(points) -> DecodeFit      wall(n, L, P) = a + n * (r + p * P) + L * (t0 + t1 * n)
    fit_learner_points(xs, ys) -> LearnerModel step(tokens) = fixed + per_token * tokens
    fit_sync_points(bytes, s) -> SyncModel     sync(bytes) = latency + bytes / bandwidth

The decode form is the simulator's (``DecodeModel``): an iteration of n sequences costs
``t0 + n * t1`` (weights read once, plus each sequence's work), so ``peak = 1 / t1`` and
``half_batch = t0 / t1``. On top of it every request costs the server ``r + p * P`` seconds
(HTTP, tokenisation, scheduling, prefill of a P-token prompt) during which nothing decodes
(``DecodeModel.request_server_s``), and each batch a fixed ``a`` (the client's round trip). With
several concurrency levels and two lengths the five numbers are identifiable; one level is not
(``fit_decode_sweep`` refuses it). Pure Python: the planner's dry run can call it where a server
is reachable. Measurements and their dates: docs/simulator.md.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from areal_mega.simulator.model import DecodeModel, LearnerModel, SimulationError, SyncModel


@dataclass
class DecodePoint:
    concurrency: int
    """Requests sent at once (each its own HTTP request, as the rollout client sends them)."""
    new_tokens: int
    """Generated tokens per request (ignore_eos: exactly this many)."""
    prompt_tokens: int
    seconds: float
    """Wall time from the first send to the last answer."""

    @property
    def tokens_per_s(self) -> float:
        return self.concurrency * self.new_tokens / self.seconds


@dataclass
class DecodeFit:
    batch_s: float
    """a: fixed cost per batch of requests (client round trip), seconds."""
    request_s: float
    """r: server time per request at a zero-length prompt, seconds."""
    prompt_token_s: float
    """p: server time per prompt token (prefill), seconds."""
    iter_fixed_s: float
    """t0: decode iteration cost independent of the batch, seconds."""
    iter_per_seq_s: float
    """t1: decode iteration cost per running sequence, seconds."""
    rms_rel_error: float = 0.0
    """Root mean square of (fitted - measured) / measured over the points."""
    max_rel_error: float = 0.0
    points: list[DecodePoint] = field(default_factory=list)

    def predict(self, n: int, new_tokens: int, prompt_tokens: int) -> float:
        return (self.batch_s + n * (self.request_s + self.prompt_token_s * prompt_tokens)
                + new_tokens * (self.iter_fixed_s + self.iter_per_seq_s * n))

    def decode_model(self, *, prompt_tokens: int, kv_capacity_tokens: int = 0, max_running: int = 0) -> DecodeModel:
        """The simulator's decode model at the workload's prompt length."""
        return DecodeModel(peak_tokens_per_s=1.0 / self.iter_per_seq_s, half_batch=self.iter_fixed_s / self.iter_per_seq_s,
                           kv_capacity_tokens=kv_capacity_tokens, max_running=max_running,
                           request_latency_s=self.batch_s,
                           request_server_s=self.request_s + self.prompt_token_s * prompt_tokens)

    @classmethod
    def load(cls, path: str | Path) -> "DecodeFit":
        """A sweep written by ``--out`` (``summary()``); SimulationError names the file and the problem."""
        try:
            d = json.loads(Path(path).read_text())
            return cls(**{k: float(d[k]) for k in ("batch_s", "request_s", "prompt_token_s", "iter_fixed_s", "iter_per_seq_s")},
                       rms_rel_error=float(d.get("rms_rel_error", 0.0)), max_rel_error=float(d.get("max_rel_error", 0.0)),
                       points=[DecodePoint(*q) for q in d.get("points", [])])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SimulationError(f"decode sweep {path}: not a sweep written by python -m areal_mega.simulator.sweep "
                                  f"--out ({type(e).__name__}: {e})") from None

    def summary(self) -> dict:
        r = lambda x: float(f"{x:.6g}")  # noqa: E731
        return {"batch_s": r(self.batch_s), "request_s": r(self.request_s), "prompt_token_s": r(self.prompt_token_s),
                "iter_fixed_s": r(self.iter_fixed_s), "iter_per_seq_s": r(self.iter_per_seq_s),
                "peak_tokens_per_s": r(1 / self.iter_per_seq_s), "half_batch": r(self.iter_fixed_s / self.iter_per_seq_s),
                "rms_rel_error": r(self.rms_rel_error), "max_rel_error": r(self.max_rel_error),
                "points": [[p.concurrency, p.new_tokens, p.prompt_tokens, r(p.seconds)] for p in self.points]}


# ---- least squares (pure Python: normal equations, Gauss-Jordan with partial pivoting) -------------


def _lstsq(rows: list[list[float]], ys: list[float], weights: list[float]) -> list[float]:
    k = len(rows[0])
    ata = [[0.0] * k for _ in range(k)]
    aty = [0.0] * k
    for row, y, w in zip(rows, ys, weights):
        for i in range(k):
            aty[i] += w * row[i] * y
            for j in range(k):
                ata[i][j] += w * row[i] * row[j]
    # Scale columns so the pivots are comparable (seconds per token vs seconds per batch).
    scale = [max(ata[i][i], 1e-300) ** 0.5 for i in range(k)]
    m = [[ata[i][j] / (scale[i] * scale[j]) for j in range(k)] + [aty[i] / scale[i]] for i in range(k)]
    for c in range(k):
        piv = max(range(c, k), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-9:
            raise SimulationError("fit: the measurements do not identify every parameter "
                                  "(vary concurrency, length and prompt length)")
        m[c], m[piv] = m[piv], m[c]
        for r in range(k):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [a - f * b for a, b in zip(m[r], m[c])]
    return [m[i][k] / m[i][i] / scale[i] for i in range(k)]


def _nonneg_lstsq(rows: list[list[float]], ys: list[float], weights: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (active set by elimination: a negative
    coefficient is fixed at 0 and the rest refitted; costs cannot be negative)."""
    k = len(rows[0])
    free = list(range(k))
    while True:
        sol = _lstsq([[r[i] for i in free] for r in rows], ys, weights)
        neg = [free[j] for j, v in enumerate(sol) if v < 0]
        if not neg:
            out = [0.0] * k
            for j, i in enumerate(free):
                out[i] = sol[j]
            return out
        worst = min(neg, key=lambda i: sol[free.index(i)])
        free.remove(worst)
        if not free:
            return [0.0] * k


def fit_decode_sweep(points: list[DecodePoint]) -> DecodeFit:
    """Fit ``wall = a + n (r + p P) + L (t0 + t1 n)`` to the sweep (relative least squares: every
    point weighs by its own size, so the small batches count as much as the large)."""
    if len({p.concurrency for p in points}) < 3 or len({p.new_tokens for p in points}) < 2:
        raise SimulationError("decode sweep: need >= 3 concurrency levels and >= 2 lengths to identify "
                              "peak and half_batch (one concurrency level cannot separate them)")
    vary_p = len({p.prompt_tokens for p in points}) >= 2
    rows = [[1.0, p.concurrency, p.concurrency * p.prompt_tokens if vary_p else 0.0, p.new_tokens,
             p.new_tokens * p.concurrency] for p in points]
    if not vary_p:
        rows = [[r[0], r[1], r[3], r[4]] for r in rows]
    ys = [p.seconds for p in points]
    w = [1.0 / max(y, 1e-9) ** 2 for y in ys]
    sol = _nonneg_lstsq(rows, ys, w)
    if not vary_p:
        sol = [sol[0], sol[1], 0.0, sol[2], sol[3]]
    a, r, pp, t0, t1 = sol
    if not t1 > 0:
        raise SimulationError("decode sweep: the fitted per-sequence iteration cost is 0 (throughput never "
                              "saturates in the swept range: sweep larger concurrency)")
    fit = DecodeFit(a, r, pp, t0, t1, points=list(points))
    errs = [(fit.predict(p.concurrency, p.new_tokens, p.prompt_tokens) - p.seconds) / p.seconds for p in points]
    fit.rms_rel_error = (sum(e * e for e in errs) / len(errs)) ** 0.5
    fit.max_rel_error = max(abs(e) for e in errs)
    return fit


def fit_learner_points(tokens: list[float], seconds: list[float]) -> LearnerModel:
    """``fixed + per_token * tokens`` by least squares over (tokens per step, learner seconds);
    a constant when the token counts barely vary (the slope is then not identified)."""
    if not tokens or len(tokens) != len(seconds):
        raise SimulationError("learner fit: need as many step times as token counts (>= 1)")
    mx = statistics.fmean(tokens)
    if mx > 0 and statistics.pstdev(tokens) / mx > 0.05:
        a, b = _nonneg_lstsq([[1.0, x] for x in tokens], list(seconds), [1.0] * len(tokens))
        return LearnerModel(fixed_s=a, per_token_s=b)
    return LearnerModel(fixed_s=statistics.fmean(seconds), per_token_s=0.0)


def fit_learner_curve(runs: list[tuple[float, float]], *, merge: float = 0.05) -> LearnerModel:
    """The learner's step through measured runs' (mean tokens per step, mean seconds): the curve
    through them (``LearnerModel.points``) when they span >= 2 token counts (runs within ``merge``
    of each other averaged into one point), else their mean as a constant. Unlike the affine
    least squares of ``fit_learner_points`` it reproduces every run it was given."""
    if not runs:
        raise SimulationError("learner fit: need >= 1 run")
    pts: list[list[float]] = []  # [tokens sum, seconds sum, count]
    for x, y in sorted(runs):
        if pts and x <= (pts[-1][0] / pts[-1][2]) * (1 + merge):
            pts[-1][0] += x
            pts[-1][1] += y
            pts[-1][2] += 1
        else:
            pts.append([x, y, 1])
    means = tuple((tx / n, ty / n) for tx, ty, n in pts)
    if len(means) < 2:
        return LearnerModel(fixed_s=means[0][1], per_token_s=0.0)
    return LearnerModel(fixed_s=0.0, per_token_s=0.0, points=means)


def fit_sync_points(nbytes: list[float], seconds: list[float]) -> SyncModel:
    """``latency + bytes / bandwidth`` over weight syncs of several sizes (>= 2 sizes)."""
    if len(set(nbytes)) < 2:
        raise SimulationError("weight-sync fit: need syncs of >= 2 sizes to separate latency from bandwidth")
    lat, per_byte = _nonneg_lstsq([[1.0, b] for b in nbytes], list(seconds), [1.0 / s ** 2 for s in seconds])
    if not per_byte > 0:
        raise SimulationError("weight-sync fit: time does not grow with the bytes")
    return SyncModel(weight_bytes=0.0, bandwidth_bytes_per_s=1.0 / per_byte, latency_s=lat)


# ---- the measurement ---------------------------------------------------------------------------------


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def measure_batch(url: str, n: int, new_tokens: int, prompt_tokens: int, *, vocab: int, seed: int,
                  timeout_s: float = 600.0) -> DecodePoint:
    """``n`` concurrent /generate requests of ``prompt_tokens`` random ids, ``new_tokens`` each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(max(1, prompt_tokens))] for _ in range(n)]
    errors: list[BaseException] = []
    got = [0] * n

    def one(i: int) -> None:
        try:
            out = _post(url + "/generate", {"input_ids": prompts[i], "sampling_params": {
                "max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}}, timeout_s)
            got[i] = int((out.get("meta_info") or {}).get("completion_tokens", new_tokens))
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise SimulationError(f"decode sweep: /generate failed at concurrency {n}: {errors[0]}")
    if any(g != new_tokens for g in got):
        raise SimulationError(f"decode sweep: asked for {new_tokens} tokens, got {sorted(set(got))}")
    return DecodePoint(n, new_tokens, prompt_tokens, dt)


def decode_sweep(url: str, *, concurrencies: tuple[int, ...] = (1, 4, 8, 16, 32, 64), lengths: tuple[int, ...] = (8, 32),
                 prompts: tuple[int, ...] = (9, 48), vocab: int = 128, repeats: int = 2) -> list[DecodePoint]:
    """Measure every (concurrency, length, prompt) ``repeats`` times, interleaved, keeping each
    one's fastest (other load on a shared machine only ever slows a measurement down)."""
    grid = [(n, L, P) for P in prompts for L in lengths for n in concurrencies]
    measure_batch(url, 2, 2, prompts[0], vocab=vocab, seed=0)  # warm-up (first request compiles paths)
    best: dict[tuple[int, int, int], DecodePoint] = {}
    for rep in range(repeats):
        for i, (n, L, P) in enumerate(grid):
            pt = measure_batch(url, n, L, P, vocab=vocab, seed=1000 * rep + i)
            if (n, L, P) not in best or pt.seconds < best[(n, L, P)].seconds:
                best[(n, L, P)] = pt
    return [best[k] for k in grid]


def main(argv: list[str] | None = None) -> int:
    """``python -m areal_mega.simulator.sweep --url http://HOST:PORT [--out F.json] [--png F.png]``:
    the decode sweep against a running server (before a job), its fit as one JSON line."""
    import argparse
    import sys
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m areal_mega.simulator.sweep", description=main.__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="an SGLang server serving the run's model")
    p.add_argument("--vocab", type=int, default=128, help="prompt ids are drawn from [3, vocab)")
    p.add_argument("--concurrency", default="1,4,8,16,32,64")
    p.add_argument("--lengths", default="8,32")
    p.add_argument("--prompts", default="9,48")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help="write the fit (with its points) as JSON here")
    p.add_argument("--png", help="plot the measurements and the fitted curve here")
    args = p.parse_args(argv)
    try:
        ints = lambda s, k: tuple(int(x) for x in s.split(",") if x.strip())  # noqa: E731
        pts = decode_sweep(args.url.rstrip("/"), concurrencies=ints(args.concurrency, "concurrency"),
                           lengths=ints(args.lengths, "lengths"), prompts=ints(args.prompts, "prompts"),
                           vocab=args.vocab, repeats=args.repeats)
        fit = fit_decode_sweep(pts)
    except (ValueError, OSError) as e:  # SimulationError is a ValueError
        print(f"sweep: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    line = json.dumps(fit.summary())
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    if args.png:
        from areal_mega.simulator.plot import plot_decode_sweep

        png, why = plot_decode_sweep(fit, args.png)
        print(f"sweep: plot {png}" if png else f"sweep: no plot: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
