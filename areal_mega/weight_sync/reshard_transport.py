"""Reshard transport: every learner rank sends what it owns straight to the engine ranks that need it.

One process group holds every learner rank (group rank = global learner rank; rank 0 hosts the
store and coordinates) and every TP rank of every server (``L + offset(server) + tp_rank``).
The SGLang side is areal_mega's receiver (tools/env/sglang_reshard.py, a custom weight loader),
driven by ``/update_weights_from_tensor`` with one JSON command per TP rank. One sync::

    learner rank 0                          every learner rank r             engine rank e
    POST update_weights_from_tensor (sync)                                   receive(): for its messages
    irecv status from every engine rank     for m in plan.sent_by(r):          recv(m.src) -> write pieces
                                              send(pack(m), m.dst)           send status -> rank 0
    wait statuses, HTTP answers (weight_version moves with this one call per server)

The plan's (round, src) order makes the blocking sends and receives deadlock-free
(reshard.py). Statuses cannot deadlock it either: an engine rank reports only after its last
receive, and rank 0 posted their receives before sending.
"""

from __future__ import annotations

import base64
import json
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from areal_mega.inference import sglang_api as api
from areal_mega.inference.server import RESHARD_RECEIVER
from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.utils.distributed import resolve_backend
from areal_mega.weight_sync.reshard import ReshardPlan, wire_messages
from areal_mega.weight_sync.transport import (WeightSyncError, _collect, join_update_group, keeps_buffers, prepare_message,
                                               wait_all)

RECEIVER = RESHARD_RECEIVER
"""The ``--custom-weight-loader`` path of the receiver (tools/env/sglang_reshard.py)."""
COMMAND = "areal_mega_reshard"
STATUS_BYTES = 4096  # tools/env/sglang_reshard.py STATUS_BYTES
POST_LOAD_PROTOCOL = 3  # tools/env/sglang_reshard.py PROTOCOL since it runs post_load_weights (MLA)

__all__ = ["RECEIVER", "ReshardTransport", "command_payload", "has_receiver"]


def has_receiver(caps: api.ServerCapabilities) -> bool:
    return RECEIVER in caps.custom_weight_loaders and caps.has("/update_weights_from_tensor")


def command_payload(cmd: dict) -> str:
    """One TP rank's ``serialized_named_tensors`` entry: a plain pickle (no shared memory, so it
    crosses hosts) of ``[(COMMAND, uint8 tensor of the JSON)]``; SGLang's safe unpickler takes it."""
    t = torch.frombuffer(bytearray(json.dumps(cmd).encode()), dtype=torch.uint8)
    return base64.b64encode(pickle.dumps([(COMMAND, t)])).decode()


class ReshardTransport:
    """One learner rank's side of the reshard group. ``connect``, ``check`` and ``send`` are
    collective over all learner ranks (HTTP only from rank 0)."""

    def __init__(self, *, plan: ReshardPlan, rank: int, servers: Sequence[SGLangClient], local: Callable[[], list],
                 backend: str, address: str, port: int, group_name: str, timeout_s: float) -> None:
        self.plan, self.rank, self.servers, self.local = plan, rank, list(servers), local
        self.backend = resolve_backend(backend)
        self.address, self.port, self.group_name, self.timeout_s = address, port, group_name, timeout_s
        self.num_learners = plan.learner.world_size
        self.offsets = [self.num_learners + sum(e.tp for e in plan.engines[:i]) for i in range(len(plan.engines))]
        self.world_size = self.num_learners + sum(e.tp for e in plan.engines)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.mine = plan.sent_by(rank)
        self._buf: torch.Tensor | None = None  # one pack buffer, reused (page faults on CPU; see transport.py)
        self._prepared: tuple[tuple, list] | None = None
        """(storage key, this rank's PackedMessages): the views are built once and reused while
        every local tensor and the pack buffer keep their storage (~20 ms of Python per sync on
        a 2-core host otherwise)."""
        self.group: Any = None
        self._sync_payloads: list[list[str]] | None = None
        self.last_statuses: list[dict] = []
        """Rank 0: every engine rank's status of the last command (bytes, seconds, wait_s, ...)."""
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.servers)))

    # -- helpers --------------------------------------------------------------------------------
    def _post(self, per_rank: Callable[[int, int], dict] | list[list[str]], **kw: Any) -> list:
        """Rank 0: one update_weights_from_tensor per server, one command per TP rank (async);
        ``per_rank`` builds each rank's command, or is the payloads already built."""
        futs = []
        for i, (s, eng) in enumerate(zip(self.servers, self.plan.engines)):
            payloads = (per_rank[i] if isinstance(per_rank, list) else
                        [command_payload({"group": self.group_name, **per_rank(i, r)}) for r in range(eng.tp)])
            futs.append(self._pool.submit(s.send, api.update_weights_from_tensor(
                payloads=payloads, load_format=RECEIVER, flush_cache=kw.get("flush_cache", False),
                weight_version=kw.get("weight_version"))))
        return futs

    def _statuses(self) -> tuple[list, list[torch.Tensor]]:
        bufs = [torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=self.device) for _ in range(self.world_size - self.num_learners)]
        works = [dist.irecv(b, group_src=self.num_learners + i, group=self.group) for i, b in enumerate(bufs)]
        return works, bufs

    @staticmethod
    def _decode(b: torch.Tensor) -> dict:
        return json.loads(bytes(b.cpu().numpy().tobytes()).rstrip(b"\0").decode())

    def _finish(self, works: list, bufs: list, futs: list, what: str) -> list[dict]:
        wait_all(works, futs, f"reshard {what}")
        statuses = [self._decode(b) for b in bufs]
        self.last_statuses = statuses
        bad = [s for s in statuses if not s.get("ok")]
        if bad:
            raise WeightSyncError(f"reshard {what}: engine group rank {bad[0].get('rank')}: {bad[0].get('error')}")
        return statuses

    # -- collective steps -----------------------------------------------------------------------
    def connect(self) -> None:
        futs = []
        if self.rank == 0:
            futs = self._post(lambda i, r: {"op": "join", "backend": self.backend, "address": self.address,
                                            "port": self.port, "world_size": self.world_size,
                                            "rank": self.offsets[i] + r, "timeout_s": self.timeout_s})
        try:
            self.group = join_update_group(backend=self.backend, address=self.address, port=self.port, rank=self.rank,
                                           world_size=self.world_size, group_name=self.group_name,
                                           timeout_s=self.timeout_s)
        finally:
            errors = _collect(futs)
        if errors:
            raise WeightSyncError(f"reshard group {self.group_name}: a server failed to join: {errors[0]}")

    def check(self) -> None:
        """Rank 0: every engine rank compares the plan's parameters (names, shapes, dtypes) with
        its own; a mismatch raises before any weight is sent."""
        if self.rank != 0:
            return
        works, bufs = self._statuses()

        def cmd(i: int, r: int) -> dict:
            dtype = self.plan.dtype
            params = {p.name: [list(p.shape), p.dtype or dtype] for p in self.plan.engine_params[(i, r)]}
            # a passed check keeps the rank's messages: every sync command is then a few bytes
            return {"op": "check", "params": params, "messages": wire_messages(self.plan.received_by(i, r))}

        futs = self._post(cmd)
        statuses = self._finish(works, bufs, futs, "check against the servers' parameters")
        # A receiver older than protocol 3 writes kv_b_proj but leaves SGLang's absorbed MLA
        # w_kc / w_vc stale (silently wrong rollouts): refuse it for MLA plans.
        mla = any(".kv_b_proj." in p.name for ps in self.plan.engine_params.values() for p in ps)
        old = [s for s in statuses if s.get("protocol", 0) < POST_LOAD_PROTOCOL]
        if mla and old:
            raise WeightSyncError(f"reshard check: engine group rank {old[0].get('rank')}'s receiver speaks protocol "
                                  f"{old[0].get('protocol')} (< {POST_LOAD_PROTOCOL}: it does not recompute MLA's "
                                  "w_kc / w_vc after a sync); install tools/env/sglang_reshard.py in the server's venv")

    def send(self, version: int, *, flush_cache: bool) -> int:
        """Send this rank's messages; rank 0 also drives the servers and collects their statuses.
        Returns the bytes this rank sent."""
        works, bufs, futs = [], [], []
        if self.rank == 0:
            works, bufs = self._statuses()
            if self._sync_payloads is None:  # the same every sync (the receivers kept the plan at check)
                self._sync_payloads = [[command_payload({"group": self.group_name, "op": "sync"}) for _ in range(e.tp)]
                                       for e in self.plan.engines]
            futs = self._post(self._sync_payloads, flush_cache=flush_cache, weight_version=version)
        sent = 0
        try:
            if self.mine:
                # Two reused buffers: message k+1 is packed while k is on the wire. Still
                # deadlock-free: a sender only ever waits for its own earlier message, and the
                # earliest unfinished message has been posted by its sender and awaited by its receiver.
                local = self.local()
                need = max(m.nbytes for m in self.mine)
                if self._buf is None or self._buf.numel() < 2 * need:
                    self._buf = torch.empty(2 * need, dtype=torch.uint8, device=self.device)
                halves = (self._buf[:need], self._buf[need: 2 * need])
                # Sound because the cached views hold the old storage: no new tensor can take its
                # address while they exist, so an equal key means the same memory.
                key = (self._buf.data_ptr(), tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                                                   for chunk in local for t in chunk.values()))
                if self._prepared is None or self._prepared[0] != key:
                    self._prepared = None  # release the old views first
                    self._prepared = (key, [prepare_message(m, local, halves[k % 2]) for k, m in enumerate(self.mine)])
                pending: list = [None, None]
                for k, (m, packed) in enumerate(zip(self.mine, self._prepared[1])):
                    if pending[k % 2] is not None:
                        pending[k % 2].wait()
                    pending[k % 2] = dist.isend(packed.fill(), group_dst=self.offsets[m.server] + m.engine_rank,
                                                group=self.group)
                    sent += m.nbytes
                for w in pending:
                    if w is not None:
                        w.wait()
        finally:
            self.release_buffers()
            if self.rank == 0:
                self._finish(works, bufs, futs, f"sync v{version}")
        return sent

    def release_buffers(self) -> None:
        """End of a sync (transport.keeps_buffers): on GPU the pack buffer and the views into it go."""
        if not keeps_buffers(self.device):
            self._prepared = None
            self._buf = None

    def send_raw(self, transfers: Sequence[tuple[int, int, int, int]]) -> None:
        """The reference transfer (tools/bench_weight_sync.py): ``(src, server, engine rank,
        nbytes)`` in order, over the same group and links, received and not written anywhere,
        no packing. Collective; rank 0 must have opened an update session on the servers."""
        works, bufs, futs = [], [], []
        if self.rank == 0:
            works, bufs = self._statuses()
            futs = self._post(lambda i, r: {"op": "sync", "messages": [[src, n, []] for src, srv, er, n in transfers
                                                                        if (srv, er) == (i, r)]})
        try:
            mine = [t for t in transfers if t[0] == self.rank]
            need = max((t[3] for t in mine), default=0)
            if self._buf is None or self._buf.numel() < need:
                self._buf = torch.empty(need, dtype=torch.uint8, device=self.device)
            for _, srv, er, n in mine:
                dist.send(self._buf[:n], group_dst=self.offsets[srv] + er, group=self.group)
        finally:
            if self.rank == 0:
                self._finish(works, bufs, futs, "raw transfer")

    def close(self, session: bool = True) -> None:
        """Destroy the group here and, best effort, on the servers (a dead one is skipped; the
        receiver also replaces a stale group of the same name when it joins again)."""
        if self.group is not None:
            if self.rank == 0:
                if session:  # the receiver only runs inside an update session
                    _collect([self._pool.submit(s.send, api.begin_weight_update()) for s in self.servers])
                _collect(self._post(lambda i, r: {"op": "leave"}))
                if session:
                    _collect([self._pool.submit(s.send, api.end_weight_update()) for s in self.servers])
            dist.destroy_process_group(self.group)
            self.group = None
        self._prepared = None
        self._buf = None
        self._pool.shutdown(wait=True)
