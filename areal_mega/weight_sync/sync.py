"""Weight sync as the trainer uses it: a :class:`WeightSync` from ``megatron_weight_sync(cfg, ...)``,
then ``set_targets(urls)`` / ``sync(version)`` / ``close()`` on every learner rank.

One class per transport (``weight_sync.mode``, chosen once by ``megatron_weight_sync``):
:class:`BroadcastSync` (full HF tensors, one sender per stage), :class:`ReshardSync` (every rank
sends SGLang's own shards; a server without the receiver gets a broadcast instead) and
:class:`DiskSync` (safetensors + /update_weights_from_disk). :class:`TransportBase` holds what they
share. A sync never pauses generation: the caller does (the trainer through its rollout service).
One broadcast sync, all learner ranks calling ``sync`` collectively::

    rank 0 (stage-0 sender)        stage-s sender (tp=0,cp=0,dp=0)     its TP peers (dp=0,cp=0)
    check plan vs servers' models
    ---------------------- agree (all ranks; a mismatch raises here, nothing sent) -----------
    begin update session
    ---------------------- agree ---------------------------------------------------------------
    for each stage s in order:      export(): gather TP shards   <->  export(): gather (collective)
                                    per bucket: HTTP + broadcast
    ---------------------- agree after each stage (turns) --------------------------------------
    end update session
    ---------------------- agree: every rank returns or raises the same error -------------------

Why stages take turns instead of broadcasting concurrently: every server handles weight-update
calls one at a time, in arrival order. If stage 0 and stage 1 both sent at once, two servers
could receive their calls in opposite orders and each block in a different group's collective
waiting for the other (a certain deadlock with NCCL). One sender per stage still holds: each
stage gathers and broadcasts its own tensors in its own group with the servers (no PP hop), and
the turn barrier is a tiny gloo all-gather among learner ranks.

The servers' ``weight_version`` changes with the LAST bucket of the last stage, so a server
reports the new version exactly when it holds the new weights; the caller bumps the learner's
version (``engine.set_version(version)``) after ``sync`` returns.
"""

from __future__ import annotations

import json
import os
import sys
import time
from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from areal_mega.parallel import ParallelLayout
from areal_mega.weight_sync.base import SyncStats, WeightSync
from areal_mega.weight_sync.config import WeightSyncConfig
from areal_mega.weight_sync.planner import (
    PlanMismatchError,
    SenderPlan,
    SyncPlan,
    TensorSpec,
    check_plan_against,
    dtype_name,
    plan_weight_sync,
)
from areal_mega.inference import sglang_api as api
from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.utils.distributed import resolve_backend
from areal_mega.utils.procs import free_port, host_address
from areal_mega.weight_sync.reshard import plan_reshard
from areal_mega.weight_sync.reshard_transport import RECEIVER, ReshardTransport, has_receiver
from areal_mega.weight_sync.sglang_layout import EngineLayout, check_syncable
from areal_mega.weight_sync.transport import BroadcastSender, WeightSyncError, _collect, check_bucket_tensors, send_all

ExportFn = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""Collective over this rank's stage TP group: yields this stage's full HF tensors in plan order
(tensors matter on the stage's TP rank 0 only)."""

ExpectedFn = Callable[[dict], Sequence[Any]]
"""HF config dict -> the full list of HF tensors (name, shape, dtype) a model with that config
has: the adapter's metadata function at TP1 x PP1."""


@dataclass(frozen=True)
class ReshardSource:
    """What the reshard mode needs from the learner: the model adapter (plans from metadata)
    and this rank's local megatron tensors (``local()[chunk][name]``, read at send time)."""

    adapter: Any
    local: Callable[[], list]
    dtype: str


@dataclass(frozen=True)
class LearnerSide:
    """What a transport reads from the learner: built once per rank by ``megatron_weight_sync``
    (identical on every rank but ``rank``, ``export`` and ``reshard.local``)."""

    layout: ParallelLayout
    """The learner's parallel layout."""
    rank: int
    """This rank in ``layout`` (= its rank in ``group``)."""
    group: Any
    """All learner ranks; control messages (tiny python objects) go over gloo: a gloo group over
    the same ranks is created when this one is not gloo (so the constructor is collective)."""
    plan: SyncPlan
    """Full HF tensors per pipeline stage, bucketed (planner.plan_weight_sync): what broadcast and
    disk send, and what every mode checks against the servers' models."""
    export: ExportFn
    """This rank's stage export (called on exporting ranks only: layout.exports)."""
    expected_fn: ExpectedFn | None = None
    """A server's HF config -> the tensors it expects; needed when ``check_model``."""
    hf_config: dict | None = None
    """config.json written next to a disk sync's files (None: copied from the first server's)."""
    reshard: ReshardSource | None = None
    """The adapter and local tensors the reshard transport plans and sends from."""


def server_expected_specs(server: SGLangClient, expected_fn: ExpectedFn) -> tuple[dict[str, TensorSpec], str]:
    """What ``server`` expects, from its model's config.json (model_path must be readable here:
    same host or shared filesystem) and its serving dtype. Returns (specs by name, description)."""
    info = server.model_info()
    model_path = info.get("model_path") or ""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        raise WeightSyncError(
            f"cannot check the plan against {server.url}: its model_path {model_path!r} has no config.json "
            "readable from the learner (set weight_sync.check_model=false to skip the check)"
        )
    hf_config = json.loads(cfg_file.read_text())
    dtype = server.capabilities().dtype
    if dtype in ("auto", "None", ""):
        dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    dtype = dtype_name("bfloat16" if dtype == "bf16" else dtype)
    specs = {}
    for item in expected_fn(hf_config):
        t = TensorSpec.of(item)
        fp8 = t.dtype == "float8_e4m3fn" or t.name.endswith("weight_scale_inv")  # fp8 weights + scales keep theirs
        specs[t.name] = t if fp8 else TensorSpec(t.name, t.shape, dtype)
    return specs, f"server {server.url} (model {model_path}, dtype {dtype})"


def _error(fn: Callable[[], Any]) -> str | None:
    """``fn()``'s exception as one line (for ``_agree`` to share with every rank), None if it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shared with every rank by the caller
        return f"{type(e).__name__}: {e}"
    return None


class TransportBase(WeightSync):
    """What the transports share: agreement across learner ranks, the plan check against the
    servers' models, the targets, and one sync's frame (check, connect, begin session, send, end
    session; a failure closes the sessions). A transport implements ``_connect`` and ``_send``.

    ``servers`` are the first targets; the trainer gives none and names each sync's targets with
    ``set_targets`` (from the rollout service's ``begin_update``). ``pause_mode`` is the mode the
    caller pauses the servers in (``inference.client.pause_mode``): in_place holds requests with
    their KV cache, which then is not flushed. ``api_key``: for clients made by ``set_targets``.
    """

    mode: str
    """The ``weight_sync.mode`` this class implements; SyncStats.mode: the one that ran (ReshardSync
    sets it per connection)."""

    def __init__(self, cfg: WeightSyncConfig, learner: LearnerSide, *, servers: Sequence[SGLangClient] = (),
                 pause_mode: str = "retract", api_key: str | None = None) -> None:
        cfg.validate()
        if cfg.mode != self.mode:
            raise ValueError(f"mode: {cfg.mode!r} is configured, {type(self).__name__} is the {self.mode!r} transport")
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode: {pause_mode!r} is not one of abort, retract, in_place")
        if cfg.check_model and learner.expected_fn is None:
            raise ValueError("check_model: needs expected_fn (the adapter's metadata for an HF config)")
        self.cfg, self.learner, self.plan = cfg, learner, learner.plan
        self.layout, self.rank = learner.layout, learner.rank
        self.flush_cache = pause_mode != "in_place"  # the radix cache cannot be flushed under held requests
        self.servers = list(servers)
        self._api_key = api_key
        self.stage = self.layout.coords(self.rank).pp
        self.exports = self.layout.exports(self.rank)  # dense dp=0/cp=0 replica, plus MoE expert owners
        self.stage_plan: SenderPlan | None = self.plan.stage_of_rank(self.rank)
        group = learner.group
        self._ctrl = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")
        self._connected = False
        self._session = False  # the servers want weight updates inside begin/end_weight_update

    # -- what a transport implements ------------------------------------------------------------
    @abstractmethod
    def _connect(self) -> None:
        """Collective: set up the learner<->server groups for the current targets."""

    @abstractmethod
    def _send(self, version: int) -> None:
        """Collective: send the weights as ``version`` (inside the update session, if any)."""

    def _join(self) -> bool:
        """Collective, inside the update session, before ``_send``: a late part of connecting
        (True when it did something: timed as connect)."""
        return False

    def _sent(self) -> tuple[int, int, dict[str, int]]:
        """(bytes, buckets or messages, bytes per "<server url>/<tp rank>") of one sync."""
        return self.plan.nbytes, self.plan.num_buckets, {}

    def _disconnect(self) -> None:
        """This rank's side of ``close``."""

    # -- control plane --------------------------------------------------------------------------
    def _agree(self, error: str | None) -> None:
        """Barrier that also shares failures: every rank raises if any rank reported one."""
        msgs: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(msgs, error, group=self._ctrl)
        failed = [(r, m) for r, m in enumerate(msgs) if m]
        if failed:
            r, m = failed[0]
            raise WeightSyncError(f"weight sync failed (rank {r}): {m}")

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0 (its HTTP), its value on every rank; its error raised on every rank."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = (fn(), None)
            except Exception as e:  # noqa: BLE001 - shared below
                box[0] = (None, f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(box, group_src=0, group=self._ctrl)
        value, err = box[0]
        if err:
            raise WeightSyncError(f"weight sync failed (rank 0): {err}")
        return value

    def _capabilities(self) -> list[api.ServerCapabilities]:
        """Rank 0: every server's capabilities, asked afresh (a restarted server may run another SGLang)."""
        return [s.capabilities(refresh=True) for s in self.servers]

    def _check(self, also: Callable[[], Any] | None = None) -> None:
        """The plan against every server's model (rank 0's HTTP); every rank raises the same
        error (PlanMismatchError on a mismatch). ``also``: a call rank 0 makes at the same time,
        its failure raised when the check passed."""
        err = None  # (is a plan mismatch, message)
        if self.rank == 0:
            with ThreadPoolExecutor(max_workers=1) as ex:
                fut = ex.submit(also) if also is not None else None
                try:
                    for server in self.servers:
                        check_plan_against(self.plan, *server_expected_specs(server, self.learner.expected_fn))
                except PlanMismatchError as e:
                    err = (True, str(e))
                except Exception as e:  # noqa: BLE001
                    err = (False, f"{type(e).__name__}: {e}")
                failed = _collect([fut]) if fut is not None else []
            if failed and err is None:
                err = (False, f"{type(failed[0]).__name__}: {failed[0]}")
        msgs: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(msgs, err, group=self._ctrl)
        if msgs[0]:
            mismatch, message = msgs[0]
            raise PlanMismatchError(message) if mismatch else WeightSyncError(message)

    def _begin(self) -> None:
        if self._session:
            send_all(self.servers, api.begin_weight_update())

    def _end(self) -> None:
        if self._session:
            send_all(self.servers, api.end_weight_update())

    # -- one sync -------------------------------------------------------------------------------
    def sync(self, version: int) -> SyncStats:
        """Push the current weights as policy ``version``. Collective over all learner ranks.

        On a plan/model mismatch nothing is sent and the servers keep their weights
        (PlanMismatchError on every rank). On a failure after sending started, the servers hold
        partly updated weights and WeightSyncError is raised: call ``sync`` again to resend everything.
        """
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        # Once connected, the check's /model_info and the session's begin are independent calls:
        # rank 0 makes them at once (a mismatch then closes the session below; nothing was sent).
        overlap = self.cfg.check_model and self._connected
        if self.cfg.check_model and not overlap:
            self._check()
            phases["check"] = time.perf_counter() - t0
        if not self._connected:
            t = time.perf_counter()
            self._connect()
            self._connected = True
            phases["connect"] = time.perf_counter() - t
        try:
            t = time.perf_counter()
            if overlap:
                self._check(also=self._begin)
            else:
                self._on_rank0(self._begin)
            phases["check+begin" if overlap else "begin"] = time.perf_counter() - t
            t = time.perf_counter()
            if self._join():
                phases["connect"] = phases.get("connect", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            self._send(version)
            phases["send"] = time.perf_counter() - t
            t = time.perf_counter()
            self._on_rank0(self._end)
            phases["end"] = time.perf_counter() - t
        except Exception:
            # A server that died mid-sync leaves the others with an open update session, which
            # would refuse the retry's /begin_weight_update: close those sessions, best effort.
            if self.rank == 0 and self._session:
                for server in self.servers:
                    try:
                        server.send(api.end_weight_update())
                    except Exception:  # noqa: BLE001 - the dead one, or no session open
                        pass
            raise
        nbytes, num_buckets, per_engine = self._sent()
        return SyncStats(version=version, bytes=nbytes, seconds=time.perf_counter() - t0, num_buckets=num_buckets,
                         phase_s=phases, mode=self.mode, bytes_per_engine_rank=per_engine)

    def _stage_tensors(self) -> Iterator[tuple[Any, list[torch.Tensor]]]:
        """(bucket, tensors) for this rank's stage, pulling the export lazily bucket by bucket
        (peak extra memory: one bucket). Runs on every exporting rank of the stage."""
        stage = self.plan.stages[self.stage]
        it = iter(self.learner.export())
        for bucket in stage.buckets:
            names, tensors = [], []
            for _ in bucket.tensors:
                name, tensor = next(it)
                names.append(name)
                tensors.append(tensor)
            if self.stage_plan is not None:
                check_bucket_tensors(bucket, names, tensors)
            yield bucket, tensors
        assert next(it, None) is None, f"stage {self.stage} exported more tensors than planned"

    # -- targets --------------------------------------------------------------------------------
    @property
    def server_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def set_targets(self, urls: Sequence[str]) -> None:
        """Push to the servers at ``urls`` from now on (collective: the same list on every rank);
        a server already known keeps its client. When the membership changes (a server died, or
        came back and awaits weights) the current groups are torn down and the next ``sync``
        connects afresh, so a dead server never blocks a sync."""
        if list(urls) == self.server_urls:
            return
        self.close()
        known = {s.url: s for s in self.servers}
        self.servers = [known.get(u) or SGLangClient(u, timeout_s=self.cfg.http_timeout_s, api_key=self._api_key)
                        for u in urls]

    def close(self) -> None:
        """Destroy this rank's learner<->server groups (call on every rank)."""
        self._disconnect()
        self._connected = False


class BroadcastSync(TransportBase):
    """mode broadcast: each stage's sender broadcasts its full HF tensors, bucket by bucket, to
    every TP rank of every server (transport.BroadcastSender); the stages take turns."""

    mode = "broadcast"

    def __init__(self, cfg: WeightSyncConfig, learner: LearnerSide, **kw: Any) -> None:
        super().__init__(cfg, learner, **kw)
        self._sender: BroadcastSender | None = None

    def _connect(self) -> None:
        caps = self._on_rank0(self._capabilities)
        self._session = all(c.weight_update_session for c in caps)
        self._connect_senders([c.tp_size for c in caps])

    def _connect_senders(self, tps: Sequence[int]) -> None:
        """Each stage's sender joins its own group, one stage at a time (servers join groups in
        call order)."""
        def join(stage: Any) -> None:
            port = self.cfg.master_port_base + stage.stage if self.cfg.master_port_base else free_port("")
            self._sender = BroadcastSender(
                self.servers, tps, group_name=f"{self.cfg.group_name_prefix}_s{stage.stage}", backend=self.cfg.backend,
                address=self.cfg.master_address or host_address(), port=port, timeout_s=self.cfg.group_timeout_s,
                load_format=self.cfg.load_format)
            self._sender.connect()

        for stage in self.plan.stages:
            self._agree(_error(lambda: join(stage)) if self.stage_plan is stage else None)

    def _send(self, version: int) -> None:
        last = self.plan.stages[-1].buckets[-1]
        for stage in self.plan.stages:
            err = None
            if self.exports and self.stage == stage.stage:
                pending = None  # wait() of the bucket in flight; the next one is packed meanwhile
                for bucket, tensors in self._stage_tensors():
                    if self.stage_plan is None or err is not None:
                        continue  # TP peer, or keep draining so the peers' gathers stay matched
                    try:
                        payload = self._sender.pack(tensors)
                        del tensors
                        if pending is not None:
                            pending, wait = None, pending
                            wait()
                        is_last = bucket is last
                        pending = self._sender.start_bucket(bucket, payload, weight_version=str(version) if is_last else None,
                                                            flush_cache=self.flush_cache and is_last)
                    except Exception as e:  # noqa: BLE001 - shared by _agree
                        err = f"{type(e).__name__}: {e}"
                if pending is not None:
                    try:
                        pending()
                    except Exception as e:  # noqa: BLE001
                        err = err or f"{type(e).__name__}: {e}"
                if self._sender is not None:
                    self._sender.release_buffers()
            self._agree(err)

    def _disconnect(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


class ReshardSync(BroadcastSync):
    """mode reshard: every learner rank sends what it owns straight to the engine ranks that need
    it, in SGLang's own layout (reshard.py plans, reshard_transport.py sends). When a target lacks
    the receiver, that connection broadcasts instead (one printed line; SyncStats.mode says which
    ran), until the targets change."""

    mode = "reshard"

    def __init__(self, cfg: WeightSyncConfig, learner: LearnerSide, **kw: Any) -> None:
        if learner.reshard is None:
            raise ValueError("mode: reshard needs the learner's adapter and local tensors (megatron_weight_sync)")
        check_syncable(learner.reshard.adapter)  # refused at construction, not at the first sync
        super().__init__(cfg, learner, **kw)
        self._reshard: ReshardTransport | None = None  # None while broadcasting instead
        self._joined = False

    def _connect(self) -> None:
        def rank0() -> tuple[list, int]:
            caps = self._capabilities()
            missing = [s.url for s, c in zip(self.servers, caps) if not has_receiver(c)]
            if missing:
                print(f"weight_sync.mode reshard: {missing[0]} has no reshard receiver (--custom-weight-loader "
                      f"{RECEIVER}); broadcasting instead", flush=True)
                return caps, 0
            return caps, self.cfg.master_port_base or free_port("")

        caps, port = self._on_rank0(rank0)
        self._session = all(c.weight_update_session for c in caps)
        self.mode = "reshard" if port else "broadcast"  # what this connection runs
        if not port:
            self._connect_senders([c.tp_size for c in caps])
            return
        # Every rank builds the same plan from metadata; the group is joined inside the first
        # update session (the receiver runs as an update_weights_from_tensor loader): _join.
        src = self.learner.reshard
        plan = plan_reshard(src.adapter, self.layout, [EngineLayout(c.tp_size, c.ep_size) for c in caps],
                            dtype=src.dtype, bucket_bytes=self.cfg.bucket_bytes, backend=resolve_backend(self.cfg.backend))
        self._reshard = ReshardTransport(
            plan=plan, rank=self.rank, servers=self.servers, local=src.local, backend=self.cfg.backend,
            address=self.cfg.master_address or host_address(), port=port,
            group_name=f"{self.cfg.group_name_prefix}_reshard", timeout_s=self.cfg.group_timeout_s)
        self._joined = False

    def _join(self) -> bool:
        """Inside the first update session: all learner ranks and every engine rank join the
        reshard group, then every engine rank checks the plan's parameters against its own."""
        if self._reshard is None or self._joined:
            return False
        self._agree(_error(self._reshard.connect))
        msgs: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(msgs, _error(self._reshard.check), group=self._ctrl)
        if msgs[0]:
            raise PlanMismatchError(f"weight sync refused before sending anything: {msgs[0]}")
        self._joined = True
        return True

    def _send(self, version: int) -> None:
        if self._reshard is None:
            return super()._send(version)
        self._agree(_error(lambda: self._reshard.send(version, flush_cache=self.flush_cache)))

    def _sent(self) -> tuple[int, int, dict[str, int]]:
        if self._reshard is None:
            return super()._sent()
        plan = self._reshard.plan
        per_engine = {f"{self.servers[i].url}/{r}": b for (i, r), b in plan.bytes_per_engine_rank().items()}
        return plan.nbytes, len(plan.messages), per_engine

    def _disconnect(self) -> None:
        super()._disconnect()
        if self._reshard is not None:
            self._reshard.close(session=self._session)
            self._reshard = None
        self._joined = False


class DiskSync(TransportBase):
    """mode disk: each stage's sender writes its buckets as safetensors files into a fresh
    directory under ``disk_dir``; rank 0 adds the index and config.json and tells every server
    to load the directory (for clusters where learners and servers cannot share a group)."""

    mode = "disk"

    def _connect(self) -> None:
        pass  # no group: the servers read a shared directory

    def _send(self, version: int) -> None:
        from safetensors.torch import save_file

        out = Path(self.cfg.disk_dir) / f"v{version}"
        def write() -> None:
            if self.stage_plan is not None:
                out.mkdir(parents=True, exist_ok=True)
            for bucket, tensors in self._stage_tensors():
                if self.stage_plan is not None:
                    tmp = out / f".s{bucket.stage:02d}-b{bucket.index:04d}.tmp"
                    save_file({n: t.detach().contiguous().cpu() for n, t in zip(bucket.names, tensors)}, str(tmp))
                    os.replace(tmp, out / f"model-s{bucket.stage:02d}-b{bucket.index:04d}.safetensors")

        self._agree(_error(write) if self.exports else None)

        def load() -> None:
            # A standard sharded HF checkpoint: the index maps every tensor to its bucket file.
            weight_map = {
                n: f"model-s{b.stage:02d}-b{b.index:04d}.safetensors" for st in self.plan.stages for b in st.buckets for n in b.names
            }
            index = {"metadata": {"total_size": self.plan.nbytes}, "weight_map": weight_map}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
            if self.learner.hf_config is not None:
                (out / "config.json").write_text(json.dumps(self.learner.hf_config, indent=2))
            else:  # the servers' own config (same model by the check above)
                src = Path(self.servers[0].model_info()["model_path"]) / "config.json"
                (out / "config.json").write_text(src.read_text())
            send_all(self.servers, api.update_weights_from_disk(str(out), version, flush_cache=self.flush_cache))

        self._on_rank0(load)


TRANSPORTS: dict[str, type[TransportBase]] = {c.mode: c for c in (BroadcastSync, ReshardSync, DiskSync)}
"""weight_sync.mode -> its transport (the one place the mode is dispatched on)."""


def megatron_weight_sync(
    cfg: WeightSyncConfig,
    *,
    adapter: Any,
    chunks: list[torch.nn.Module],
    groups: Any,
    servers: Sequence[SGLangClient] = (),
    world_group: Any = None,
    dtype: str | None = None,
    pause_mode: str = "retract",
    api_key: str | None = None,
    quantization: str = "none",
    model: Any = None,
) -> WeightSync:
    """The transport ``cfg.mode`` names, for a megatron model built with ``adapter`` (areal_mega.models).

    ``chunks`` are this rank's model chunks, ``groups`` its ModelParallelGroups (TP group used by
    the gather). The plan is the adapter's pure per-stage metadata; every tensor travels in
    ``dtype`` (default: the HF checkpoint's dtype), since megatron keeps some parameters (norms)
    in fp32 inside a bf16 model. Servers are checked against ``get_adapter(server config).plan``
    at TP1 x PP1. ``world_group``: all learner ranks (default: the world). ``servers`` /
    ``pause_mode`` / ``api_key``: as for :class:`TransportBase`. ``quantization``: the servers'
    (inference.server.quantization). ``fp8``: the stage sender quantizes each gathered linear weight
    (weight_sync/fp8.py) and sends fp8 + ``weight_scale_inv`` in place of the bf16 tensor (broadcast
    only; another mode, or a family without the quantized layout, is refused in one line).
    ``model``: the MegatronModel of ``chunks``; when it carries LoRA adapters, ``cfg.lora`` is
    chosen here once (``lora_sync.served_lora``) and logged in one line: adapter-only
    (:class:`LoraAdapterSync`; the servers must serve ``served_lora``'s adapter) or the merged
    weights over ``cfg.mode``'s transport.
    """
    from areal_mega.megatron.model import expert_export
    from areal_mega.models import get_adapter
    from areal_mega.models.base import named_tensors

    cfg.validate()  # a bad mode: its one-line error, before the lookup
    fp8 = quantization == "fp8"
    if fp8:
        from areal_mega.weight_sync import fp8 as f8

        f8.check_fp8(adapter)
        if cfg.mode != "broadcast":
            raise ValueError(f"inference.server.quantization: fp8 is sent by weight_sync.mode broadcast only, not "
                             f"{cfg.mode!r} (its quantized shards are not implemented); use mode: broadcast")
    from areal_mega.megatron.lora import has_lora, sync_chunks

    if has_lora(chunks):
        from areal_mega.weight_sync.lora_sync import LoraAdapterSync

        if model is None or model.lora is None:
            raise ValueError("megatron_weight_sync: chunks carry LoRA adapters: pass their model")
        if cfg.served_lora(model.lora, quantization, pause_mode) is not None:
            if groups.rank == 0:
                print(f"weight sync: LoRA adapter-only (weight_sync.lora {cfg.lora}: rank {model.lora.rank} adapters "
                      f"loaded into the servers in memory; weight_sync.mode {cfg.mode} unused)",
                      file=sys.stderr, flush=True)
            return LoraAdapterSync(model, servers=servers, api_key=api_key)
    chunks = sync_chunks(chunks)  # LoRA: the merged-weight fallback (W + scaling * B A), logged once
    layout: ParallelLayout = groups.layout
    dtype = dtype_name(dtype or adapter.arch.dtype)
    wire = getattr(torch, dtype)
    stage_plans = adapter.plan(layout, dtype=dtype)
    mine = stage_plans[groups.coords.pp]
    # what the servers receive: the checkpoint's tensors (gpt-oss: each layer's experts stacked, stack_hf)
    stage_tensors = [adapter.checkpoint_specs(sp.tensors) for sp in stage_plans]
    stage_tensors = [f8.fp8_specs(adapter, ts) if fp8 else ts for ts in stage_tensors]
    group_of = (lambda name: f8.bucket_group(adapter, name)) if fp8 else adapter.bucket_group

    def expected(hf_config: dict) -> Sequence[Any]:
        if fp8:
            hf_config = f8.check_server_fp8(hf_config, "the server's model")
        theirs = get_adapter(hf_config)
        tensors = theirs.checkpoint_specs(theirs.plan(ParallelLayout(world_size=1), dtype=dtype)[0].tensors)
        return f8.fp8_specs(theirs, tensors) if fp8 else tensors

    def export() -> Iterable[tuple[str, torch.Tensor | None]]:
        stream = ((n, None if t is None else t.to(wire))
                  for n, t in adapter.stack_hf(adapter.export_hf(chunks, mine, groups.tp,
                                                                 experts=expert_export(adapter, groups))))
        return f8.quantize_export(adapter, stream) if fp8 else stream

    learner = LearnerSide(
        layout=layout,
        rank=groups.rank,
        group=world_group if world_group is not None else dist.group.WORLD,
        plan=plan_weight_sync(stage_tensors, layout, cfg.bucket_bytes, group_of),
        export=export,
        expected_fn=expected,
        hf_config=adapter.hf_config,
        reshard=ReshardSource(adapter=adapter, local=lambda: [named_tensors(c) for c in chunks], dtype=dtype),
    )
    return TRANSPORTS[cfg.mode](cfg, learner, servers=servers, pause_mode=pause_mode, api_key=api_key)
