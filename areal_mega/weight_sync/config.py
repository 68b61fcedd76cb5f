"""Settings read by weight sync (owned here; the trainer's config nests :class:`WeightSyncConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

__all__ = ["WeightSyncConfig"]

MiB = 1 << 20


@dataclass
class WeightSyncConfig:
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "pause_mode": "set inference.client.pause_mode (the one pause mode: the pool pauses the servers "
                      "around a weight sync)",
        "pause_servers": "the trainer pauses through its rollout service (scripts pause the servers around "
                         "a sync themselves)",
    }
    """Keys that were removed, with where their setting lives now (a one-line error names it)."""

    mode: Literal["reshard", "broadcast", "disk"] = "broadcast"
    """"reshard": every learner rank sends what it owns straight to the SGLang ranks that need it,
    each engine rank receiving only its shard in SGLang's own layout (weight_sync/reshard.py;
    needs areal_mega's receiver in the SGLang environment, docs/weight_sync.md; a server without
    it falls back to broadcast with one printed line). "broadcast": one sender per pipeline stage
    broadcasts full HF tensors to every TP rank of every server (SGLang's
    /update_weights_from_distributed). "disk": save HF safetensors to ``disk_dir`` and call
    /update_weights_from_disk (for clusters where learners and servers cannot share a group)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend of the learner<->server groups; "auto" = nccl when CUDA is available,
    else gloo. The servers must support the same backend (CPU SGLang: gloo)."""
    bucket_mib: float = 512.0
    """Bucket size in MiB: tensors are packed into buckets of at most this many bytes, one
    broadcast per bucket (a tensor larger than a bucket gets a bucket of its own). Each stage
    sender packs into two buffers of the largest bucket (one packed while the other is sent), kept
    between syncs on CPU and released after each sync on GPU."""
    load_format: Literal["flattened_bucket", "per_tensor"] = "flattened_bucket"
    """"flattened_bucket": one uint8 buffer per bucket (one collective per bucket);
    "per_tensor": one broadcast per tensor (older servers)."""
    master_address: str = "127.0.0.1"
    """Address the servers use to reach the learner's stage senders (their TCP rendezvous)."""
    master_port_base: int = 0
    """First rendezvous port; stage s uses master_port_base + s. 0 = pick free ports."""
    group_name_prefix: str = "areal_wsync"
    """Prefix of the group names registered on the servers ("<prefix>_s<stage>" per stage when
    broadcasting, "<prefix>_reshard" for the one reshard group)."""
    disk_dir: str = ""
    """Shared directory (visible to learners and servers) for mode == "disk"."""
    check_model: bool = True
    """Check the plan (names, shapes, dtypes) against each server's model config before sending."""
    http_timeout_s: float = 600.0
    """Timeout of one HTTP call to a server (a bucket update includes its broadcast)."""
    group_timeout_s: float = 300.0
    """Timeout of the learner<->server group rendezvous."""
    server_wait_s: float = 600.0
    """When no inference server is live at a sync (all down or restarting), how long to wait
    for one to come back before the run fails. Covers a pool restart of a dead server."""

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mib * MiB))

    def validate(self) -> None:
        if self.mode not in ("reshard", "broadcast", "disk"):
            hint = " ('distributed' is now 'broadcast')" if self.mode == "distributed" else ""
            raise ValueError(f"mode: {self.mode!r} is not one of reshard, broadcast, disk{hint}")
        if self.bucket_mib <= 0:
            raise ValueError(f"bucket_mib: must be > 0, got {self.bucket_mib}")
        if self.mode == "disk" and not self.disk_dir:
            raise ValueError("disk_dir: required when mode is 'disk'")
        if not 0 <= self.master_port_base < 65536:
            raise ValueError(f"master_port_base: must be in [0, 65535], got {self.master_port_base}")
        if self.http_timeout_s <= 0 or self.group_timeout_s <= 0:
            raise ValueError("http_timeout_s / group_timeout_s: must be > 0")
        if self.server_wait_s < 0:
            raise ValueError(f"server_wait_s: must be >= 0, got {self.server_wait_s}")
