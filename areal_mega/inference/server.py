"""SGLang server processes: command line from config, start, wait for health, stop, restart.

Each server is one process tree (SGLang forks a scheduler per TP rank and a detokenizer), started,
stopped and tied to its parent's life by ``areal_mega.utils.procs`` -- never signalled by name.

    servers = launch_servers(cfg)          # all start in parallel, then all are awaited
    ...
    for s in servers: s.stop()

This module is synchronous on purpose (subprocess + sglang_api's blocking client): the async pool calls ``restart()``
through ``asyncio.to_thread`` so a restart never blocks the event loop.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from areal_mega.inference import sglang_api
from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.sglang_api import SGLangClient, SGLangError
from areal_mega.utils import procs
from areal_mega.utils.logs import attempt_tail, open_attempt
from areal_mega.utils.secrets import sglang_key_config, write_private


BIND_FAILED = b"address already in use"
"""What SGLang (uvicorn) logs when its HTTP port is taken."""


class ServerStartError(RuntimeError):
    """A server did not become healthy; the message carries the tail of its log."""


# Set by torchrun / torch.distributed.elastic in a learner rank's environment. A server started
# from a learner (the trainer's pool) must not inherit them: SGLang's own process-group init reads
# RANK / WORLD_SIZE / MASTER_* and would wait forever for the learner's world to join it.
_TORCH_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_base_env() -> dict[str, str]:
    """This process's environment minus torch.distributed's rendezvous variables."""
    return {k: v for k, v in os.environ.items()
            if k not in _TORCH_DIST_ENV and not k.startswith(("TORCHELASTIC_", "TORCH_NCCL_"))}


@dataclass(frozen=True)
class ServedLora:
    """LoRA adapters the servers serve (weight_sync.lora adapter, docs/lora.md): each server starts
    with LoRA enabled for adapters of at most ``max_rank`` on ``target_modules``, one adapter per
    batch, and every generate request names ``name`` (the one adapter the weight sync loads)."""

    name: str
    max_rank: int
    target_modules: tuple[str, ...]

    def launch_args(self) -> list[str]:
        # torch_native: the backend SGLang 0.5.23 runs on CPU (tested); GPUs may append another
        # --lora-backend in inference.server.extra_args (argparse keeps the last one).
        return ["--enable-lora", "--max-lora-rank", str(self.max_rank),
                "--lora-target-modules", *self.target_modules, "--lora-backend", "torch_native",
                "--max-loras-per-batch", "1"]


def build_launch_command(
    cfg: SGLangServerConfig,
    port: int,
    *,
    secret_config: str | None = None,
    weight_version: int | str = 0,
    random_seed: int | None = None,
    capture_routes: bool = False,
    reshard_receiver: bool = False,
    lora: ServedLora | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
) -> list[str]:
    """The ``python -m sglang.launch_server ...`` argv for one server (pure; unit-tested).
    ``capture_routes``: MoE routing replay from the rollout (``actor.model.moe_routing_replay:
    rollout``) -- the server records the experts of every token (``--enable-return-routed-experts``).
    ``reshard_receiver``: register areal_mega's receiver as a custom weight loader (weight_sync
    mode reshard). ``lora``: serve LoRA adapters (weight_sync.lora adapter). ``nnodes`` > 1: this is node ``node_rank`` of one server spanning ``nnodes``
    nodes (SGLang's multi-node mode; ``tp_size`` counts every node's GPUs), which rendezvous at
    ``dist_init_addr`` (host:port of node 0, the only one that serves HTTP)."""
    cmd = [
        cfg.python, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(cfg.tp_size),
        "--dtype", cfg.dtype,
        "--device", cfg.device,
        # The version every token sampled by these weights reports (meta_info weight_versions).
        "--weight-version", str(weight_version),
    ]
    if cfg.quantization != "none":
        cmd += ["--quantization", cfg.quantization]
    if nnodes > 1:
        if not dist_init_addr or not 0 <= node_rank < nnodes:
            raise ValueError(f"a server spanning {nnodes} nodes needs dist_init_addr and 0 <= node_rank < nnodes")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if cfg.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if random_seed is not None:
        cmd += ["--random-seed", str(random_seed)]
    if cfg.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    if cfg.sleep_on_idle:
        cmd += ["--sleep-on-idle"]
    if capture_routes:
        cmd += ["--enable-return-routed-experts"]
    if reshard_receiver:
        cmd += ["--custom-weight-loader", RESHARD_RECEIVER]
    if lora is not None:
        cmd += lora.launch_args()
    if secret_config is not None:
        # SGLang's --config YAML carries the API key (utils.secrets): never the key on argv.
        cmd += ["--config", secret_config]
    return cmd + list(cfg.extra_args)


RESHARD_RECEIVER = "areal_mega_sglang_reshard.receive"
"""The receiver's loader path (tools/env/sglang_reshard.py, installed as areal_mega_sglang_reshard)."""


@functools.lru_cache(maxsize=None)
def has_reshard_receiver(python: str, pythonpath: str | None = None) -> bool:
    """Does ``python`` (an SGLang environment) have areal_mega's receiver module? A registered
    loader that cannot be imported would kill the server at its first weight sync, so the flag is
    added only when this holds. Read from the file system, never by running ``python`` (a
    wrapper script or a stalled interpreter must not hold up a launch): the module in the
    environment's site-packages (``<python>/../../lib/python3*/{site,dist}-packages``, where
    make_venv.sh installs it; /usr/local and /usr for a container's system Python) or on the
    server's PYTHONPATH."""
    name = "areal_mega_sglang_reshard.py"
    dirs = [Path(d) for d in (pythonpath or "").split(os.pathsep) if d]
    for root in (Path(python).parent.parent, Path("/usr/local"), Path("/usr")):
        for kind in ("site-packages", "dist-packages"):
            dirs += root.glob(f"lib/python3*/{kind}")
    return any((d / name).is_file() for d in dirs)


def wants_reshard_receiver(cfg: SGLangServerConfig) -> bool:
    """Register the receiver for a server of ``cfg``: asked for and installed in its Python (the
    local launcher and the Slurm plan both decide here)."""
    return cfg.reshard_receiver and has_reshard_receiver(cfg.python, cfg.env.get("PYTHONPATH"))


class SGLangServer:
    """One SGLang server process tree at ``host:port``.

    Invariants: ``self._proc`` is None or the Popen of the current (last started) launch; the
    process group id equals that Popen's pid (``start_new_session=True``); ``stop()`` returns only
    once the group is gone or was SIGKILLed.
    """

    def __init__(
        self,
        cfg: SGLangServerConfig,
        port: int,
        *,
        api_key: str | None = None,
        random_seed: int | None = None,
        log_dir: str | Path | None = None,
        capture_routes: bool = False,
        lora: ServedLora | None = None,
    ) -> None:
        self.cfg = cfg
        self.host = cfg.host
        self.capture_routes = capture_routes
        self.lora = lora
        self.port = port
        self.random_seed = random_seed
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="sglang-logs-")) / f"sglang-{port}.log"
        self._secret_config: str | None = None
        if api_key is not None:
            path = self.log_path.with_name(f"sglang-{port}.secret.yaml")
            write_private(path, sglang_key_config(api_key))
            self._secret_config = str(path)
        self.num_starts = 0
        self._log_seen = 0
        self._proc: subprocess.Popen | None = None
        # close() may race with a restart running in a worker thread: the lock + flag make sure
        # nothing is started after close().
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self, weight_version: int | str = 0) -> list[str]:
        return build_launch_command(
            self.cfg, self.port, secret_config=self._secret_config, weight_version=weight_version,
            random_seed=self.random_seed, capture_routes=self.capture_routes, lora=self.lora,
            reshard_receiver=wants_reshard_receiver(self.cfg),
        )

    def start(self, weight_version: int | str = 0) -> None:
        """Spawn the server (returns at once; see ``wait_ready``)."""
        assert self._proc is None or self._proc.poll() is not None, "server already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**server_base_env(), **self.cfg.env}
        with self._lock:
            if self._closed:
                raise ServerStartError(f"SGLang server {self.address} was closed; not starting it again")
            # A header per start: a failure's log tail shows this start only (utils/logs.py).
            with open_attempt(self.log_path, self.command(weight_version)) as log:
                self._log_seen = log.tell()  # this start's output begins here (_bind_failed)
                # Its own session, behind the die-with-parent wrapper (areal_mega.utils.procs): a
                # trainer killed with SIGKILL leaves no server holding ports and accelerators.
                self._proc = procs.spawn(self.command(weight_version), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, redact=self._secret_config)
        self.num_starts += 1

    def is_running(self) -> bool:
        """True while the main server process lives (it does not prove the server is healthy)."""
        return self._proc is not None and self._proc.poll() is None

    def wait_exit(self, timeout_s: float) -> bool:
        """Block until the server's process tree leader has exited (True) or ``timeout_s`` passed."""
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def health_ok(self, timeout_s: float = 5.0) -> bool:
        """GET /health == 200. SGLang answers 503 while starting/warming up; /health is exempt
        from the API key, so this works on key-protected servers too."""
        try:
            SGLangClient(self.url, timeout_s=timeout_s).send(sglang_api.health())
            return True
        except (SGLangError, OSError):
            return False

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until /health answers 200; raise ServerStartError (with the log tail) if the
        process exits or ``timeout_s`` (default ``cfg.startup_timeout_s``) passes."""
        deadline = time.monotonic() + (timeout_s or self.cfg.startup_timeout_s)
        while time.monotonic() < deadline:
            if self._bind_failed():
                # SGLang logs the failed bind and lingers in its warm-up for minutes: fail now
                self.stop()
                raise ServerStartError(f"SGLang server {self.address}: port {self.port} is already in use by another "
                                       f"process (inference.server.port); log {self.log_path}")
            if not self.is_running():
                raise ServerStartError(
                    f"SGLang server {self.address} exited with code "
                    f"{self._proc.returncode if self._proc else None} during startup; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.health_ok(timeout_s=2.0):
                return
            time.sleep(0.5)
        raise ServerStartError(
            f"SGLang server {self.address} not healthy after {timeout_s or self.cfg.startup_timeout_s:.0f}s "
            f"(inference.server.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}"
        )

    def _bind_failed(self) -> bool:
        """Whether this start's log has SGLang's bind error; each call reads only what was
        written since the last (keeping an overlap, for a message split across two reads)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_seen)
                new = f.read()
        except OSError:
            return False
        self._log_seen += max(0, len(new) - len(BIND_FAILED))
        return BIND_FAILED in new.lower()

    def log_tail(self, num_lines: int = 40) -> str:
        # SGLang logs its full server_args on one ~20 kB line: keep each line readable.
        return attempt_tail(self.log_path, num_lines, max_line_chars=400)

    def stop(self) -> None:
        """SIGTERM the server's tree, SIGKILL what is left after ``cfg.stop_grace_s``; returns once
        the tree is gone, so a restart right after finds the port (and memory) free."""
        if self._proc is None:
            return
        procs.stop_tree(self._proc, self.cfg.stop_grace_s)
        self._proc = None

    def close(self) -> None:
        """Stop for good: a restart racing with this (in another thread) will not start it again."""
        with self._lock:
            self._closed = True
        self.stop()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the main server process only (tests use it to simulate a crash): the
        die-with-parent wrapper's child."""
        assert self._proc is not None
        os.kill(procs.main_pid(self._proc), sig)

    def restart(self, weight_version: int | str = 0) -> None:
        """Stop what is left of this server, start it again on the same port, wait until healthy."""
        self.stop()
        self.start(weight_version)
        self.wait_ready()


def make_servers(cfg: InferenceConfig, *, capture_routes: bool = False,
                 lora: ServedLora | None = None) -> list[SGLangServer]:
    """The ``cfg.num_servers`` server objects, not started yet. Server i listens on
    ``server.port + i`` (or a free port when ``server.port == 0``) and samples with seed
    ``server.random_seed + i``; ``capture_routes``, ``lora``: see ``build_launch_command``."""
    scfg = cfg.server
    log_dir = scfg.log_dir or tempfile.mkdtemp(prefix="sglang-logs-")
    key = cfg.resolved_api_key()
    servers = []
    auto = procs.service_ports(cfg.num_servers, scfg.host)
    for i in range(cfg.num_servers):
        port = scfg.port + i if scfg.port else auto[i]
        seed = None if scfg.random_seed is None else scfg.random_seed + i
        servers.append(SGLangServer(scfg, port, api_key=key, random_seed=seed, log_dir=log_dir,
                                    capture_routes=capture_routes, lora=lora))
    return servers


def launch_servers(cfg: InferenceConfig, *, capture_routes: bool = False,
                   lora: ServedLora | None = None) -> list[SGLangServer]:
    """Start ``cfg.num_servers`` servers in parallel and wait until all are healthy. If any
    fails to come up, all are stopped and the first error (with its log tail) is raised."""
    servers = make_servers(cfg, capture_routes=capture_routes, lora=lora)
    try:
        for s in servers:
            s.start(weight_version=cfg.client.initial_version)
        for s in servers:  # they boot concurrently; waiting in order costs nothing extra
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
