"""Adapter-only weight sync for LoRA learners (docs/lora.md): after an update the servers load
only the adapters, in memory (SGLang >= 0.5.23 ``/load_lora_adapter_from_tensors``, servers
started with ``--enable-lora``), replacing the previous version's adapter under the one name
every generate request names (``ADAPTER``); then the server's ``weight_version`` is bumped, so the
version, pause/resume and staleness rules are those of the full-weight transports. The
alternative for servers that cannot serve LoRA is the merged-weight fallback (lora.sync_chunks).
"""

from __future__ import annotations

import base64
import pickle
import time
from typing import Any, Sequence

import torch.distributed as dist

from areal_mega.inference import sglang_api as api
from areal_mega.inference.server import ServedLora
from areal_mega.inference.sglang_api import SGLangClient, SGLangError
from areal_mega.weight_sync.config import ADAPTER
from areal_mega.weight_sync.base import SyncStats, WeightSync
from areal_mega.weight_sync.transport import WeightSyncError

__all__ = ["ADAPTER", "LoraAdapterSync"]


class LoraAdapterSync(WeightSync):
    """Sends ``model``'s adapters (a MegatronModel with LoRA) as PEFT tensors from rank 0; every
    method collective over the learner world like the other transports'."""

    mode = "lora_adapter"

    def __init__(self, model: Any, *, servers: Sequence[SGLangClient] = (), base_model: str | None = None,
                 api_key: str | None = None) -> None:
        from areal_mega.megatron.lora import peft_config_dict

        if model.lora is None:
            raise ValueError("weight_sync: adapter-only sync needs actor.lora.rank > 0")
        self.model, self.servers, self._api_key = model, list(servers), api_key
        self.lora = ServedLora(ADAPTER, model.lora.rank, tuple(model.lora.target_modules))  # served_lora's
        self.config = peft_config_dict(model.lora, base_model)
        self._loaded: set[str] = set()  # servers holding ADAPTER (unloaded before the next load)
        self._unsure = False  # after a failed sync: any server may or may not hold ADAPTER

    def _check(self, s: SGLangClient) -> int:
        """``s``'s TP size, once it is known to serve adapters of our rank (one line otherwise)."""
        cap = s.capabilities()
        if cap.max_lora_rank < self.model.lora.rank:
            why = (f"max LoRA rank {cap.max_lora_rank}" if cap.max_lora_rank else
                   "started without --enable-lora")
            raise ValueError(f"weight_sync.lora: adapter needs servers serving LoRA rank >= {self.model.lora.rank}; "
                              f"{s.url} has {why} (start it with --enable-lora --max-lora-rank "
                              f"{self.model.lora.rank}, or set weight_sync.lora: merged)")
        if not cap.has("/load_lora_adapter_from_tensors"):
            raise ValueError(f"weight_sync.lora: adapter needs SGLang >= 0.5.23 (/load_lora_adapter_from_tensors); "
                              f"{s.url} runs {cap.sglang_version or 'an older version'}; set weight_sync.lora: merged")
        return cap.tp_size

    @property
    def server_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def set_targets(self, urls: Sequence[str]) -> None:
        known = {s.url: s for s in self.servers}
        self.servers = [known.get(u) or SGLangClient(u, api_key=self._api_key) for u in urls]

    def sync(self, version: int) -> SyncStats:
        from areal_mega.megatron.lora import peft_state_on_rank0

        t0 = time.perf_counter()
        state = peft_state_on_rank0(self.model)
        gathered = time.perf_counter()
        err, nbytes = None, 0
        if dist.get_rank() == 0:
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            payload = base64.b64encode(pickle.dumps(state)).decode()
            try:
                for s in self.servers:
                    tp = self._check(s)  # every rank of the server takes the whole adapter and slices it
                    if s.url in self._loaded:  # SGLang refuses a second adapter under one name
                        s.send(api.unload_lora_adapter(ADAPTER))
                        self._loaded.discard(s.url)
                    elif self._unsure:
                        try:
                            s.send(api.unload_lora_adapter(ADAPTER))
                        except SGLangError:
                            pass  # it did not hold one
                    s.send(api.load_lora_adapter_from_tensors(ADAPTER, self.config, [payload] * tp))
                    self._loaded.add(s.url)
                    s.send(api.flush_cache())  # as the full transports flush after an update
                    s.send(api.update_weight_version(version))  # after the adapter: the version means it
            except (SGLangError, ValueError) as e:  # ValueError: _check's refusal
                err = str(e)
        box = [err]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:  # the trainer closes and retries once (a restarted server holds no adapter)
            raise WeightSyncError(f"adapter-only weight sync of version {version}: {box[0]}")
        self._unsure = False
        t1 = time.perf_counter()
        return SyncStats(version=version, bytes=nbytes, seconds=t1 - t0, num_buckets=1, mode=self.mode,
                         phase_s={"gather": gathered - t0, "load": t1 - gathered})

    def close(self) -> None:
        # No process groups (HTTP only). After a failed sync the servers' state is unknown (a
        # restarted one holds no adapter): the next sync unloads where it can, then loads.
        self._loaded.clear()
        self._unsure = True
