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
from areal_mega.inference.sglang_api import SGLangClient, SGLangError
from areal_mega.weight_sync.sync import SyncStats, WeightSync

ADAPTER = "policy"
"""The name the servers hold the current adapter under (requests send it as ``lora_path``)."""


class LoraAdapterSync(WeightSync):
    """Sends ``model``'s adapters (a MegatronModel with LoRA) as PEFT tensors from rank 0; every
    method collective over the learner world like the other transports'."""

    mode = "lora_adapter"

    def __init__(self, model: Any, *, servers: Sequence[SGLangClient] = (), base_model: str | None = None,
                 api_key: str | None = None, server_tp: int = 1) -> None:
        from areal_mega.megatron.lora import peft_config_dict

        if model.lora is None:
            raise ValueError("weight_sync: adapter-only sync needs actor.lora.rank > 0")
        self.model, self.servers, self._api_key, self.server_tp = model, list(servers), api_key, server_tp
        self.config = peft_config_dict(model.lora, base_model)
        self._loaded: set[str] = set()  # servers holding ADAPTER (unloaded before the next load)

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
                    if s.url in self._loaded:  # SGLang refuses a second adapter under one name
                        s.send(api.unload_lora_adapter(ADAPTER))
                        self._loaded.discard(s.url)
                    s.send(api.load_lora_adapter_from_tensors(ADAPTER, self.config, [payload] * self.server_tp))
                    self._loaded.add(s.url)
                    s.send(api.update_weight_version(version))  # after the adapter: the version means it
            except SGLangError as e:
                err = str(e)
        box = [err]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise RuntimeError(f"adapter-only weight sync of version {version}: {box[0]}")
        t1 = time.perf_counter()
        return SyncStats(version=version, bytes=nbytes, seconds=t1 - t0, num_buckets=1, mode=self.mode,
                         phase_s={"gather": gathered - t0, "load": t1 - gathered})

    def close(self) -> None:
        pass  # no process groups: HTTP only
