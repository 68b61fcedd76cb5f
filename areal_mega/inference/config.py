"""Configuration of the inference pool: how SGLang servers are launched and how the client
talks to them. Owned by ``areal_mega.inference``; the experiment config nests ``InferenceConfig``
under ``inference``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from areal_mega.utils.secrets import read_api_key

__all__ = ["InferenceClientConfig", "InferenceConfig", "SGLangServerConfig"]


@dataclass
class SGLangServerConfig:
    """Launch settings of ONE SGLang server (every server of the pool gets the same ones)."""

    python: str = "python"
    """Python interpreter that has SGLang installed (its own venv or container; the learner env
    does not need SGLang). On CPU dev machines: the output of ``tools/env/make_venv.sh sglang``
    + ``/bin/python``."""
    model_path: str = ""
    """HF model directory the server loads at start (and again on restart after a crash)."""
    host: str = "127.0.0.1"
    """Address the server binds and the client connects to. Keep loopback unless the learner
    runs on another node; on multi-node Slurm use the node's own address."""
    port: int = 0
    """First port; server i uses ``port + i``. 0 picks free ports at launch."""
    tp_size: int = 1
    """Tensor-parallel size of one server (GPUs per server)."""
    dtype: str = "bfloat16"
    """Weight/activation dtype (SGLang ``--dtype``)."""
    quantization: Literal["none", "fp8"] = "none"
    """Serving weights' format. ``fp8``: DeepSeek-V3's blockwise FP8 (128 x 128 blocks, e4m3,
    fp32 per-block scales; SGLang ``--quantization fp8``): ``model_path`` is a block-FP8
    checkpoint (its config.json's ``quantization_config`` names ``weight_block_size: [128,
    128]``), server memory and sync bytes are priced at ~1 byte per linear weight
    (areal_mega/weight_sync/fp8.py). The broadcast sync quantizes on the learner (bit-equal to
    SGLang's quantizer) and sends fp8 + ``weight_scale_inv``; ``weight_sync.mode`` reshard / disk,
    a family without a quantized layout (fp8.FP8_FAMILIES) and a ``tp_size`` whose shards are not
    whole 128-blocks are refused in one line."""
    device: str = "cuda"
    """``cuda`` on clusters, ``cpu`` on CPU-only machines (torch_native attention backend)."""
    max_total_tokens: int | None = None
    """KV-cache capacity in tokens (``--max-total-tokens``). Set it on CPU: without it SGLang
    reserves ~15 GB. None lets SGLang size the cache from ``mem_fraction_static``."""
    mem_fraction_static: float | None = None
    """Fraction of accelerator memory for weights + KV cache (``--mem-fraction-static``)."""
    random_seed: int | None = 1
    """Sampling seed of the server (``--random-seed``); server i gets ``random_seed + i``."""
    skip_tokenizer_init: bool = True
    """The client sends token ids and reads token ids, so the server needs no tokenizer
    (``--skip-tokenizer-init``); turn it off only for text-based endpoints."""
    sleep_on_idle: bool = True
    """Let an idle server's scheduler wait on its sockets (``--sleep-on-idle``) instead of
    polling them in a loop: a busy-polling TP2 CPU server holds ~1.4 cores while it has nothing to
    do (tools/bench_weight_sync.py reports it), which on a small host is taken from the learner.
    Waking on a request costs no measurable latency (docs/inference.md). False: SGLang's default."""
    reshard_receiver: bool = True
    """Register areal_mega's reshard receiver (``--custom-weight-loader
    areal_mega_sglang_reshard.receive``) when the server's Python has it (tools/env/make_venv.sh
    installs it; looked up in that environment's site-packages or on its PYTHONPATH, without
    running it). weight_sync.mode reshard needs it; a server without it is synced by broadcast.
    Containers: docs/weight_sync.md."""
    extra_args: list[str] = field(default_factory=list)
    """More SGLang command-line arguments, appended verbatim (e.g. ``["--attention-backend",
    "torch_native"]``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process (e.g. ``OMP_NUM_THREADS: "1"`` on CPU,
    ``CUDA_VISIBLE_DEVICES`` on a shared node)."""
    startup_timeout_s: float = 300.0
    """How long to wait for a started server to answer its health check before failing with the
    tail of its log."""
    stop_grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping a server's process group."""
    log_dir: str = ""
    """Directory for the server logs (``sglang-<port>.log``); empty means a fresh temp dir."""

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"quantization: must be 'none' or 'fp8', got {self.quantization!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens: must be >= 1, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s: must be > 0, got {self.startup_timeout_s}")
        if self.stop_grace_s < 0:
            raise ValueError(f"stop_grace_s: must be >= 0, got {self.stop_grace_s}")


@dataclass
class InferenceClientConfig:
    """Behaviour of the async client (``InferencePool``) towards the servers."""

    request_timeout_s: float = 3600.0
    """Wall-clock limit for one /generate call. A call that exceeds it counts as a failure of
    that server and the request is retried elsewhere."""
    connect_timeout_s: float = 10.0
    """Limit for opening a TCP connection to a server."""
    control_timeout_s: float = 600.0
    """Limit for control calls (pause, weight updates, model info)."""
    max_retries: int = 3
    """How many times one request may fail on a server (connection error, 5xx, timeout) before
    agenerate raises. Interruptions by pause/weight updates are not failures and not counted."""
    retry_backoff_s: float = 0.5
    """Sleep before a retry after a failure, doubled after each failure of the same request."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How ``pause()`` treats in-flight requests: ``abort`` returns them at once with their partial
    tokens (the client resubmits prompt + partial tokens after ``resume()``); ``retract`` and
    ``in_place`` hold them on the server (KV freed / kept) and continue after ``resume()``."""
    health_check_interval_s: float = 2.0
    """Period of the background health check; a server that fails it is taken out of rotation
    and, if the pool manages it, restarted."""
    health_check_timeout_s: float = 10.0
    """Limit for one health-check call."""
    health_check_failures: int = 3
    """Consecutive failed health checks before a server whose process is alive leaves the
    rotation (one slow answer on a loaded machine is not a dead server; an exited process, a
    refused connection or a failed request is acted on at once)."""
    max_connections_per_server: int = 0
    """Cap on concurrent HTTP connections to one server; 0 means unlimited (SGLang batches
    everything it receives, so the cap is only useful to protect a small server)."""
    keepalive_timeout_s: float = 2.0
    """How long an idle HTTP connection to a server is kept for reuse. Must stay below the
    server's own keep-alive timeout (SGLang/uvicorn: 5 s), or a request can be sent on a
    connection the server is closing at that moment."""
    restart_dead_servers: bool = True
    """Restart a managed server that died (its process exits or it fails the health check); under
    the launcher, its supervisor restarts a server whose process exits -- the whole server, every
    node of one spanning nodes -- and the pool resyncs it once it answers."""
    max_restarts: int = 3
    """How many restarts of one server are attempted before it is left out for good (the
    launcher's restarts too)."""
    initial_version: int = 0
    """Policy version of the weights the servers start with (passed as ``--weight-version``)."""
    segment_tokens: int = 8192
    """Ask a server for at most this many new tokens per /generate call, continuing the request
    (prompt + tokens so far) until it ends: a server that dies mid-request then costs at most
    one segment; the tokens of the segments it returned are kept and generation continues on
    another server. 0 = one call per request (a dead server's in-progress call is lost whole).
    Each segment re-sends the prefix (a prefix-cache hit on the server): the default leaves
    requests of up to 8192 tokens one call and bounds a 32k-token trace's loss to a quarter."""

    def validate(self) -> None:
        for key in ("request_timeout_s", "connect_timeout_s", "control_timeout_s",
                    "health_check_interval_s", "health_check_timeout_s", "keepalive_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.health_check_failures < 1:
            raise ValueError(f"health_check_failures: must be >= 1, got {self.health_check_failures}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")
        if self.segment_tokens < 0:
            raise ValueError(f"segment_tokens: must be >= 0, got {self.segment_tokens}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s: must be >= 0, got {self.retry_backoff_s}")
        if self.max_connections_per_server < 0:
            raise ValueError(f"max_connections_per_server: must be >= 0, got {self.max_connections_per_server}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")


@dataclass
class InferenceConfig:
    """The inference pool: ``num_servers`` managed SGLang servers, or existing ones at
    ``addresses``."""

    server: SGLangServerConfig = field(default_factory=SGLangServerConfig)
    """Launch settings, used when the pool starts its own servers."""
    client: InferenceClientConfig = field(default_factory=InferenceClientConfig)
    """Client behaviour (timeouts, retries, pause mode, failover)."""
    num_servers: int = 1
    """How many servers to launch (ignored when ``addresses`` is set)."""
    addresses: list[str] = field(default_factory=list)
    """``host:port`` of servers started by someone else (e.g. a Slurm het-job component); when
    set, the pool launches nothing and cannot restart them."""
    api_key: str | None = None
    """If set, servers require it (passed to SGLang in a 0600 config file, never on its command
    line) and the client sends ``Authorization: Bearer <key>`` on every call. Prefer
    ``api_key_file``: a key in the YAML is as secret as the YAML."""
    api_key_file: str | None = None
    """A file holding the API key (the launcher writes ``<run_dir>/secrets/api_key``, 0600, for
    every launch that sets no key itself). Exclusive with ``api_key``."""

    def resolved_api_key(self) -> str | None:
        """``api_key``, or the key read from ``api_key_file``, or None (no key)."""
        if self.api_key_file:

            return read_api_key(self.api_key_file)
        return self.api_key

    def validate(self) -> None:
        if self.num_servers < 1 and not self.addresses:
            raise ValueError(f"num_servers: must be >= 1, got {self.num_servers}")
        if not self.addresses and not self.server.model_path:
            raise ValueError("server.model_path: must name an HF model directory (or set addresses)")
        for a in self.addresses:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"addresses: {a!r} is not host:port")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must be non-empty when set (use null to disable)")
        if self.api_key is not None and self.api_key.startswith("-"):
            raise ValueError("api_key: must not start with '-' (SGLang would read it as an option)")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("api_key_file: set either api_key or api_key_file, not both")


def check_pool_named(inference: object) -> None:
    """A pool given by name that the experiment's ``servers`` did not resolve (ExperimentConfig
    replaces known names by their definitions): the one-line error."""
    if isinstance(inference, str):
        raise ValueError(f"inference: {inference!r} names no pool of the experiment's servers section")
