"""Settings read by weight sync (owned here; the trainer's config nests :class:`WeightSyncConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from areal_mega.inference.server import ServedLora

__all__ = ["ADAPTER", "WeightSyncConfig"]

MiB = 1 << 20

ADAPTER = "policy"
"""The name the servers hold the current LoRA adapter under (requests send it as ``lora_path``)."""


@dataclass
class WeightSyncConfig:
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
    lora: Literal["auto", "merged", "adapter"] = "auto"
    """How a LoRA actor (actor.lora.rank > 0) reaches the servers (docs/lora.md, "Weight sync").
    "adapter": only the adapters, loaded in memory under one name that every generate request
    names (SGLang >= 0.5.23; the servers areal_mega starts get ``--enable-lora ...``; servers at
    ``inference.addresses`` must have been started with it: checked at the first load, before any
    rollout). "merged": W + scaling * B A as full weights over ``mode``'s transport (any server).
    "auto": adapter, except with ``inference.server.quantization`` fp8 (no adapters on a quantized
    base) or ``inference.client.pause_mode`` other than abort (SGLang keeps a request held across
    the adapter swap on the old adapter) or with MoE expert adapters (SGLang's MoE LoRA path is
    GPU-only and unchecked against PEFT's fused-expert adapters): merged; "adapter" there is
    refused. Ignored without LoRA."""
    server_wait_s: float = 600.0
    """When no inference server is live at a sync (all down or restarting), how long to wait
    for one to come back before the run fails. Covers a pool restart of a dead server."""

    def served_lora(self, lora: Any, quantization: str = "none", pause_mode: str = "abort") -> ServedLora | None:
        """The one choice of ``lora`` for an actor with ``lora`` (its LoraConfig): what the servers
        serve when only the adapters travel (weight_sync/lora_sync.py), None when full or merged
        weights do (no LoRA, or merged). Pure: the trainer's weight sync and the launcher's server
        command both ask it."""
        if lora is None or not lora.enabled or self.lora == "merged":
            return None
        if quantization != "none":
            if self.lora == "adapter":
                raise ValueError(f"weight_sync.lora: adapter cannot serve adapters on an {quantization} base "
                                 f"(inference.server.quantization); set weight_sync.lora: merged")
            return None
        if lora.expert_targets:
            if self.lora == "adapter":
                raise ValueError(f"weight_sync.lora: adapter does not serve MoE expert adapters "
                                 f"({lora.expert_targets} in actor.lora.target_modules: SGLang's MoE LoRA is "
                                 f"unverified here); set weight_sync.lora: merged")
            return None
        # SGLang binds a request to the adapter loaded when it arrived: one held across the swap
        # (retract / in_place) continues on the unloaded adapter, i.e. the base (measured, docs/lora.md);
        # abort returns it and the client resubmits it under the new adapter.
        if pause_mode != "abort":
            if self.lora == "adapter":
                raise ValueError(f"weight_sync.lora: adapter needs inference.client.pause_mode: abort (requests held "
                                 f"across an adapter swap keep the old adapter), got {pause_mode!r}; or set "
                                 f"weight_sync.lora: merged")
            return None
        return ServedLora(ADAPTER, lora.rank, tuple(lora.target_modules))

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mib * MiB))

    def validate(self) -> None:
        if self.mode not in ("reshard", "broadcast", "disk"):
            raise ValueError(f"mode: {self.mode!r} is not one of reshard, broadcast, disk")
        if self.bucket_mib <= 0:
            raise ValueError(f"bucket_mib: must be > 0, got {self.bucket_mib}")
        if self.mode == "disk" and not self.disk_dir:
            raise ValueError("disk_dir: required when mode is 'disk'")
        if not 0 <= self.master_port_base < 65536:
            raise ValueError(f"master_port_base: must be in [0, 65535], got {self.master_port_base}")
        if self.http_timeout_s <= 0 or self.group_timeout_s <= 0:
            raise ValueError("http_timeout_s / group_timeout_s: must be > 0")
        if self.lora not in ("auto", "merged", "adapter"):
            raise ValueError(f"lora: {self.lora!r} is not one of auto, merged, adapter")
        if self.server_wait_s < 0:
            raise ValueError(f"server_wait_s: must be >= 0, got {self.server_wait_s}")
