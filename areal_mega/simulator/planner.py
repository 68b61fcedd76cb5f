"""The throughput planner behind ``areal-mega plan`` (its command line: launcher/cli.py): choose
the inference/learner node split and max_staleness by simulation, for a typed experiment.

For every split (``k`` learner nodes, ``nodes - k`` engine nodes) the learner layout keeps the
config's tensor (and context) parallel size and tries every pipeline size up to 16 that divides
the layers and the learner GPUs (data parallel = what is left);
a layout is admissible only if the launcher's own memory estimate says it fits
(``simulator.memory.estimate_learner``, the check ``--dry-run`` enforces), and the
engines must fit too (``estimate_engine``, whose KV-cache size becomes the servers' capacity).
Among admissible layouts the one with the shortest modelled learner step is kept. Each
(split, max_staleness) is then simulated (``areal_mega.simulator.sim``) with cost models
derived from :class:`~areal_mega.simulator.costs.ClusterCostModel` and the workload from
:class:`~areal_mega.simulator.costs.WorkloadModel`; the best predicted samples/s wins, and
its speedup is reported against the best synchronous (max_staleness 0) configuration.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from areal_mega.parallel import ParallelLayout
from areal_mega.simulator.costs import (
    COST_SOURCES, WORKLOAD_SOURCES, ClusterCostModel, WorkloadModel, cost_sources, decode_model,
    learner_flops_per_token, learner_model, sync_model,
)
from areal_mega.simulator.memory import (
    GIB, count_params, estimate_engine, estimate_learner, learner_settings, lora_layer_params, model_adapter, model_arch,
    server_nodes, total_params,
)
from areal_mega.simulator.model import PLAN_TOLERANCE, SimConfig, SimulationError, near_best
from areal_mega.simulator.sim import simulate
from areal_mega.simulator.plot import plot_plan

if TYPE_CHECKING:
    from areal_mega.experiment import ExperimentConfig
    from areal_mega.models.base import ModelArch

__all__ = ["PlanReport", "SplitResult", "choose_learner_nodes", "describe", "learner_memory", "recommendation", "sensitivity",
           "sweep", "write_plan"]

MAX_PP = 16


@dataclass
class SplitResult:
    learner_nodes: int
    engine_nodes: int
    num_servers: int
    layout: str = ""
    learner_gib: float = 0.0
    learner_step_s: float = 0.0
    """Modelled learner step at the mean batch size (excluding weight sync)."""
    sync_s: float = 0.0
    reason: str = ""
    """Why the split is not admissible ("" = admissible)."""
    over_memory_gib: float = 0.0
    """Not admissible but a valid layout: the smallest per-GPU estimate over its layouts (> the GPU)."""
    by_staleness: dict[int, dict] = field(default_factory=dict)
    """max_staleness -> SimResult.summary()."""


@dataclass
class PlanReport:
    config: str
    nodes: int
    gpus_per_node: int
    gpus_per_node_source: str
    model_params: float
    engine_tp: int
    engine_kv_tokens: int
    batch_size: int
    group_size: int
    max_new_tokens: int
    staleness: tuple[int, ...]
    splits: list[SplitResult]
    cost: ClusterCostModel
    workload: WorkloadModel
    configured: tuple[int, int] | None
    """(learner nodes, max_staleness) the config itself asks for, when set."""
    tolerance: float = PLAN_TOLERANCE
    """Recommend the smallest max_staleness within this fraction of the best throughput."""
    margin: float = 0.10
    """``launch.planner.margin``: the configured split is flagged when predicted this fraction
    below the recommendation (:meth:`configured_shortfall`)."""
    sensitivity: list[dict] = field(default_factory=list)
    """The recommendation with each assumed cost figure scaled (:func:`sensitivity`); [] = not computed."""

    def feasible(self) -> list[SplitResult]:
        return [s for s in self.splits if not s.reason]

    def best(self, staleness: int | None = None) -> tuple[SplitResult, int] | None:
        """The recommended (split, max_staleness): among the configurations within ``tolerance``
        of the highest predicted samples/s, the smallest max_staleness (staler data costs
        learning efficiency the simulator does not see), then the highest samples/s."""
        cands = [(s, eta, r["samples_per_s"]) for s in self.feasible() for eta, r in s.by_staleness.items()
                 if staleness is None or eta == staleness]
        if not cands:
            return None
        top = max(c[2] for c in cands)
        ok = [c for c in cands if near_best(c[2], top, self.tolerance)]
        s, eta, _ = min(ok, key=lambda c: (c[1], -c[2], c[0].learner_nodes))
        return s, eta

    def configured_shortfall(self) -> tuple[float, str] | None:
        """(fraction below the recommendation, one warning line) when the config's fixed split
        is predicted more than ``margin`` below the best split at the config's own max_staleness
        (the split is what is fixed; the bound is the config's choice); None otherwise."""
        if self.configured is None:
            return None
        k, ceta = self.configured
        b = self.best(ceta)
        if b is None:
            return None
        cs = next((x for x in self.splits if x.learner_nodes == k), None)
        rec = b[0].by_staleness[b[1]]["samples_per_s"]
        if cs is None or cs.reason or ceta not in cs.by_staleness:
            why = "not admissible" if cs is not None and cs.reason else "not simulated"
            return 1.0, (f"the fixed split ({k} learner node(s), max_staleness {ceta}) is {why} by the planner; "
                         f"its best split at that bound: {b[0].learner_nodes} learner node(s)")
        got = cs.by_staleness[ceta]["samples_per_s"]
        short = 1.0 - got / rec if rec > 0 else 0.0
        if short <= self.margin:
            return None
        return short, (f"the fixed split ({k} learner node(s), max_staleness {ceta}: {got:.3f} samples/s predicted) "
                       f"is {short:.0%} below the planner's best split at that bound ({b[0].learner_nodes} learner node(s): "
                       f"{rec:.3f}), more than launch.planner.margin = {self.margin:.0%}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cost_sources"] = cost_sources(self.cost, self.workload)
        b, bs = self.best(), self.best(0)
        if b is not None:
            d["recommended"] = {"learner_nodes": b[0].learner_nodes, "engine_nodes": b[0].engine_nodes,
                                "max_staleness": b[1], "layout": b[0].layout,
                                "samples_per_s": b[0].by_staleness[b[1]]["samples_per_s"]}
        if b is not None and bs is not None:
            d["recommended"]["speedup_over_best_sync"] = round(
                b[0].by_staleness[b[1]]["samples_per_s"] / bs[0].by_staleness[0]["samples_per_s"], 4)
            d["best_sync"] = {"learner_nodes": bs[0].learner_nodes, "samples_per_s": bs[0].by_staleness[0]["samples_per_s"]}
        short = self.configured_shortfall()
        d["configured_shortfall"] = None if short is None else {"fraction": round(short[0], 4), "warning": short[1]}
        return d


def learner_memory(exp: "ExperimentConfig", m: "ModelArch", layout: ParallelLayout):
    """The launcher's own memory verdict for a learner layout (the check ``--dry-run`` enforces),
    with the recompute mode and micro-batch tokens it assumed: (LearnerMemory, recompute, tokens).
    The settings are the trainer's own sections, resolved as the launcher resolves them
    (``memory.learner_settings``): the memory plan the launch would enforce."""
    s, critic, reference = learner_settings(exp, m, layout, on_gpu=True)
    est = estimate_learner(m, s, layout, exp.launch.gpu_memory_gib, reference=reference, critic=critic)
    return est, s.recompute, s.micro_batch_tokens


SENSITIVITY_FACTORS = (0.5, 2.0)
SENSITIVITY_NEIGHBOURHOOD = 3
"""Splits within this many learner nodes of the recommendation are re-simulated per perturbation."""


def sensitivity(exp: "ExperimentConfig", rep: PlanReport, factors: tuple[float, ...] = SENSITIVITY_FACTORS) -> list[dict]:
    """Re-plan with each figure not measured here (``costs.COST_SOURCES`` / ``WORKLOAD_SOURCES``:
    assumed or published, not datasheet) scaled by
    each factor (efficiencies capped at 1): the recommended split and bound it gives. Splits within
    ``SENSITIVITY_NEIGHBOURHOOD`` nodes of the recommendation are simulated (a recommendation at
    the edge of that window means "moves further"), with at most 4 simulated steps."""
    best = rep.best()
    if best is None:
        return []
    k0, eta0 = best[0].learner_nodes, best[1]
    near = tuple(range(max(1, k0 - SENSITIVITY_NEIGHBOURHOOD), min(rep.nodes - 1, k0 + SENSITIVITY_NEIGHBOURHOOD) + 1))
    cfg = exp.launch
    base_cost, base_wl = cfg.planner.cost, cfg.planner.workload
    steps = min(base_wl.sim_steps, 4)
    # the published MFU was not measured on this trainer either: it is perturbed with the guesses
    sources = cost_sources(base_cost, base_wl)  # a measured decode sweep takes its figures out
    perturb = [("cost", k) for k in COST_SOURCES if sources[f"cost.{k}"]["source"] in ("assumed", "published")]
    if not base_wl.lengths_from:
        perturb += [("workload", k) for k, (src, _) in WORKLOAD_SOURCES.items() if src == "assumed" and k != "reject_prob"]

    def plan(cost: ClusterCostModel, wl: WorkloadModel) -> tuple[int, int, float] | None:
        cfg.planner.cost, cfg.planner.workload = cost, wl
        try:
            r = sweep(exp, label=rep.config, nodes=rep.nodes, gpus_per_node=rep.gpus_per_node,
                      gpus_source=rep.gpus_per_node_source, staleness=rep.staleness, tolerance=rep.tolerance,
                      learner_nodes=near)
        finally:
            cfg.planner.cost, cfg.planner.workload = base_cost, base_wl
        b = r.best()
        return None if b is None else (b[0].learner_nodes, b[1], b[0].by_staleness[b[1]]["samples_per_s"])

    ref = plan(base_cost, dataclasses.replace(base_wl, sim_steps=steps))
    rows = []
    for section, name in perturb:
        obj = base_cost if section == "cost" else base_wl
        v0 = getattr(obj, name)
        if section == "workload" and name == "gen_mean_tokens" and not v0:
            v0 = 0.4 * rep.max_new_tokens
        for f in factors:
            v = v0 * f
            if name.endswith("efficiency"):
                v = min(1.0, v)
            if section == "workload" and name == "gen_mean_tokens":
                v = min(v, float(rep.max_new_tokens))
            if v == v0:
                continue
            cost = dataclasses.replace(base_cost, **{name: v}) if section == "cost" else base_cost
            wl = dataclasses.replace(base_wl, sim_steps=steps, **({name: v} if section == "workload" else {}))
            got = plan(cost, wl)
            row = {"figure": f"{section}.{name}", "base": v0, "value": round(v, 6), "factor": f}
            if got is None:
                row.update(learner_nodes=None, max_staleness=None, samples_per_s=None, split_changed=True,
                           bound_changed=True)
            else:
                row.update(learner_nodes=got[0], max_staleness=got[1], samples_per_s=got[2],
                           split_changed=got[0] != k0, bound_changed=got[1] != eta0,
                           at_window_edge=got[0] in (near[0], near[-1]) and got[0] != k0)
            rows.append(row)
    if ref is not None:
        rows.insert(0, {"figure": "(as configured)", "base": None, "value": None, "factor": 1.0,
                        "learner_nodes": ref[0], "max_staleness": ref[1], "samples_per_s": ref[2],
                        "split_changed": ref[0] != k0, "bound_changed": ref[1] != eta0})
    return rows


def sweep(exp: "ExperimentConfig", *, label: str, nodes: int, gpus_per_node: int, gpus_source: str,
          staleness: tuple[int, ...], tolerance: float = PLAN_TOLERANCE, sweep_pipeline: bool = True,
          learner_nodes: tuple[int, ...] | None = None) -> PlanReport:
    """Simulate every split of ``nodes`` x every ``staleness`` for a typed experiment (its
    ``launch.planner`` figures, model, ``parallel``, ``actor``/``critic``/``algorithm``,
    ``inference.server``, ``rollout`` and ``workflow`` sections).

    ``sweep_pipeline``: try every pipeline size (what ``areal-mega plan`` reports) or only the
    trainer's own ``parallel`` layout (what a launch with ``learner.num_nodes: null`` runs: the
    trainer is started with that YAML, so only its data-parallel size follows the split).
    ``learner_nodes``: simulate only these splits (default: all)."""
    cfg = exp.launch
    cost, workload = cfg.planner.cost, cfg.planner.workload
    if nodes < 2:
        raise SimulationError(f"--nodes: need >= 2 (one learner and one engine node), got {nodes}")
    if not 0 <= tolerance < 1:
        raise SimulationError(f"--tolerance: must be in [0, 1), got {tolerance}")
    if not staleness or min(staleness) < 0:
        raise SimulationError(f"--staleness: need a list of values >= 0, got {list(staleness)}")
    if gpus_per_node < 1:
        raise SimulationError(f"{gpus_source}: the planner models GPU nodes, got {gpus_per_node} GPUs per node")
    m = model_arch(exp)
    P = total_params(m)
    PA = count_params(m).active(m.num_layers)  # MoE: FLOPs follow the k active experts
    srv = exp.inference.server
    et = srv.tp_size
    wire_bytes = 2.0  # per parameter on the wire; fp8 servers: the quantized linears' 1 byte + scales
    if srv.quantization == "fp8":
        from areal_mega.weight_sync.fp8 import fp8_sync_bytes  # torch: only when fp8 is priced

        a = model_adapter(exp)
        wire_bytes = 2.0 * fp8_sync_bytes(a) / sum(2 * math.prod(a.hf_shape(n)) for n in a.hf_names())
    sync_mode, sync_params = exp.weight_sync.mode, P  # LoRA merged: the full model over the mode's transport
    if exp.weight_sync.served_lora(exp.actor.lora, srv.quantization, exp.inference.client.pause_mode) is not None:  # adapter-only: the adapters
        lora = exp.actor.lora
        sync_mode, sync_params = "lora_adapter", m.num_layers * lora_layer_params(m, lora.rank, lora.target_modules, 1)
    try:
        span = server_nodes(et, gpus_per_node)  # a server wider than a node spans whole nodes
    except ValueError as e:
        raise SimulationError(str(e)) from None
    eng = estimate_engine(m, tp=et, max_total_tokens=srv.max_total_tokens,
                          mem_fraction_static=srv.mem_fraction_static or cfg.engine.default_mem_fraction_static,
                          kv_dtype_bytes=cfg.engine.kv_cache_dtype_bytes, gpu_memory_gib=cfg.gpu_memory_gib,
                          quantization=srv.quantization)
    if not eng.fits:
        raise SimulationError(f"engine does not fit: {eng.describe()}")
    par, alg, ro = exp.parallel, exp.algorithm, exp.rollout
    group = exp.workflow.group_size
    max_new = exp.workflow.sampling.max_new_tokens
    lengths = workload.lengths(max_new)
    lengths.validate()
    mean_gen, mean_ctx = lengths.moments()
    tokens_per_step = ro.batch_size * group * (lengths.prompt_tokens + mean_gen)

    def flops_per_token(recompute: str) -> float:
        return learner_flops_per_token(params=PA, layers=m.num_layers, hidden=m.hidden_size,
                                       mean_context=(lengths.prompt_tokens + mean_gen) / 2, decoupled=alg.decoupled,
                                       reference=alg.needs_reference, critic=alg.needs_critic,
                                       recompute=recompute, frozen_base=exp.actor.lora.enabled)
    dec = decode_model(cost, params=P, engine_tp=et, kv_bytes_per_token_per_gpu=eng.kv_bytes_per_token,
                       mean_context=mean_ctx, kv_capacity_tokens=eng.kv_tokens, prompt_tokens=lengths.prompt_tokens,
                       active_params=PA)
    per_node = gpus_per_node // et if span == 1 else 0
    splits = []
    for k in range(1, nodes):
        if learner_nodes is not None and k not in learner_nodes:
            continue
        s = SplitResult(learner_nodes=k, engine_nodes=nodes - k,
                        num_servers=(nodes - k) * per_node if span == 1 else (nodes - k) // span)
        world = k * gpus_per_node
        best = None
        reasons = []
        mp = par.tensor_parallel * par.context_parallel
        pps = [q for q in range(1, MAX_PP + 1) if m.num_layers % q == 0 and world % (mp * q) == 0]
        for pp in dict.fromkeys((par.pipeline_parallel, *(pps if sweep_pipeline else ()))):
            own = pp == par.pipeline_parallel
            vpp = par.virtual_pipeline_parallel if own and pp > 1 else None
            try:
                layout = ParallelLayout.build(dataclasses.replace(
                    par, pipeline_parallel=pp, virtual_pipeline_parallel=vpp,
                    data_parallel=par.data_parallel if own else None), world)
                mem, recompute, mbt = learner_memory(exp, m, layout)
            except ValueError as e:
                reasons.append(f"pp{pp}: {e}")
                continue
            if not mem.fits:
                reasons.append(f"pp{pp}: {mem.total / GIB:.0f} GiB > {cfg.gpu_memory_gib:g} GiB")
                s.over_memory_gib = min(s.over_memory_gib or float("inf"), round(mem.total / GIB, 1))
                continue
            lm = learner_model(cost, flops_per_token=flops_per_token(recompute), world=world, pp=pp, vpp=layout.vpp,
                               dp=layout.dp, tokens_per_step=tokens_per_step, micro_batch_tokens=mbt)
            t = lm.step_s(tokens_per_step)
            if best is None or t < best[0] - 1e-12:
                best = (t, layout, mem, lm, sync_model(cost, mode=sync_mode, params=sync_params, engine_tp=et,
                                                    num_servers=s.num_servers, world=world, dtype_bytes=wire_bytes))
        if best is None:
            s.reason = "no learner layout fits: " + "; ".join(reasons)
            splits.append(s)
            continue
        t, layout, mem, lm, sm = best
        s.layout = f"tp{layout.tp} pp{layout.pp} dp{layout.dp}" + (f" cp{layout.cp}" if layout.cp > 1 else "") \
            + (f" vpp{layout.vpp}" if layout.vpp else "")
        s.learner_gib, s.learner_step_s, s.sync_s = round(mem.total / GIB, 1), round(t, 3), round(sm.seconds(), 3)
        for eta in staleness:
            sim = SimConfig(batch_size=ro.batch_size, group_size=group, max_staleness=eta,
                            max_concurrent=ro.max_concurrent, num_servers=s.num_servers, steps=workload.sim_steps,
                            warmup_steps=eta + 2, reject_prob=workload.reject_prob, seed=0, lengths=lengths,
                            decode=dec, learner=lm, sync=sm)
            s.by_staleness[eta] = simulate(sim).summary()
        splits.append(s)
    k = cfg.learner.num_nodes
    configured = (k, ro.max_staleness) if k is not None and k < nodes else None
    return PlanReport(config=label, nodes=nodes, gpus_per_node=gpus_per_node, gpus_per_node_source=gpus_source,
                      model_params=float(P), engine_tp=et, engine_kv_tokens=eng.kv_tokens, batch_size=ro.batch_size,
                      group_size=group, max_new_tokens=max_new, staleness=tuple(staleness), splits=splits,
                      cost=cost, workload=workload, configured=configured, tolerance=tolerance,
                      margin=cfg.planner.margin)


def choose_learner_nodes(exp: "ExperimentConfig", *, nodes: int, gpus_per_node: int) -> tuple[int, str]:
    """The split a launch with ``launch.learner.num_nodes: null`` uses on ``nodes`` GPU nodes:
    the predicted-fastest split at the trainer's own layout (TP/PP/CP; DP follows) and
    ``rollout.max_staleness``, among those whose learner plan fits (the dry run's own check).
    Returns (learner nodes, a note for the plan); raises ValueError naming the keys if none fits."""
    eta = exp.rollout.max_staleness
    rep = sweep(exp, label="", nodes=nodes, gpus_per_node=gpus_per_node, gpus_source="gpus per node",
                staleness=(eta,), sweep_pipeline=False)
    ok = rep.feasible()
    if not ok:
        over = [s for s in rep.splits if s.over_memory_gib]
        if over:  # valid layouts, none within memory: plan the least loaded one, which the dry run refuses
            s = min(over, key=lambda s: (s.over_memory_gib, s.learner_nodes))
            return s.learner_nodes, (
                f"no split of {nodes} nodes fits the learner plan in memory (launch.learner.num_nodes: null); "
                f"planned the least loaded one, {s.learner_nodes} learner node(s) ({s.over_memory_gib:g} GiB per GPU)")
        first = next((s.reason for s in rep.splits if s.reason), "")
        raise ValueError(f"launch.learner.num_nodes: null, but no split of {nodes} nodes fits the learner layout "
                         f"(parallel: {first.removeprefix('no learner layout fits: ')[:160]}); set it explicitly or "
                         "allocate more nodes")
    best = max(ok, key=lambda s: (s.by_staleness[eta]["samples_per_s"], -s.learner_nodes))
    r = best.by_staleness[eta]
    return best.learner_nodes, (
        f"split chosen by the planner (launch.learner.num_nodes: null): {best.learner_nodes} learner + "
        f"{best.engine_nodes} engine node(s), {best.layout}, {r['samples_per_s']:.3f} samples/s predicted at "
        f"max_staleness {eta} (of {len(ok)} admissible splits; launch.planner cost model)")


def recommendation(rep: PlanReport) -> list[str]:
    """The few lines the launcher's dry run prints."""
    b, bs = rep.best(), rep.best(0)
    if b is None:
        return ["planner: no admissible split (no learner layout fits on any split)"]
    s, eta = b
    r = s.by_staleness[eta]
    top = max(r["samples_per_s"] for x in rep.feasible() for r in x.by_staleness.values())
    lines = [f"planner: recommended {s.learner_nodes} learner node(s) ({s.layout}) + {s.engine_nodes} engine node(s) "
             f"({s.num_servers} servers x TP{rep.engine_tp}), max_staleness {eta}: "
             f"{r['samples_per_s']:.3f} samples/s predicted (generation idle {r['gen_idle_frac']:.0%}, "
             f"training idle {r['train_idle_frac']:.0%}, mean staleness {r['staleness_mean']:.2f}; "
             f"the smallest bound within {rep.tolerance:.0%} of the best predicted, {top:.3f})"]
    if bs is not None:
        sync = bs[0].by_staleness[0]["samples_per_s"]
        lines.append(f"planner: predicted speedup over the best synchronous plan ({bs[0].learner_nodes} learner node(s), "
                     f"max_staleness 0: {sync:.3f} samples/s): {r['samples_per_s'] / sync:.2f}x")
    if rep.configured is not None:
        k, ceta = rep.configured
        cs = next((x for x in rep.feasible() if x.learner_nodes == k), None)
        if cs is not None and ceta in cs.by_staleness:
            lines.append(f"planner: the config's own choice ({k} learner node(s), max_staleness {ceta}): "
                         f"{cs.by_staleness[ceta]['samples_per_s']:.3f} samples/s predicted")
    short = rep.configured_shortfall()
    if short is not None:
        lines.append(f"planner: WARNING: {short[1]}")
    lines.append("planner: cost model " + ", ".join(f"{f.name}={getattr(rep.cost, f.name)}" for f in dataclasses.fields(rep.cost))
                 + " (docs/simulator.md)")
    src = cost_sources(rep.cost, rep.workload)
    by = {}
    for k, v in src.items():
        by.setdefault(v["source"], []).append(k.split(".", 1)[1])
    lines.append("planner: cost figures " + "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(by.items()))
                 + " (none measured on this cluster: calibrate with tools/bench_simulator.py, set measured ones)")
    lines += sensitivity_lines(rep)
    return lines


def sensitivity_lines(rep: PlanReport) -> list[str]:
    rows = [r for r in rep.sensitivity if r["figure"] != "(as configured)"]
    if not rows:
        return []
    moved = [r for r in rows if r["split_changed"]]
    bound = [r for r in rows if r["bound_changed"]]
    fmt = lambda r: f"{r['figure']} x{r['factor']:g} -> {r['learner_nodes']} learner / eta {r['max_staleness']}"  # noqa: E731
    out = [f"planner: sensitivity (each assumed or published figure x{' and x'.join(f'{f:g}' for f in SENSITIVITY_FACTORS)}): "
           f"split changes in {len(moved)} of {len(rows)}, bound in {len(bound)} of {len(rows)}"]
    changed = [r for r in rows if r["split_changed"] or r["bound_changed"]]
    if changed:
        out.append("planner:   " + "; ".join(fmt(r) for r in changed))
    return out


def describe(rep: PlanReport) -> str:
    w = rep.workload
    dist = (f"lengths from {w.lengths_from}" if w.lengths_from else
            f"lengths lognormal mean {w.gen_mean_tokens or 0.4 * rep.max_new_tokens:.0f} sigma {w.gen_sigma}")
    lines = [f"throughput plan: {rep.config} on {rep.nodes} nodes x {rep.gpus_per_node} GPUs ({rep.gpus_per_node_source}); "
             f"{rep.model_params / 1e9:.1f}B params, batch {rep.batch_size} x {rep.group_size}, "
             f"{dist} cap {rep.max_new_tokens}, engine TP{rep.engine_tp} KV {rep.engine_kv_tokens} tokens",
             "  learner+engine nodes | learner layout (GiB/GPU) | learner step s | sync s | samples/s by max_staleness "
             + " ".join(str(e) for e in rep.staleness)]
    for s in rep.splits:
        head = f"  {s.learner_nodes:>3} + {s.engine_nodes:<3}"
        if s.reason:
            lines.append(f"{head} | not admissible: {s.reason[:140]}")
            continue
        vals = " ".join(f"{s.by_staleness[e]['samples_per_s']:.3f}" for e in rep.staleness)
        lines.append(f"{head} | {s.layout} ({s.learner_gib}) | {s.learner_step_s:.1f} | {s.sync_s:.1f} | {vals}")
    return "\n".join(lines + recommendation(rep))


def write_plan(rep: PlanReport, out: Path) -> str:
    """``plan.json`` and ``throughput_plan.png`` (predicted samples/s vs. split and vs.
    max_staleness) into ``out``; returns the line saying what was written (OSError if not)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(rep.to_dict(), indent=1) + "\n")
    png, why = plot_plan(rep, out / "throughput_plan.png")
    return f"plan written to {out / 'plan.json'}" + (f"; plot {png}" if png else f"; no plot: {why}")
