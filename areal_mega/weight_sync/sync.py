"""Weight sync as the trainer uses it: ``WeightSync(...).sync(version)`` on every learner rank.

Who does what (one sync, all learner ranks call ``sync`` collectively)::

    rank 0 (stage-0 sender)        stage-s sender (tp=0,cp=0,dp=0)     its TP peers (dp=0,cp=0)
    check plan vs servers' models
    ---------------------- agree (all ranks; a mismatch raises here, nothing sent) -----------
    pause servers, begin session
    ---------------------- agree ---------------------------------------------------------------
    for each stage s in order:      export(): gather TP shards   <->  export(): gather (collective)
                                    per bucket: HTTP + broadcast
    ---------------------- agree after each stage (turns) --------------------------------------
    end session, continue servers
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from areal_mega.parallel import ParallelLayout
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


@dataclass
class SyncStats:
    version: int
    bytes: int
    seconds: float
    num_buckets: int
    phase_s: dict[str, float] = field(default_factory=dict)
    mode: str = "broadcast"
    """The mode that ran (reshard falls back to broadcast for servers without the receiver)."""
    bytes_per_engine_rank: dict[str, int] = field(default_factory=dict)
    """"<server url>/<tp rank>" -> bytes that rank received."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


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
        specs[t.name] = TensorSpec(t.name, t.shape, dtype)
    return specs, f"server {server.url} (model {model_path}, dtype {dtype})"


class WeightSync:
    """Pushes the learner's weights into the SGLang servers. Owns its learner<->server groups.

    Construct on every learner rank (collective: it creates a gloo control group over
    ``world_group`` when that group is not gloo). ``stage_metadata`` is the adapter's pure
    per-stage metadata (identical on all ranks); ``export`` is the adapter's runtime gather for
    THIS rank's stage (called only on dp=0, cp=0 ranks); ``expected_fn`` maps a server's HF config
    to the tensors it expects (used when ``cfg.check_model``).

    ``servers`` are the first targets; the trainer gives none and names each sync's targets with
    ``set_targets`` (from the rollout service's ``begin_update``). ``pause_mode`` is the servers'
    pause mode (``inference.client.pause_mode``: in_place keeps the KV cache, so no flush).
    Pausing is the caller's: the trainer pauses through its rollout service, scripts pause the
    servers themselves around ``sync``.
    """

    def __init__(
        self,
        cfg: WeightSyncConfig,
        *,
        layout: ParallelLayout,
        rank: int,
        world_group: Any,
        stage_metadata: Sequence[Sequence[Any]],
        export: ExportFn,
        servers: Sequence[SGLangClient],
        expected_fn: ExpectedFn | None = None,
        hf_config: dict | None = None,
        pause_mode: str = "retract",
        api_key: str | None = None,
        reshard: ReshardSource | None = None,
        bucket_group: Callable[[str], str | None] | None = None,
    ) -> None:
        cfg.validate()
        if cfg.mode == "reshard" and reshard is None:
            raise ValueError("mode: reshard needs the learner's adapter and local tensors (megatron_weight_sync)")
        if cfg.mode == "reshard":
            check_syncable(reshard.adapter)  # refused at construction, not at the first sync
        self.reshard = reshard
        self.mode = cfg.mode  # what runs: reshard falls back to broadcast when a server has no receiver
        self._reshard: ReshardTransport | None = None
        self._joined = False
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode: {pause_mode!r} is not one of abort, retract, in_place")
        self.pause_mode = pause_mode
        self._api_key = api_key
        if cfg.check_model and expected_fn is None:
            raise ValueError("check_model: needs expected_fn (the adapter's metadata for an HF config)")
        self.cfg = cfg
        self.layout = layout
        self.rank = rank
        self.plan: SyncPlan = plan_weight_sync(stage_metadata, layout, cfg.bucket_bytes, bucket_group)
        self.export = export
        self.servers = list(servers)
        self.expected_fn = expected_fn
        self.hf_config = hf_config
        coords = layout.coords(rank)
        self.stage = coords.pp
        self.exports = layout.exports(rank)  # dense dp=0/cp=0 replica, plus MoE expert owners
        self.stage_plan: SenderPlan | None = self.plan.stage_of_rank(rank)
        # Control messages are tiny python objects: keep them on gloo even when the world is NCCL.
        self._ctrl = world_group if dist.get_backend(world_group) == "gloo" else dist.new_group(backend="gloo")
        self._world = world_group
        self._sender: BroadcastSender | None = None
        self._connected = False
        self._session = False

    # -- control plane --------------------------------------------------------------------------
    def _agree(self, error: str | None) -> None:
        """Barrier that also shares failures: every rank raises if any rank reported one."""
        msgs: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(msgs, error, group=self._ctrl)
        failed = [(r, m) for r, m in enumerate(msgs) if m]
        if failed:
            r, m = failed[0]
            raise WeightSyncError(f"weight sync failed (rank {r}): {m}")

    def _on_rank0(self, fn: Callable[[], Any]) -> None:
        err = None
        if self.rank == 0:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - shared with all ranks by _agree
                err = f"{type(e).__name__}: {e}"
        self._agree(err)

    def check_servers(self) -> None:
        """Rank 0: the plan against every server's model. Raises PlanMismatchError on mismatch."""
        for s in self.servers:
            expected, where = server_expected_specs(s, self.expected_fn)
            check_plan_against(self.plan, expected, where)

    def _connect(self) -> None:
        """Learn the servers' TP sizes (rank 0), then each stage's sender joins its own group,
        one stage at a time (servers join groups in call order)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                caps = [s.capabilities(refresh=True) for s in self.servers]
                tps = [c.tp_size for c in caps]
                eps = [c.ep_size for c in caps]
                session = all(c.weight_update_session for c in caps)
                mode = self.cfg.mode
                if mode == "reshard":
                    missing = [s.url for s, c in zip(self.servers, caps) if not has_receiver(c)]
                    if missing:
                        print(f"weight_sync.mode reshard: {missing[0]} has no reshard receiver (--custom-weight-loader "
                              f"{RECEIVER}); broadcasting instead", flush=True)
                        mode = "broadcast"
                port = (self.cfg.master_port_base or free_port("")) if mode == "reshard" else 0
                box[0] = (tps, eps, session, mode, port, None)
            except Exception as e:  # noqa: BLE001 - shared below
                box[0] = (None, None, None, None, None, f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(box, group_src=0, group=self._ctrl)
        tps, eps, self._session, self.mode, port, err = box[0]
        if err:
            raise WeightSyncError(f"weight sync failed (rank 0): {err}")
        if self.mode == "reshard":
            # Every rank builds the same plan from metadata; the group is joined inside the
            # first update session (the receiver runs as an update_weights_from_tensor loader).
            plan = plan_reshard(self.reshard.adapter, self.layout, [EngineLayout(t, e) for t, e in zip(tps, eps)],
                                dtype=self.reshard.dtype, bucket_bytes=self.cfg.bucket_bytes,
                                backend=resolve_backend(self.cfg.backend))
            self._reshard = ReshardTransport(
                plan=plan, rank=self.rank, servers=self.servers, local=self.reshard.local, backend=self.cfg.backend,
                address=self.cfg.master_address or host_address(), port=port,
                group_name=f"{self.cfg.group_name_prefix}_reshard", timeout_s=self.cfg.group_timeout_s)
            self._joined = False
            self._connected = True
            return
        if self.mode != "broadcast":
            self._connected = True
            return
        for stage in self.plan.stages:
            err = None
            if self.stage_plan is stage:
                try:
                    port = self.cfg.master_port_base + stage.stage if self.cfg.master_port_base else free_port("")
                    self._sender = BroadcastSender(
                        self.servers,
                        tps,
                        group_name=f"{self.cfg.group_name_prefix}_s{stage.stage}",
                        backend=self.cfg.backend,
                        address=self.cfg.master_address or host_address(),
                        port=port,
                        timeout_s=self.cfg.group_timeout_s,
                        load_format=self.cfg.load_format,
                    )
                    self._sender.connect()
                except Exception as e:  # noqa: BLE001 - shared by _agree
                    err = f"{type(e).__name__}: {e}"
            self._agree(err)
        self._connected = True

    # -- one sync -------------------------------------------------------------------------------
    def sync(self, version: int) -> SyncStats:
        """Push the current weights as policy ``version``. Collective over all learner ranks.

        On a plan/model mismatch nothing is sent and the servers keep serving (PlanMismatchError
        on every rank). On a failure after sending started, the servers stay paused with partly
        updated weights and WeightSyncError is raised: call ``sync`` again to resend everything.
        """
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        # Once connected, the check's /model_info and the pause are independent calls: rank 0
        # makes them at once (a mismatch then resumes the servers below; nothing was sent).
        overlap = self.cfg.check_model and self._connected
        if self.cfg.check_model and not overlap:
            self._check()
            phases["check"] = time.perf_counter() - t0
        if not self._connected:
            t = time.perf_counter()
            self._connect()
            phases["connect"] = time.perf_counter() - t
        try:
            t = time.perf_counter()
            if overlap:
                self._check(also=self._pause_and_begin)
            else:
                self._on_rank0(self._pause_and_begin)
            phases["check+pause" if overlap else "pause"] = time.perf_counter() - t
            if self.mode == "reshard" and not self._joined:
                t = time.perf_counter()
                self._join_reshard()
                phases["connect"] = phases.get("connect", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            if self.mode == "reshard":
                self._send_reshard(version)
            elif self.mode == "broadcast":
                self._send_stages(version)
            else:
                self._disk_sync(version)
            phases["send"] = time.perf_counter() - t
            t = time.perf_counter()
            self._on_rank0(self._end_and_continue)
            phases["resume"] = time.perf_counter() - t
        except Exception as e:
            # A server that died mid-sync leaves the others with an open update session, which
            # would refuse the retry's /begin_weight_update: close those sessions, best effort.
            if self.rank == 0 and self._session and self.mode in ("broadcast", "reshard"):
                for server in self.servers:
                    try:
                        server.send(api.end_weight_update())
                    except Exception:  # noqa: BLE001 - the dead one, or no session open
                        pass
            raise
        per_engine: dict[str, int] = {}
        if self.mode == "reshard":
            plan = self._reshard.plan
            per_engine = {f"{self.servers[i].url}/{r}": b for (i, r), b in plan.bytes_per_engine_rank().items()}
        return SyncStats(
            version=version,
            bytes=self._reshard.plan.nbytes if self.mode == "reshard" else self.plan.nbytes,
            seconds=time.perf_counter() - t0,
            num_buckets=len(self._reshard.plan.messages) if self.mode == "reshard" else self.plan.num_buckets,
            phase_s=phases,
            mode=self.mode,
            bytes_per_engine_rank=per_engine,
        )

    def _check(self, also: Callable[[], Any] | None = None) -> None:
        """The plan against every server's model (rank 0's HTTP); every rank raises the same
        error (PlanMismatchError on a mismatch). ``also``: a call rank 0 makes at the same time,
        its failure raised when the check passed."""
        err = None  # (is a plan mismatch, message)
        if self.rank == 0:
            with ThreadPoolExecutor(max_workers=1) as ex:
                fut = ex.submit(also) if also is not None else None
                try:
                    self.check_servers()
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

    def _pause_and_begin(self) -> None:
        if self._session and self.mode in ("broadcast", "reshard"):
            send_all(self.servers, api.begin_weight_update())

    def _end_and_continue(self) -> None:
        if self._session and self.mode in ("broadcast", "reshard"):
            send_all(self.servers, api.end_weight_update())

    def _stage_tensors(self) -> Iterator[tuple[Any, list[torch.Tensor]]]:
        """(bucket, tensors) for this rank's stage, pulling the export lazily bucket by bucket
        (peak extra memory: one bucket). Runs on every exporting rank of the stage."""
        stage = self.plan.stages[self.stage]
        it = iter(self.export())
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

    def _send_stages(self, version: int) -> None:
        last = self.plan.stages[-1].buckets[-1]
        # Flushing the radix cache is refused while requests are held with their KV (in_place).
        flush = self.pause_mode != "in_place"
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
                        pending = self._sender.start_bucket(
                            bucket, payload, weight_version=str(version) if is_last else None, flush_cache=flush and is_last
                        )
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

    def _join_reshard(self) -> None:
        """Inside the first update session: all learner ranks and every engine rank join the
        reshard group, then every engine rank checks the plan's parameters against its own."""
        err = None
        try:
            self._reshard.connect()
        except Exception as e:  # noqa: BLE001 - shared by _agree
            err = f"{type(e).__name__}: {e}"
        self._agree(err)
        err = None
        try:
            self._reshard.check()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        msgs: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(msgs, err, group=self._ctrl)
        if msgs[0]:
            raise PlanMismatchError(f"weight sync refused before sending anything: {msgs[0]}")
        self._joined = True

    def _send_reshard(self, version: int) -> None:
        err = None
        try:
            self._reshard.send(version, flush_cache=self.pause_mode != "in_place")
        except Exception as e:  # noqa: BLE001 - shared by _agree
            err = f"{type(e).__name__}: {e}"
        self._agree(err)

    def _disk_sync(self, version: int) -> None:
        """Each stage's sender writes its buckets as safetensors files into a fresh directory,
        rank 0 adds config.json and tells every server to load the directory."""
        from safetensors.torch import save_file

        out = Path(self.cfg.disk_dir) / f"v{version}"
        err = None
        if self.exports:
            try:
                if self.stage_plan is not None:
                    out.mkdir(parents=True, exist_ok=True)
                for bucket, tensors in self._stage_tensors():
                    if self.stage_plan is not None:
                        tmp = out / f".s{bucket.stage:02d}-b{bucket.index:04d}.tmp"
                        save_file({n: t.detach().contiguous().cpu() for n, t in zip(bucket.names, tensors)}, str(tmp))
                        os.replace(tmp, out / f"model-s{bucket.stage:02d}-b{bucket.index:04d}.safetensors")
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        self._agree(err)

        def load() -> None:
            # A standard sharded HF checkpoint: the index maps every tensor to its bucket file.
            weight_map = {
                n: f"model-s{b.stage:02d}-b{b.index:04d}.safetensors" for st in self.plan.stages for b in st.buckets for n in b.names
            }
            index = {"metadata": {"total_size": self.plan.nbytes}, "weight_map": weight_map}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
            if self.hf_config is not None:
                (out / "config.json").write_text(json.dumps(self.hf_config, indent=2))
            else:  # the servers' own config (same model by the check above)
                src = Path(self.servers[0].model_info()["model_path"]) / "config.json"
                (out / "config.json").write_text(src.read_text())
            send_all(self.servers, api.update_weights_from_disk(str(out), version,
                                                                flush_cache=self.pause_mode != "in_place"))

        self._on_rank0(load)

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
        """Destroy this rank's learner<->server group (call on every rank)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._reshard is not None:
            self._reshard.close(session=self._session)
            self._reshard = None
        self._joined = False
        self._connected = False


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
) -> WeightSync:
    """A :class:`WeightSync` for a megatron model built with ``adapter`` (areal_mega.models).

    ``chunks`` are this rank's model chunks, ``groups`` its ModelParallelGroups (TP group used by
    the gather). The plan is the adapter's pure per-stage metadata; every tensor travels in
    ``dtype`` (default: the HF checkpoint's dtype), since megatron keeps some parameters (norms)
    in fp32 inside a bf16 model. Servers are checked against ``get_adapter(server config).plan``
    at TP1 x PP1. ``pause_mode`` / ``api_key``: as for :class:`WeightSync`.
    """
    from areal_mega.megatron.model import expert_export
    from areal_mega.models import get_adapter

    layout: ParallelLayout = groups.layout
    dtype = dtype_name(dtype or adapter.arch.dtype)
    wire = getattr(torch, dtype)
    stage_plans = adapter.plan(layout, dtype=dtype)
    mine = stage_plans[groups.coords.pp]

    def expected(hf_config: dict) -> Sequence[Any]:
        return get_adapter(hf_config).plan(ParallelLayout(world_size=1), dtype=dtype)[0].tensors

    from areal_mega.models.base import named_tensors

    reshard = ReshardSource(adapter=adapter, local=lambda: [named_tensors(c) for c in chunks], dtype=dtype)
    return WeightSync(
        cfg,
        reshard=reshard,
        layout=layout,
        rank=groups.rank,
        world_group=world_group if world_group is not None else dist.group.WORLD,
        stage_metadata=[sp.tensors for sp in stage_plans],
        export=lambda: ((n, None if t is None else t.to(wire))
                        for n, t in adapter.export_hf(chunks, mine, groups.tp, experts=expert_export(adapter, groups))),
        servers=servers,
        expected_fn=expected,
        hf_config=adapter.hf_config,
        pause_mode=pause_mode,
        api_key=api_key,
        bucket_group=adapter.bucket_group,
    )
