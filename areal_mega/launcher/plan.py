"""Placement: which node runs which learner / engine process, with which command and environment.

A pure function of the config and an :class:`Allocation` (the nodes Slurm gave us, or this one
machine), so placement, commands and the memory verdict are unit-testable without a cluster:

    allocation (nodes n1..nN, G GPUs each)
      n1..nL      learners: one torchrun per node, static rendezvous at n1:master_port,
                  --node-rank = position in the learner nodes (not SLURM_NODEID, which counts
                  the whole job), G ranks per node
      nL+1..      engines: floor(G / engine_tp) servers per node (one per CPU node), each
                  bound to its node's own address, port P + k for its k-th server
                  (P = inference.server.port, or launch.engine.default_port when that is 0)

Learners start only once every engine has written its address file (engine_proc.py); the
launcher then writes them all to ``engines_file``, which the learner command receives.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_mega.experiment import ExperimentConfig, experiment_from_dict
from areal_mega.inference.server import build_launch_command, wants_reshard_receiver
from areal_mega.launcher.config import LaunchConfig
from areal_mega.parallel import ParallelLayout
from areal_mega.simulator.memory import (
    GIB, EngineMemory, LearnerMemory, LearnerSettings, estimate_engine, estimate_learner, learner_settings,
    linear_state_bytes_per_request, model_adapter, model_arch, server_nodes,
)
from areal_mega.simulator.planner import choose_learner_nodes
from areal_mega.utils import secrets
from areal_mega.utils.procs import service_ports

DEFAULT_MASTER_PORT = 29500
"""torchrun's rendezvous port on the first learner node under Slurm when launch.learner.master_port is 0."""

if TYPE_CHECKING:
    from areal_mega.models.base import ModelArch

__all__ = [
    "Allocation", "LaunchPlan", "PLACEHOLDERS", "ProcSpec", "REPO_ROOT", "build_plan", "learner_node_count",
    "render"
]

REPO_ROOT = Path(__file__).resolve().parents[2]

PLACEHOLDERS = {
    "python": "the launcher's interpreter (learner virtualenv)",
    "engine_python": "launch.engine.python (or --engine-python)",
    "config": "the experiment YAML path",
    "overrides": "(whole element) the non-launch. overrides, one per argument",
    "run_dir": "the job directory",
    "job_id": "Slurm job id ('local' for the local launcher)",
    "engines_file": "JSON list of ready engines, written before learners start",
    "stop_file": "the trainer's stop file: created on SIGUSR1/SIGTERM (checkpoint and stop)",
    "engine_addresses": "YAML list [host:port, ...] of all planned engines (for inference.addresses)",
    "num_engines": "number of engines",
    "host": "engine: its node's address", "port": "engine: its port", "tp": "engine: TP size",
    "engine_index": "engine: its index",
}
_PLACEHOLDER = re.compile(r"\{(cfg:[A-Za-z0-9_.\-]+|[a-z_]+)\}")


@dataclass(frozen=True)
class Allocation:
    """The nodes a launch may use: a Slurm allocation, or this machine (``local``)."""

    job_id: str
    nodes: tuple[str, ...]
    addresses: tuple[str, ...]
    """Address each node's servers bind to (the node name resolved; 127.0.0.1 locally)."""
    gpus_per_node: int
    cpus_per_node: int | None = None
    local: bool = False
    """One machine: every process runs on nodes[0]; GPUs are split by CUDA_VISIBLE_DEVICES."""

    def __post_init__(self) -> None:
        assert len(self.nodes) == len(self.addresses) and self.nodes, (self.nodes, self.addresses)


@dataclass(frozen=True)
class ProcSpec:
    """One process to start on one node (under srun, or locally)."""

    name: str
    role: str
    """"engine" or "learner"."""
    node: str
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables added to the launcher's environment."""
    num_gpus: int
    """GPUs the srun step asks for (--gres=gpu:N)."""
    log_path: str
    cpus: int | None = None
    """CPUs the srun step asks for (--exact --cpus-per-task), when the node runs several steps."""
    gpu_ids: tuple[int, ...] | None = None
    """Local launcher only: the GPUs this process sees."""
    address_file: str | None = None
    """Engines: where engine_proc writes {host, port, url} once the server answers."""
    url: str | None = None
    node_rank: int | None = None
    """Learners: torchrun --node-rank."""
    nproc: int = 0
    """Learners: ranks on this node."""
    server: str | None = None
    """Engines: the server this process belongs to (its node-0 process's name). A server spanning
    nodes runs one process per node; only node 0 serves HTTP (``address_file``, ``url``), the
    others have neither and die with their server (supervisor)."""

    def shell(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    run_dir: Path
    allocation: Allocation
    layout: ParallelLayout
    learner_nodes: tuple[str, ...]
    engine_nodes: tuple[str, ...]
    master_addr: str
    engines: tuple[ProcSpec, ...]
    learners: tuple[ProcSpec, ...]
    engines_file: Path
    env: dict[str, str]
    learner_memory: LearnerMemory | None
    """None only on CPU nodes without a model config (nothing to estimate, nothing enforced)."""
    engine_memory: EngineMemory | None
    checks_gpu_memory: bool
    """False on CPU nodes: the estimate is printed, not enforced."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    secrets_dir: Path | None = None
    """Where the launch writes the servers' API key (utils.secrets) before starting anything;
    None when the YAML's ``inference.api_key_file`` names the key file itself."""
    api_key: str | None = field(default=None, repr=False)
    """The YAML's own ``inference.api_key``, if any (else a random key per launch)."""
    stop_file: Path | None = None
    """The trainer's stop file (``trainer.stop_file``): the launcher creates it on SIGUSR1/SIGTERM."""
    preempt_grace_s: float = 0.0
    """``launch.preempt_grace_s``: how long a checkpoint-and-stop may take."""

    @property
    def fits(self) -> bool:
        if not self.checks_gpu_memory:
            return True
        return (self.learner_memory is not None and self.learner_memory.fits
                and (self.engine_memory is None or self.engine_memory.fits))

    def describe(self) -> str:
        a = self.allocation
        gpus = f"{a.gpus_per_node} GPUs" if a.gpus_per_node else "no GPUs (gloo)"
        where = "this machine" if a.local else f"{len(a.nodes)} nodes"
        lines = [
            f"launch plan: job {self.job_id}, run dir {self.run_dir}",
            f"  allocation: {where} x {gpus}: {' '.join(a.nodes)}",
            f"  learners: {len(self.learner_nodes)} node(s) {' '.join(self.learner_nodes)}; "
            f"{self.layout.world_size} ranks, layout {self.layout}; rendezvous {self.master_addr}",
            f"  engines: {len(self.servers)} server(s) x TP{self._engine_tp()} on "
            f"{len(self.engine_nodes)} node(s) {' '.join(self.engine_nodes)}"
            + (f" ({len(self.engine_nodes) // max(1, len(self.servers))} nodes per server)"
               if len(self.engines) > len(self.servers) else ""),
            "  environment (added to every process): "
            + (" ".join(f"{k}={v}" for k, v in sorted(self.env.items())) or "(none)"),
            "  commands:",
        ]
        for p in self.engines + self.learners:
            res = f"{p.num_gpus} GPU" + ("s" if p.num_gpus != 1 else "")
            if p.gpu_ids is not None:
                res += f" [{','.join(map(str, p.gpu_ids))}]"
            extra = " ".join(f"{k}={v}" for k, v in sorted(p.env.items()) if self.env.get(k) != v)
            extra = f"; env {extra}" if extra else ""
            lines.append(f"    {p.name} @ {p.node} ({res}; log {p.log_path}{extra}): {p.shell()}")
        lines.append("memory estimate per GPU:")
        lines.append("  " + (self.learner_memory.describe() if self.learner_memory is not None
                             else "learner: not estimated (no model config)"))
        if self.engine_memory is not None:
            lines.append("  " + self.engine_memory.describe())
        if not self.checks_gpu_memory:
            lines.append("  (no GPUs: estimates shown, not enforced)")
        if self.stop_file is not None:
            lines.append(f"preemption: SIGUSR1/SIGTERM -> {self.stop_file}; the learners checkpoint and stop "
                         f"within launch.preempt_grace_s = {self.preempt_grace_s:g} s, then exit 75 (requeue)")
        if self.secrets_dir is not None:
            lines.append(f"servers' API key: written at launch to {self.secrets_dir} (0600; "
                         + ("the YAML's inference.api_key)" if self.api_key else "random, one per launch)"))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    @property
    def servers(self) -> tuple[ProcSpec, ...]:
        """The engine processes the pool sees (one per server, however many nodes it spans)."""
        return tuple(e for e in self.engines if e.address_file is not None)

    def _engine_tp(self) -> int:
        return self.engine_memory.tp if self.engine_memory is not None else 0


def render(template: list[str], values: dict[str, Any], raw: dict, overrides: list[str], key: str) -> list[str]:
    """Fill ``{name}`` / ``{cfg:dotted.key}`` placeholders; ``{overrides}`` expands in place."""
    out: list[str] = []
    for item in template:
        if item == "{overrides}":
            out.extend(overrides)
            continue

        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name.startswith("cfg:"):
                node: Any = raw
                for part in name[4:].split("."):
                    if not isinstance(node, dict) or part not in node:
                        raise ValueError(f"{key}: placeholder {{{name}}} names a key missing from the config")
                    node = node[part]
                return str(node)
            if name not in values:
                raise ValueError(
                    f"{key}: unknown placeholder {{{name}}} (known: {', '.join(sorted(values))}, cfg:<key>)"
                )
            return str(values[name])

        out.append(_PLACEHOLDER.sub(sub, item))
    return out


def _what_would_fit(m: ModelArch, s: LearnerSettings, layout: ParallelLayout, gib: float, *,
                    reference: bool, critic: LearnerSettings | None) -> str | None:
    """A hint for a plan that does not fit: the first of the config's own switches (SP,
    recompute, THD attention) that would make it fit -- priced, not applied."""
    tries = []
    if not s.sequence_parallel and layout.tp > 1:
        tries.append(("actor.model.sequence_parallel: true", dict(sequence_parallel=True)))
    if s.attention == "mask" and s.layer_spec == "te":
        tries.append(("actor.attention: thd", dict(attention="thd")))
    if s.recompute == "none":
        tries.append(("actor.model.recompute: selective", dict(recompute="selective")))
    if s.recompute != "full":
        tries.append(("actor.model.recompute: full", dict(recompute="full", recompute_method="uniform",
                                                          recompute_num_layers=1)))
    changes: dict = {}
    said: dict[str, str] = {}
    for text, ch in tries:
        changes.update(ch)
        said[text.split(":")[0]] = text  # a later recompute level replaces the earlier one
        if estimate_learner(m, replace(s, **changes), layout, gib, reference=reference, critic=critic).fits:
            return "would fit with " + ", ".join(said.values())
    return None


def learner_node_count(exp: ExperimentConfig, alloc: Allocation) -> tuple[int, str | None]:
    """How many nodes train (and a note saying who chose it): ``launch.learner.num_nodes`` when
    set; else, with ``launch.engine.num_nodes`` set, the nodes the engines leave; else on GPU
    nodes the throughput planner's best split for this allocation (``simulator.planner
    .choose_learner_nodes``: the trainer's own layout, within the memory plan); else 1."""
    lc, ec = exp.launch.learner, exp.launch.engine
    if lc.num_nodes is not None:
        return lc.num_nodes, None
    if alloc.local:
        return 1, None
    n = len(alloc.nodes)
    if ec.num_nodes is not None:
        if ec.num_nodes >= n:
            raise ValueError(f"launch.engine.num_nodes: {ec.num_nodes} leaves no learner node of the {n} allocated")
        return n - ec.num_nodes, None
    if not alloc.gpus_per_node:
        return 1, "CPU nodes: 1 learner node (launch.learner.num_nodes: null plans a split on GPU nodes only)"
    if lc.nproc_per_node not in (None, alloc.gpus_per_node):
        raise ValueError(f"launch.learner.num_nodes: null plans whole GPU nodes, but launch.learner.nproc_per_node is "
                         f"{lc.nproc_per_node} of {alloc.gpus_per_node} GPUs; set num_nodes too")
    if n < 2:
        raise ValueError(f"launch.learner.num_nodes: null needs >= 2 nodes (learners and engines), got {n}")
    return choose_learner_nodes(exp, nodes=n, gpus_per_node=alloc.gpus_per_node)


def _learner_world(exp: ExperimentConfig, gpus: int, num_nodes: int) -> tuple[int, int]:
    """(ranks per learner node, world size) on ``num_nodes`` learner nodes."""
    lc = exp.launch.learner
    if lc.nproc_per_node is not None:
        nproc = lc.nproc_per_node
    elif gpus:
        nproc = gpus
    else:  # CPU: just the model-parallel size (times an explicit dp), spread over the nodes
        world = ParallelLayout.smallest(exp.parallel).world_size
        if world % num_nodes:
            raise ValueError(
                f"launch.learner.nproc_per_node: on CPU nodes it defaults to tp*pp*cp*dp({world}) / "
                f"num_nodes({num_nodes}), which does not divide; set it explicitly"
            )
        nproc = world // num_nodes
    if gpus and nproc > gpus:
        raise ValueError(f"launch.learner.nproc_per_node: {nproc} ranks > {gpus} GPUs per node")
    return nproc, nproc * num_nodes


@dataclass(frozen=True)
class _Nodes:
    """Which node runs what: the learner nodes, one (node, address, k-th on its node) slot per
    engine, the rendezvous address, and notes (idle nodes)."""

    learner_nodes: tuple[str, ...]
    engine_slots: tuple[tuple[str, str, int], ...]
    master_addr: str
    notes: tuple[str, ...] = ()
    engine_spans: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Per engine slot, the (node, address) of its other nodes when a server spans nodes."""


def place_local(alloc: Allocation, exp: ExperimentConfig, world: int) -> _Nodes:
    """One machine: learners and engines on it, engines after the learners' GPUs."""
    ec, tp, gpus = exp.launch.engine, exp.inference.server.tp_size, alloc.gpus_per_node
    per_node = max(1, gpus // tp) if gpus else 1
    num_engines = ec.num_engines if ec.num_engines is not None else (ec.num_nodes or 1) * per_node
    if gpus and world + num_engines * tp > gpus:
        raise ValueError(f"launch: learners ({world} GPUs) + engines ({num_engines} x TP{tp}) > {gpus} local GPUs")
    slots = tuple((alloc.nodes[0], alloc.addresses[0], i) for i in range(num_engines))
    return _Nodes((alloc.nodes[0],), slots, alloc.addresses[0])


def place_cluster(alloc: Allocation, exp: ExperimentConfig, n_learn: int) -> _Nodes:
    """Learners on the first ``n_learn`` nodes, engines round-robin over the next ones (the
    k-th server of a node gets port P + k)."""
    ec, tp, gpus = exp.launch.engine, exp.inference.server.tp_size, alloc.gpus_per_node
    n_eng = ec.num_nodes if ec.num_nodes is not None else len(alloc.nodes) - n_learn
    if n_learn + n_eng > len(alloc.nodes) or n_eng < 0:
        raise ValueError(f"launch.engine.num_nodes: learner.num_nodes({n_learn}) + engine.num_nodes({n_eng}) "
                         f"> {len(alloc.nodes)} allocated nodes")
    engine_nodes = alloc.nodes[n_learn:n_learn + n_eng]
    span = server_nodes(tp, gpus)
    if span > 1:  # one server per group of `span` nodes (SGLang --nnodes), every GPU of each
        if n_eng % span:
            raise ValueError(f"launch.engine.num_nodes: {n_eng} engine nodes do not divide into servers of {span} "
                             f"nodes (inference.server.tp_size {tp} / {gpus} GPUs per node)")
        capacity = n_eng // span
        num_engines = ec.num_engines if ec.num_engines is not None else capacity
        if num_engines > capacity:
            raise ValueError(f"launch.engine.num_engines: {num_engines} > {n_eng} engine nodes / {span} per server")
        addrs = alloc.addresses[n_learn:n_learn + n_eng]
        slots = tuple((engine_nodes[i * span], addrs[i * span], 0) for i in range(num_engines))
        spans = tuple(tuple((engine_nodes[i * span + r], addrs[i * span + r]) for r in range(1, span))
                      for i in range(num_engines))
    else:
        per_node = gpus // tp if gpus else 1
        capacity = per_node * n_eng
        num_engines = ec.num_engines if ec.num_engines is not None else capacity
        if num_engines > capacity:
            raise ValueError(f"launch.engine.num_engines: {num_engines} > {n_eng} engine nodes x {per_node} per node")
        slots = tuple((engine_nodes[i % n_eng], alloc.addresses[n_learn + i % n_eng], i // n_eng)
                      for i in range(num_engines))
        spans = ()
    idle = len(alloc.nodes) - n_learn - len({n for n, _, _ in slots}) - sum(len(sp) for sp in spans)
    return _Nodes(alloc.nodes[:n_learn], slots, alloc.addresses[0],
                  (f"{idle} allocated node(s) left idle",) if idle else (), spans)


def engine_ports(alloc: Allocation, exp: ExperimentConfig, slots: tuple[tuple[str, str, int], ...]) -> list[int]:
    """inference.server.port (or launch.engine.default_port) + k per node; free ports locally
    when the port is 0."""
    srv = exp.inference.server
    if alloc.local and not srv.port:
        return service_ports(len(slots))
    first = srv.port or exp.launch.engine.default_port
    return [first + (i if alloc.local else k) for i, (_, _, k) in enumerate(slots)]


def cpus_per_step(alloc: Allocation, nodes: _Nodes) -> dict[str, int | None]:
    """CPUs each node's steps ask for: steps sharing a node split its CPUs (srun --exact), else
    one step takes the whole node (None)."""
    steps_on: dict[str, int] = {}
    spanned = [n for sp in nodes.engine_spans for n, _ in sp]
    for node in [n for n, _, _ in nodes.engine_slots] + spanned + list(nodes.learner_nodes):
        steps_on[node] = steps_on.get(node, 0) + 1
    return {node: None if alloc.local or not alloc.cpus_per_node or k < 2 else max(1, alloc.cpus_per_node // k)
            for node, k in steps_on.items()}


def engine_procs(exp: ExperimentConfig, alloc: Allocation, nodes: _Nodes, ports: list[int], *, env: dict[str, str],
                 base: dict, raw: dict, overrides: list[str], python: str, engine_python: str, run_dir: Path,
                 sglang_secret: str, first_gpu: int) -> tuple[ProcSpec, ...]:
    """One engine_proc-wrapped server per slot: SGLang's own command, or launch.engine.command."""
    ec, srv = exp.launch.engine, exp.inference.server
    tp, gpus = srv.tp_size, alloc.gpus_per_node
    cpus = cpus_per_step(alloc, nodes)
    engines = []
    next_gpu = first_gpu
    for i, (node, addr, k) in enumerate(nodes.engine_slots):
        port = ports[i]
        span = ((node, addr),) + (nodes.engine_spans[i] if nodes.engine_spans else ())
        for r, (n_node, n_addr) in enumerate(span):
            kw = dict(nnodes=len(span), node_rank=r, dist_init_addr=f"{addr}:{ec.dist_init_port}") if len(span) > 1 else {}
            if ec.command is None:
                seed = None if srv.random_seed is None else srv.random_seed + i
                engine_srv = replace(srv, host=n_addr if r else addr, python=engine_python)
                cmd = build_launch_command(engine_srv, port, random_seed=seed, secret_config=sglang_secret,
                                           capture_routes=exp.actor.model.captures_server_routes,
                                           lora=exp.weight_sync.served_lora(exp.actor.lora, srv.quantization,
                                                                                exp.inference.client.pause_mode),
                                           reshard_receiver=wants_reshard_receiver(engine_srv), **kw)
                engine_env = {**env, **srv.env}
            else:
                if len(span) > 1:
                    raise ValueError("launch.engine.command: servers spanning nodes need SGLang's own command "
                                     "(launch.engine.command: null)")
                engine_env = env
                vals = dict(base, host=addr, port=port, tp=tp, engine_index=i)
                cmd = render(ec.command, vals, raw, overrides, "launch.engine.command")
            name = f"engine{i}" if r == 0 else f"engine{i}.node{r}"
            # node 0 serves HTTP and is announced; the others are ready when node 0 answers
            addr_file = run_dir / "engines" / f"{name}.json"
            argv = [python, "-m", "areal_mega.launcher.engine_proc", "--address-file", str(addr_file),
                    "--host", addr, "--port", str(port), "--health-path", ec.health_path,
                    "--timeout", str(ec.startup_timeout_s), "--", *cmd]
            per_proc = tp // len(span)
            gpu_ids = None
            if alloc.local and gpus:
                gpu_ids = tuple(range(next_gpu, next_gpu + per_proc))
                next_gpu += per_proc
            engines.append(ProcSpec(
                name=name, role="engine", node=n_node, argv=tuple(argv), env=engine_env,
                num_gpus=per_proc if gpus else 0, log_path=str(run_dir / "logs" / f"{name}.log"),
                cpus=cpus[n_node], gpu_ids=gpu_ids, address_file=str(addr_file) if r == 0 else None,
                url=f"http://{addr}:{port}" if r == 0 else None, server=f"engine{i}",
            ))
    return tuple(engines)


def learner_procs(exp: ExperimentConfig, alloc: Allocation, nodes: _Nodes, *, nproc: int, world: int,
                  env: dict[str, str], base: dict, raw: dict, overrides: list[str], python: str,
                  run_dir: Path, master_port: int) -> tuple[ProcSpec, ...]:
    """One torchrun per learner node (static rendezvous at the first node)."""
    lc, gpus = exp.launch.learner, alloc.gpus_per_node
    cpus = cpus_per_step(alloc, nodes)
    logs = run_dir / "logs"
    cmd = render(lc.command, base, raw, overrides, "launch.learner.command")
    n_nodes = len(nodes.learner_nodes)
    local_nproc = world if alloc.local else nproc
    learners = []
    for r, node in enumerate(nodes.learner_nodes):
        name = f"learner{r}"
        argv = [python, "-m", "torch.distributed.run", "--nnodes", str(n_nodes), "--node-rank", str(r),
                "--nproc-per-node", str(local_nproc), "--master-addr", nodes.master_addr,
                "--master-port", str(master_port),
                # Per-rank logs (<dir>/<run>/attempt_0/<local_rank>/std{out,err}.log) let the
                # launcher print the failed rank's own tail; --tee keeps them in the node log too.
                "--log-dir", str(logs / f"{name}.ranks"), "--redirects", "3", "--tee", "3", *cmd]
        learners.append(ProcSpec(
            name=name, role="learner", node=node, argv=tuple(argv), env=env,
            num_gpus=local_nproc if gpus else 0, log_path=str(logs / f"{name}.log"),
            cpus=cpus[node], gpu_ids=tuple(range(world)) if (alloc.local and gpus) else None,
            node_rank=r, nproc=local_nproc,
        ))
    return tuple(learners)


def _server_ep(srv) -> int:
    """The server's ``--ep-size`` (inference.server.extra_args), 1 when absent."""
    args = list(srv.extra_args)
    return int(args[args.index("--ep-size") + 1]) if "--ep-size" in args[:-1] else 1


def memory_verdict(exp: ExperimentConfig, layout: ParallelLayout, gpus: int, *, engines: bool
                   ) -> tuple[LearnerMemory | None, EngineMemory | None, list[str]]:
    """The per-GPU estimates (learner; engine when there are engines) and notes: a hint for a
    learner plan that does not fit, an engine wider than a node; on CPU nodes a model that cannot
    be estimated is a note, not an error."""
    cfg, srv = exp.launch, exp.inference.server
    ec, tp = cfg.engine, srv.tp_size
    notes: list[str] = []
    try:
        m = model_arch(exp)
    except ValueError as e:
        if gpus:  # GPU plans are refused without an estimate
            raise
        return None, None, [f"memory not estimated: {e}"]  # CPU nodes (tests, demos): informational only
    settings, critic, reference = learner_settings(exp, m, layout, on_gpu=gpus > 0)
    learner_mem = estimate_learner(m, settings, layout, cfg.gpu_memory_gib, reference=reference, critic=critic)
    if gpus and not learner_mem.fits:
        hint = _what_would_fit(m, settings, layout, cfg.gpu_memory_gib, reference=reference, critic=critic)
        if hint:
            notes.append(f"the learner plan does not fit as configured; it {hint}")
    engine_mem = None
    if engines:
        engine_mem = estimate_engine(
            m, tp=tp, max_total_tokens=srv.max_total_tokens,
            mem_fraction_static=srv.mem_fraction_static or ec.default_mem_fraction_static,
            kv_dtype_bytes=ec.kv_cache_dtype_bytes, gpu_memory_gib=cfg.gpu_memory_gib,
            quantization=srv.quantization)
        if srv.quantization == "fp8":  # a family or TP without whole fp8 blocks: one line
            from areal_mega.weight_sync.fp8 import check_fp8  # torch: only when a plan is priced

            check_fp8(model_adapter(exp), tp, _server_ep(srv))
        span = server_nodes(tp, gpus)
        if m.linear is not None:
            notes.append(f"servers: gated DeltaNet recurrent state {linear_state_bytes_per_request(m, tp) / 2**20:.1f} "
                         "MiB per running request per GPU (SGLang's state pool; not in the KV estimate)")
        if gpus and engine_mem.weights > engine_mem.budget and tp >= gpus:
            notes.append(f"one server ({engine_mem.weights * tp / GIB:.0f} GiB of weights, "
                         f"{srv.quantization if srv.quantization != 'none' else srv.dtype}) does not fit "
                         f"{tp} GPUs of {cfg.gpu_memory_gib:g} GiB ({span} node(s)) at inference.server.tp_size={tp}; "
                         f"a larger tp_size runs servers spanning nodes (SGLang --nnodes)")
        elif gpus and span > 1:
            notes.append(f"servers: TP{tp} over {span} node(s) each, {engine_mem.total / GIB:.1f} GiB per GPU "
                         f"({srv.quantization if srv.quantization != 'none' else srv.dtype} weights "
                         f"{engine_mem.weights / GIB:.1f} GiB)")
    return learner_mem, engine_mem, notes


def build_plan(cfg: LaunchConfig, alloc: Allocation, *, raw: dict, config_path: str,
               overrides: list[str], python: str = sys.executable, engine_python: str | None = None,
               exp: ExperimentConfig | None = None) -> LaunchPlan:
    """Place learners and engines on ``alloc`` (raises ValueError naming the key on a bad fit).

    ``exp``: the typed experiment the launcher built once (every section the plan reads comes
    from it; ``cfg`` is its ``launch`` section); None = the sections of ``raw`` (callers that hold
    only a dict). ``raw`` itself only fills ``{cfg:key}`` placeholders."""
    exp = dataclasses.replace(exp if exp is not None else experiment_from_dict(raw, whole=False), launch=cfg)
    srv, gpus, job = exp.inference.server, alloc.gpus_per_node, alloc.job_id
    run_dir = Path(cfg.run_dir.replace("{job_id}", job))
    engines_file = run_dir / "engines.json"
    # The servers' API key: the YAML's own key file, or one written for this launch (the YAML's
    # inline key, else a random one) -- every launch protects its servers, and the key never
    # reaches a command line or a log (utils.secrets).
    inf = exp.inference
    secrets_dir = None if inf.api_key_file else run_dir / "secrets"
    key_file = inf.api_key_file or str(secrets_dir / secrets.KEY_FILE)
    # the user's own key file: SGLang reads a YAML next to it
    sglang_secret = str(secrets_dir / secrets.SGLANG_CONFIG) if secrets_dir else \
        str(Path(key_file).with_name(secrets.SGLANG_CONFIG))
    if secrets_dir is not None:  # learners read the key from the file, never from the YAML
        overrides = [*overrides, f"inference.api_key_file={key_file}", "inference.api_key=null"]
    # Checkpoint-and-stop on SIGUSR1/SIGTERM goes through the trainer's stop file.
    stop_file = Path(exp.trainer.stop_file or run_dir / "STOP")
    overrides = [*overrides, f"trainer.stop_file={stop_file}"]
    n_learn, split_note = learner_node_count(exp, alloc)
    nproc, world = _learner_world(exp, gpus, n_learn)
    layout = ParallelLayout.build(exp.parallel, world)
    nodes = place_local(alloc, exp, world) if alloc.local else place_cluster(alloc, exp, n_learn)

    env = {**cfg.env, **cfg.nccl_env}
    # The package is used from the source tree: make `-m areal_mega...` importable on every node.
    env["PYTHONPATH"] = str(REPO_ROOT)
    engine_python = engine_python or srv.python
    ports = engine_ports(alloc, exp, nodes.engine_slots)
    addresses = [f"{addr}:{port}" for (_, addr, _), port in zip(nodes.engine_slots, ports)]
    base = {"python": python, "engine_python": engine_python, "config": config_path,
            "run_dir": str(run_dir), "job_id": job, "engines_file": str(engines_file),
            "engine_addresses": "[" + ",".join(addresses) + "]", "num_engines": len(nodes.engine_slots),
            "stop_file": str(stop_file)}
    engines = engine_procs(exp, alloc, nodes, ports, env=env, base=base, raw=raw, overrides=overrides, python=python,
                           engine_python=engine_python, run_dir=run_dir, sglang_secret=sglang_secret,
                           first_gpu=world if alloc.local else 0)
    # Locally a free port unless one is set: two launches on one machine (a user's, a test's) must
    # not race for torchrun's default.
    master_port = cfg.learner.master_port or (service_ports(1)[0] if alloc.local else DEFAULT_MASTER_PORT)
    learners = learner_procs(exp, alloc, nodes, nproc=nproc, world=world, env=env, base=base, raw=raw,
                             overrides=overrides, python=python, run_dir=run_dir, master_port=master_port)
    learner_mem, engine_mem, mem_notes = memory_verdict(exp, layout, gpus, engines=bool(engines))
    notes = ([split_note] if split_note else []) + list(nodes.notes) + mem_notes
    return LaunchPlan(
        job_id=job, run_dir=run_dir, allocation=alloc, layout=layout, learner_nodes=nodes.learner_nodes,
        engine_nodes=tuple(dict.fromkeys(e.node for e in engines)),
        master_addr=f"{nodes.master_addr}:{master_port}", engines=engines, learners=learners,
        engines_file=engines_file, env=env, learner_memory=learner_mem, engine_memory=engine_mem,
        checks_gpu_memory=gpus > 0, notes=tuple(notes), secrets_dir=secrets_dir, api_key=inf.api_key,
        stop_file=stop_file, preempt_grace_s=cfg.preempt_grace_s,
    )
