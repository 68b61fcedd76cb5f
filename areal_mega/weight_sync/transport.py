"""Weight-sync transport: the SGLang HTTP side and a torch.distributed broadcast sender.

One :class:`BroadcastSender` per pipeline stage. It owns one process group whose rank 0 is this
stage's sender (a learner rank) and whose other ranks are every server's TP ranks (server ``i``
joins at ``rank_offset = 1 + sum(tp of servers before i)``). For one bucket::

    sender                                   each server (SGLang scheduler, every TP rank)
    POST /update_weights_from_distributed ->  allocate uint8 buffer from names/dtypes/shapes
    broadcast(flat uint8 buffer, src=0)  <->  broadcast(buffer, src=0)   (same group)
    wait for the HTTP answers            <-   split buffer into tensors, model.load_weights

The HTTP call returns only after the server has received and loaded the bucket, so it runs in a
thread while the sender broadcasts. The group is created the way SGLang creates its side
(``init_custom_process_group``: a TCP rendezvous at ``tcp://address:port`` whose store is
prefixed with the group name, then torch's group helper), which is why :func:`join_update_group`
uses the same private torch helper: the store keys must match exactly.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from areal_mega.inference import sglang_api as api
from areal_mega.inference.sglang_api import SGLangClient
from areal_mega.utils.distributed import resolve_backend
from areal_mega.weight_sync.planner import Bucket, TensorSpec, dtype_name


class WeightSyncError(RuntimeError):
    """A weight sync failed after it started (a server refused a call, a collective failed)."""


# ---------------------------------------------------------------------------------------------
# HTTP side: the calls come from inference.sglang_api (the one route table)


def send_all(servers: Sequence[SGLangClient], call: api.Call | Callable[[SGLangClient], api.Call]) -> list[dict]:
    """Send ``call`` (or ``call(server)``, for per-server bodies) to every server concurrently;
    raise the first error after all calls returned (so no call is left dangling)."""
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as ex:
        futs = [ex.submit(s.send, call(s) if callable(call) else call) for s in servers]
        errors = _collect(futs)
    if errors:
        raise errors[0]
    return [f.result() for f in futs]


# ---------------------------------------------------------------------------------------------
# Collective side


def join_update_group(
    *, backend: str, address: str, port: int, rank: int, world_size: int, group_name: str, timeout_s: float
) -> Any:
    """Create a process group outside this process's default world, with the store layout of
    SGLang's ``init_custom_process_group`` (tcp rendezvous, store prefixed by ``group_name``).

    Rank 0 hosts the TCP store, so ``address`` must be this host's address when ``rank == 0``.
    Uses torch's private ``_new_process_group_helper``: torch has no public API for a second,
    independent world, and SGLang (and every RL framework talking to it) uses the same helper.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    # The TCP store is created directly rather than through rendezvous("tcp://..."): under
    # torchrun, TORCHELASTIC_USE_AGENT_STORE makes rendezvous assume the elastic agent hosts the
    # store, so rank 0 would never start it and every rank (and server) would wait forever.
    store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    # Group rank == rank in this private world, so collectives can name ranks by group rank.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def check_bucket_tensors(bucket: Bucket, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Internal invariant: what the export produced is exactly what the plan announced."""
    assert list(names) == bucket.names, f"export order {list(names)} != plan {bucket.names}"
    for spec, t in zip(bucket.tensors, tensors):
        got = TensorSpec(spec.name, tuple(t.shape), dtype_name(t.dtype))
        assert got == spec, f"exported {got} != planned {spec}"


def keeps_buffers(device: torch.device) -> bool:
    """Whether a sender keeps its pack buffers between syncs: on CPU yes (a fresh buffer page-faults
    more than the copy into it costs); on GPU no -- training needs the memory between syncs, the
    caching allocator makes the next sync's allocation cheap, and a buffer can be a 2 GB
    embedding (the memory plan counts no sync buffers during training)."""
    return device.type == "cpu"


class BroadcastSender:
    """Rank 0 of one learner->servers group: announces each bucket over HTTP and broadcasts it.

    Owns its process group; ``close()`` destroys it on both sides. Not thread-safe (one stage's
    sender drives one bucket at a time, which is also what keeps every server's receive order
    identical to the send order).
    """

    def __init__(
        self,
        servers: Sequence[SGLangClient],
        server_tp_sizes: Sequence[int],
        *,
        group_name: str,
        backend: str,
        address: str,
        port: int,
        timeout_s: float,
        load_format: str = "flattened_bucket",
    ) -> None:
        if load_format not in ("flattened_bucket", "per_tensor"):
            raise ValueError(f"load_format: must be 'flattened_bucket' or 'per_tensor', got {load_format!r}")
        self.servers = list(servers)
        self.server_tp_sizes = list(server_tp_sizes)
        self.group_name = group_name
        self.backend = resolve_backend(backend)
        self.address = address
        self.port = port
        self.timeout_s = timeout_s
        self.load_format = load_format
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.group: Any = None
        # Two flat bucket buffers, reused across buckets: one is being broadcast while the next
        # bucket is packed into the other. On CPU a fresh buffer per bucket costs more than the
        # copy into it (page faults: ~34 ms per 64 MiB on the dev VM vs ~6 ms for the copy), so
        # they are also kept across syncs; on GPU :meth:`release_buffers` hands them back to the
        # caching allocator after each sync, for training (a bucket can be a whole 2 GB embedding).
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.servers)))

    @property
    def world_size(self) -> int:
        return 1 + sum(self.server_tp_sizes)

    def connect(self) -> None:
        """Join the group at rank 0 while every server joins at its rank offset (concurrently:
        each side blocks in the rendezvous until all ranks arrived)."""
        offsets = [1 + sum(self.server_tp_sizes[:i]) for i in range(len(self.servers))]
        futs = [
            self._pool.submit(s.send, api.init_weights_update_group(
                master_address=self.address, master_port=self.port, rank_offset=off,
                world_size=self.world_size, group_name=self.group_name, backend=self.backend))
            for s, off in zip(self.servers, offsets)
        ]
        try:
            self.group = join_update_group(
                backend=self.backend,
                address=self.address,
                port=self.port,
                rank=0,
                world_size=self.world_size,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            )
        finally:
            errors = _collect(futs)
        if errors:
            raise WeightSyncError(f"group {self.group_name}: a server failed to join: {errors[0]}")

    def pack(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers one bucket travels in (flattened_bucket: one uint8 buffer).

        flattened_bucket reuses two buffers in turn, so a packed payload stays valid until the
        pack after next: at most two buckets may be in flight (pack, start, pack, wait, ...)."""
        if self.load_format != "flattened_bucket":
            return [t.detach().contiguous().to(self.device) for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        buf = self._buffers[self._next]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[self._next] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._next ^= 1
        out = buf[:nbytes]
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            # Copy straight into a typed view of the bucket (one copy, also for non-contiguous
            # tensors); the planner starts every tensor at a multiple of its item size.
            out[off : off + n].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
            off += n
        return [out]

    def release_buffers(self) -> None:
        """End of a sync: drop the bucket buffers where :func:`keeps_buffers` says so."""
        if not keeps_buffers(self.device):
            self._buffers = [None, None]

    def start_bucket(
        self,
        bucket: Bucket,
        payload: list[torch.Tensor],
        *,
        weight_version: str | None = None,
        flush_cache: bool = False,
    ) -> Callable[[], None]:
        """Announce ``bucket`` to every server and start broadcasting ``payload`` (from
        :meth:`pack`); returns ``wait()``, which blocks until every server has loaded it and
        raises WeightSyncError if one failed. ``weight_version`` is set on the servers with this
        bucket. Callers pack the next bucket before calling ``wait()``: that overlaps the
        learner's gather/flatten with the servers' load of the previous bucket."""
        assert self.group is not None, "connect() first"
        call = api.update_weights_from_distributed(
            names=bucket.names, dtypes=[t.dtype for t in bucket.tensors], shapes=[t.shape for t in bucket.tensors],
            group_name=self.group_name, flush_cache=flush_cache, weight_version=weight_version,
            load_format="flattened_bucket" if self.load_format == "flattened_bucket" else None)
        futs = [self._pool.submit(s.send, call) for s in self.servers]
        try:
            works = [dist.broadcast(p, group_src=0, group=self.group, async_op=True) for p in payload]
        except BaseException:
            _collect(futs)
            raise

        return lambda: wait_all(works, futs, f"bucket {bucket.stage}/{bucket.index} ({len(bucket.tensors)} tensors)")

    def send_bucket(self, bucket: Bucket, tensors: Sequence[torch.Tensor], **kwargs: Any) -> None:
        """Blocking :meth:`start_bucket`."""
        self.start_bucket(bucket, self.pack(tensors), **kwargs)()

    def close(self) -> None:
        """Destroy the group on the servers and here (best effort: servers may be gone)."""
        if self.group is not None:
            futs = [self._pool.submit(s.send, api.destroy_weights_update_group(self.group_name)) for s in self.servers]
            _collect(futs)
            dist.destroy_process_group(self.group)
            self.group = None
        self._buffers = [None, None]
        self._pool.shutdown(wait=True)


class PackedMessage(NamedTuple):
    """One reshard message ready to send: ``tensor`` goes on the wire once ``copies`` (``(slot in
    the pack buffer, source view)`` pairs; none when the message is a span of one tensor) ran."""

    tensor: torch.Tensor
    copies: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def fill(self) -> torch.Tensor:
        for dst, src in self.copies:
            dst.copy_(src)
        return self.tensor


def prepare_message(message: Any, local: Sequence[Any], out: torch.Tensor) -> PackedMessage:
    """The views of one reshard message (reshard.Message): each piece's box of this rank's local
    megatron tensor (``local[chunk][name]``), cast to the wire dtype, at its offset in ``out`` (a
    reused buffer of at least ``message.nbytes``) -- or, when the pieces are one contiguous span
    of one tensor in the wire dtype (a whole shard, fused gate/up), that span of the tensor itself
    (no copy: the caller must finish sending before the weights change). Views only: the caller
    may keep them for as long as the tensors and ``out`` keep their storage (ReshardTransport)."""
    views = []
    for p in message.pieces:
        src = local[p.src_chunk][p.src_param].detach()
        for d, (a, b) in enumerate(p.src_box):
            src = src.narrow(d, a, b - a)
        views.append(src)
    first = message.pieces[0]
    span = _span(local[first.src_chunk][first.src_param].detach(), views, message.offsets, message.nbytes,
                 getattr(torch, first.dtype)) if all((p.src_chunk, p.src_param) == (first.src_chunk, first.src_param)
                                                     for p in message.pieces) else None
    if span is not None:
        return PackedMessage(span, ())
    buf = out[: message.nbytes]
    return PackedMessage(buf, tuple((buf[off: off + p.nbytes].view(getattr(torch, p.dtype)).view(p.shape), src)
                                    for off, p, src in zip(message.offsets, message.pieces, views)))


def pack_message(message: Any, local: Sequence[Any], out: torch.Tensor) -> torch.Tensor:
    """The flat uint8 buffer of one reshard message (:func:`prepare_message`, filled)."""
    return prepare_message(message, local, out).fill()


def _span(base: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int], nbytes: int,
          dtype: torch.dtype) -> torch.Tensor | None:
    """``base``'s bytes under ``views`` when they lie back to back at ``offsets`` (one contiguous
    span of ``nbytes``, in ``dtype``), else None. The SGLang-side receiver applies the same rule
    to its parameters (tools/env/sglang_reshard.py ``direct_target``)."""
    if not base.is_contiguous() or base.dtype != dtype:
        return None
    start = views[0].data_ptr()
    for v, off in zip(views, offsets):
        if not v.is_contiguous() or v.data_ptr() - start != off:
            return None
    end = views[-1].data_ptr() + views[-1].numel() * views[-1].element_size()
    if end - start != nbytes:
        return None
    first = start - base.data_ptr()
    return base.reshape(-1).view(torch.uint8)[first: first + nbytes]


def wait_all(works: Sequence[Any], futs: list, what: str) -> None:
    """Wait for the collectives ``works``, then for every HTTP call ``futs`` (always, so none is
    left dangling); raise the first call's error as WeightSyncError prefixed by ``what``."""
    try:
        for w in works:
            w.wait()
    finally:
        errors = _collect(futs)
    if errors:
        raise WeightSyncError(f"{what}: {errors[0]}")


def _collect(futs: list) -> list[BaseException]:
    errors = []
    for f in futs:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001 - returned to the caller, which raises
            errors.append(e)
    return errors
