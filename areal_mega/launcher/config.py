"""Settings the launcher reads: the ``launch:`` section of an experiment YAML.

The launcher parses only this section (plus ``{cfg:dotted.key}`` lookups that command
templates make into the rest of the file); every other section belongs to the trainer and the
inference servers, which receive the same YAML path and the non-``launch.`` overrides.

Command templates are lists of strings. ``{name}`` placeholders are filled from the plan
(see :data:`areal_mega.launcher.plan.PLACEHOLDERS`); ``{cfg:a.b}`` reads key ``a.b`` of the
YAML; an element that is exactly ``{overrides}`` expands to the overrides given to the launcher
(minus the ``launch.`` ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_mega.simulator.costs import ClusterCostModel, WorkloadModel

__all__ = ["EngineLaunchConfig", "LaunchConfig", "LearnerLaunchConfig", "PlannerLaunchConfig"]


@dataclass
class LearnerLaunchConfig:
    """Where and how the megatron learner ranks run (one torchrun per learner node). What the
    learner IS -- layout, model settings, micro-batch budget -- is the trainer's own config
    (``parallel``, ``actor``, ``critic``, ``algorithm``); the memory estimate reads it there."""

    num_nodes: int | None = None
    """Nodes given to learners (the first nodes of the allocation). None = follow the
    allocation: on GPU nodes the throughput planner (``launch.planner``) picks the split for
    the nodes Slurm gave, keeping the trainer's ``parallel`` TP/PP/CP (data parallel = what the
    learner nodes leave) and ``rollout.max_staleness``, among the splits whose learner plan fits
    ``gpu_memory_gib``; with ``engine.num_nodes`` set, the nodes it leaves; locally and on CPU
    nodes, 1."""
    nproc_per_node: int | None = None
    """Ranks per learner node; None = the node's GPUs, or on CPU nodes the model-parallel size
    (tp*pp*cp*dp) divided by num_nodes."""
    master_port: int = 0
    """torchrun static-rendezvous port on the first learner node; 0 = a free port when launching
    on this machine, 29500 under Slurm."""
    command: list[str] = field(default_factory=lambda: [
        "-m", "areal_mega.cli", "train", "--config", "{config}",
        "inference.addresses={engine_addresses}", "{overrides}",
    ])
    """What torchrun runs on every rank (after torchrun's own options: a script or ``-m mod``).
    The default hands the trainer the planned engines through its ``inference.addresses``. A
    researcher's own entry (a copy of ``areal_mega/trainer/main.py``, docs/extending.md) is the
    same list with the script in place of ``-m areal_mega.cli train``."""
    reserved_gib: float = 6.0
    """Per-GPU headroom: CUDA context, NCCL buffers, allocator fragmentation, weight-sync bucket."""

    def validate(self) -> None:
        if self.num_nodes is not None and self.num_nodes < 1:
            raise ValueError(f"num_nodes: must be null or >= 1, got {self.num_nodes}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node: must be >= 1, got {self.nproc_per_node}")
        if self.reserved_gib < 0:
            raise ValueError(f"reserved_gib: must be >= 0, got {self.reserved_gib}")
        if not self.command:
            raise ValueError("command: must not be empty")


@dataclass
class EngineLaunchConfig:
    """Where the inference servers run (one srun step per server). What a server is -- model,
    TP size, dtype, KV-cache size -- is the ``inference.server`` section's (SGLangServerConfig);
    the launcher reads it for placement and the memory estimate and overrides only host/port."""

    num_nodes: int | None = None
    """Nodes for engines; None = every node the learners do not use (local mode: ignored)."""
    num_engines: int | None = None
    """Servers in total; None = fill the engine nodes (GPUs // tp_size each, 1 per CPU node)."""
    command: list[str] | None = None
    """Server command template; None = SGLang's, built by areal_mega.inference.server from
    ``inference.server`` with the plan's host and port. It must serve HTTP on {host}:{port}."""
    default_port: int = 30000
    """First server port on each node under Slurm when inference.server.port is 0 (the k-th
    server of a node uses port + k; locally, port 0 means free ports)."""
    dist_init_port: int = 29700
    """Port on a multi-node server's first node where its nodes rendezvous (SGLang
    ``--dist-init-addr``), when inference.server.tp_size exceeds a node's GPUs."""
    health_path: str = "/health"
    """HTTP path answering 200 once the server is ready; "" = ready when the port accepts."""
    startup_timeout_s: float = 1800.0
    """Give up on a server that is not ready after this long (70B weights load for minutes)."""
    min_ready: int | None = None
    """Start learners once this many servers are ready and the rest are dead; None = all of them."""
    default_mem_fraction_static: float = 0.85
    """Memory share assumed for the estimate when inference.server.mem_fraction_static is null."""
    kv_cache_dtype_bytes: int = 2
    """Bytes per KV element (2 = bf16, 1 = fp8)."""

    def validate(self) -> None:
        if self.num_nodes is not None and self.num_nodes < 0:
            raise ValueError(f"num_nodes: must be >= 0, got {self.num_nodes}")
        if self.num_engines is not None and self.num_engines < 0:
            raise ValueError(f"num_engines: must be >= 0, got {self.num_engines}")
        if self.command is not None and not self.command:
            raise ValueError("command: must be null or a non-empty list")
        if self.min_ready is not None and self.min_ready < 0:
            raise ValueError(f"min_ready: must be >= 0, got {self.min_ready}")


@dataclass
class PlannerLaunchConfig:
    """Inputs of the throughput planner (``areal_mega.simulator``, docs/simulator.md): read by
    ``areal-mega plan``, by the dry run's recommendation, and by the launcher itself when
    ``learner.num_nodes`` is null (the split follows the allocation). One set of figures, so
    the split a launch uses is the one the plan printed."""

    cost: ClusterCostModel = field(default_factory=ClusterCostModel)
    """GPU and fabric figures (defaults: H100 SXM 80 GB, NDR InfiniBand; each default's source
    in docs/simulator.md). ``areal-mega plan ... cost.<field>=v`` overrides one."""
    workload: WorkloadModel = field(default_factory=WorkloadModel)
    """What the task generates (length distribution, prompt length, rejected share); set it from
    a pilot run (``workload.lengths_from: <run>/metrics.jsonl``)."""
    margin: float = 0.10
    """A fixed split (``learner.num_nodes`` set) whose predicted samples/s falls more than this
    fraction below the planner's recommendation is flagged by the dry run and the launch (a
    WARNING line on stderr): a warning, not a refusal -- the config may know what the cost model
    does not."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin: must be in [0, 1), got {self.margin}")


@dataclass
class LaunchConfig:
    """The ``launch:`` section: placement of learners and engines, their commands, memory limits."""

    model_config: dict[str, Any] | None = None
    """The model's HF ``config.json`` content, inline, for planning where ``model_path`` is not
    readable (a laptop); None = read ``<model_path>/config.json`` (top-level ``model_path``, else
    ``inference.server.model_path``). Either way it goes through the trainer's model adapter
    (areal_mega.models.get_adapter), never a launcher-side parser."""
    learner: LearnerLaunchConfig = field(default_factory=LearnerLaunchConfig)
    """Learner placement, command and activation settings."""
    engine: EngineLaunchConfig = field(default_factory=EngineLaunchConfig)
    """Inference-server placement and command."""
    planner: PlannerLaunchConfig = field(default_factory=PlannerLaunchConfig)
    """Throughput-planner cost figures and workload (the split when learner.num_nodes is null)."""
    gpus_per_node: int | None = None
    """GPUs per node; None = from Slurm (SLURM_GPUS_ON_NODE) or 0 for the local launcher."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU; plans whose estimate exceeds it are refused."""
    run_dir: str = "runs/launch-{job_id}"
    """Job directory on the shared filesystem (logs, engine rendezvous files); {job_id} is filled."""
    env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})
    """Extra environment for every learner and engine process."""
    nccl_env: dict[str, str] = field(default_factory=dict)
    """NCCL's own settings for weight sync and learner collectives (e.g. NCCL_SOCKET_IFNAME,
    NCCL_IB_HCA); exported to learners and engines alike."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun options for every step (site specifics: --mpi, --container-image, ...)."""
    poll_interval_s: float = 0.5
    """How often the supervisor checks its processes."""
    stop_grace_s: float = 15.0
    """After SIGTERM, wait this long before SIGKILL."""
    preempt_grace_s: float = 300.0
    """On SIGUSR1 or SIGTERM (Slurm's time-limit warning ``--signal=B:USR1@N``, a preemption) the
    launcher asks the learners to finish their step and checkpoint (it creates the trainer's
    stop file) and waits up to this long for them before stopping everything. It then exits with
    EXIT_REQUEUE (75), which launch/*.sh turn into ``scontrol requeue``. Keep it below the
    ``--signal`` lead time minus ``stop_grace_s``; the dry run prints it."""
    log_tail_lines: int = 40
    """Lines of a failed process's log printed by the launcher."""

    def validate(self) -> None:
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node: must be >= 0, got {self.gpus_per_node}")
        if self.preempt_grace_s < 0:
            raise ValueError(f"preempt_grace_s: must be >= 0, got {self.preempt_grace_s}")
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib: must be > 0, got {self.gpu_memory_gib}")
        for key in list(self.env) + list(self.nccl_env):
            if not key or "=" in key:
                raise ValueError(f"env: invalid variable name {key!r}")
