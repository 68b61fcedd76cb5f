"""The SGLang HTTP API in one place: every route areal_mega calls, its request body, and what a
server supports. The inference pool (async, ``inference.client.ServerHandle``) and weight sync
(blocking, :class:`SGLangClient`, from sender threads that also drive collectives) both build
their calls here, so a change of SGLang's API is one edit. Bodies follow SGLang 0.5.23's
``io_struct``; the route table: docs/inference.md ("The SGLang HTTP API").
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

# SGLang version in which /begin_weight_update + /end_weight_update were verified; used only when
# the server hides its route list (/openapi.json disabled).
WEIGHT_UPDATE_SESSION_SINCE = (0, 5, 23)

# What every SGLang 0.5.x serves, for servers that hide /openapi.json (DISABLE_OPENAPI_DOC).
_BASE_ROUTES = frozenset({
    "/generate", "/health", "/model_info", "/server_info", "/pause_generation", "/continue_generation",
    "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group",
})


class SGLangError(RuntimeError):
    """A server answered a call with a non-2xx status (``status``), or, with ``status`` None,
    could not be reached / answered ``success: false``."""

    def __init__(self, url: str, path: str, status: int | None, body: str) -> None:
        where = f"{url}{path}"
        super().__init__(f"{where}: HTTP {status}: {body[:500]}" if status is not None else f"{where}: {body[:500]}")
        self.url = url
        self.path = path
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Call:
    """One HTTP call: method, path and JSON body (None = no body)."""

    method: str
    path: str
    body: dict[str, Any] | None = None


# -- the calls ------------------------------------------------------------------------------------

def generate(input_ids: Sequence[int], sampling_params: dict[str, Any], rid: str, *,
             return_routes: bool = False, lora: str | None = None) -> Call:
    body = {"input_ids": list(input_ids), "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
    if lora is not None:  # the LoRA adapter (loaded by name) this request runs with
        body["lora_path"] = lora
    if return_routes:  # meta_info.routed_experts: base64 int32 [len(input) + len(output) - 1, layers, top_k]
        body["return_routed_experts"] = True
    return Call("POST", "/generate", body)


def load_lora_adapter_from_tensors(name: str, config: dict[str, Any], payloads: Sequence[str]) -> Call:
    """An adapter held in memory by ``name`` (``config``: PEFT's adapter_config.json; ``payloads``:
    one base64 pickle of {PEFT key: tensor} per server TP rank). SGLang >= 0.5.23, --enable-lora."""
    return Call("POST", "/load_lora_adapter_from_tensors",
                {"lora_name": name, "config_dict": dict(config), "serialized_named_tensors": list(payloads)})


def unload_lora_adapter(name: str) -> Call:
    return Call("POST", "/unload_lora_adapter", {"lora_name": name})


def flush_cache() -> Call:
    """Drop the radix (prefix) cache; refused (400) while requests are running or waiting."""
    return Call("POST", "/flush_cache", {})


def update_weight_version(version: int | str) -> Call:
    return Call("POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})


def decode_routes(meta_info: dict[str, Any], num_rows: int) -> np.ndarray:
    """``meta_info.routed_experts`` -> int16 [num_rows, layers * top_k]. Raises ValueError when
    it is missing (the server runs without --enable-return-routed-experts) or its size is not
    a multiple of ``num_rows``."""
    raw = meta_info.get("routed_experts")
    if raw is None:
        raise ValueError("routed_experts: the server returned no routes (started without "
                         "--enable-return-routed-experts?)")
    flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    if num_rows < 1 or flat.size % num_rows:
        raise ValueError(f"routed_experts: {flat.size} expert ids do not split into {num_rows} token rows")
    return flat.reshape(num_rows, -1).astype(np.int16)


def classify(input_ids: Sequence[int]) -> Call:
    return Call("POST", "/classify", {"input_ids": list(input_ids)})


def pause_generation(mode: str = "abort") -> Call:
    """abort: in-flight requests return at once with finish_reason abort and their partial
    tokens; retract / in_place: they are held and resume after continue_generation."""
    return Call("POST", "/pause_generation", {"mode": mode})


def continue_generation() -> Call:
    return Call("POST", "/continue_generation", {})


def health() -> Call:
    """200 once the server serves (it runs a one-token generation: never answers while paused)."""
    return Call("GET", "/health")


def model_info() -> Call:
    return Call("GET", "/model_info")


def server_info() -> Call:
    return Call("GET", "/server_info")


def openapi() -> Call:
    return Call("GET", "/openapi.json")


def init_weights_update_group(*, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str) -> Call:
    """The learner joins the same group at rank 0 at the same time; the server's TP ranks join at
    ``rank_offset + tp_rank``."""
    return Call("POST", "/init_weights_update_group", {
        "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
        "world_size": world_size, "group_name": group_name, "backend": backend})


def begin_weight_update() -> Call:
    return Call("POST", "/begin_weight_update", {})


def end_weight_update() -> Call:
    return Call("POST", "/end_weight_update", {})


def update_weights_from_distributed(*, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                    group_name: str, flush_cache: bool, weight_version: int | str | None,
                                    load_format: str | None) -> Call:
    """The server receives ``names`` by broadcast from group rank 0, in this order;
    ``load_format "flattened_bucket"`` = one uint8 buffer of the tensors' bytes back to back."""
    body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                            "group_name": group_name, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    if load_format is not None:
        body["load_format"] = load_format
    return Call("POST", "/update_weights_from_distributed", body)


def update_weights_from_tensor(*, payloads: Sequence[str], load_format: str | None, flush_cache: bool,
                               weight_version: int | str | None) -> Call:
    """``payloads[tp_rank]``: base64 of that TP rank's pickled ``[(name, tensor)]`` (each rank
    deserializes only its own); ``load_format`` a registered ``--custom-weight-loader`` path, or
    "direct" / None. Must sit inside /begin_weight_update ... /end_weight_update (0.5.23)."""
    body: dict[str, Any] = {"serialized_named_tensors": list(payloads), "flush_cache": flush_cache}
    if load_format is not None:
        body["load_format"] = load_format
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return Call("POST", "/update_weights_from_tensor", body)


def update_weights_from_disk(model_path: str, weight_version: int | str | None, flush_cache: bool = True) -> Call:
    body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return Call("POST", "/update_weights_from_disk", body)


def destroy_weights_update_group(group_name: str) -> Call:
    return Call("POST", "/destroy_weights_update_group", {"group_name": group_name})


# -- capabilities ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerCapabilities:
    """What one server supports: ``routes`` from its /openapi.json, or, where that is disabled,
    from its version (``sglang_version``)."""

    sglang_version: str
    routes: frozenset[str]
    tp_size: int = 1
    dtype: str = "auto"
    ep_size: int = 1
    custom_weight_loaders: tuple[str, ...] = ()
    """``--custom-weight-loader`` import paths the server registered (the reshard receiver's)."""
    max_lora_rank: int = 0
    """``--max-lora-rank`` of a server started with ``--enable-lora``; 0: it serves no adapters."""

    @property
    def weight_update_session(self) -> bool:
        """True if distributed/tensor updates must be wrapped in /begin_weight_update and
        /end_weight_update (SGLang 0.5.23 answers 400 otherwise; 0.5.9/0.5.15 lack both)."""
        return "/begin_weight_update" in self.routes and "/end_weight_update" in self.routes

    def has(self, path: str) -> bool:
        return path in self.routes


def version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def capabilities_from(server_info: dict | None, openapi_spec: dict | None) -> ServerCapabilities:
    """The one capability detection: ``server_info`` is /server_info's answer, ``openapi_spec``
    /openapi.json's (None when the server answered 404: route list hidden)."""
    info = server_info if isinstance(server_info, dict) else {}
    version = str(info.get("version", ""))
    if isinstance(openapi_spec, dict):
        routes = frozenset(openapi_spec.get("paths", {}))
    else:
        routes = _BASE_ROUTES
        if version_tuple(version) >= WEIGHT_UPDATE_SESSION_SINCE:
            routes |= {"/begin_weight_update", "/end_weight_update"}
    return ServerCapabilities(sglang_version=version, routes=routes, tp_size=int(info.get("tp_size", 1) or 1),
                              dtype=str(info.get("dtype", "auto")), ep_size=int(info.get("ep_size", 1) or 1),
                              custom_weight_loaders=tuple(info.get("custom_weight_loader") or ()),
                              max_lora_rank=int(info.get("max_lora_rank") or 0) if info.get("enable_lora") else 0)


# -- the blocking client --------------------------------------------------------------------------

class SGLangClient:
    """Blocking JSON-over-HTTP access to ONE SGLang server (stdlib only).

    Weight sync uses it: its calls are few and long, issued from sender threads that also drive
    collectives, where an event loop buys nothing. ``url`` is ``http://host:port`` or ``host:port``.
    """

    def __init__(self, url: str, *, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.url = (url if url.startswith("http") else "http://" + url).rstrip("/")
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._capabilities: ServerCapabilities | None = None

    def __repr__(self) -> str:
        return f"SGLangClient({self.url})"

    def send(self, call: Call) -> dict:
        """Make ``call``; the JSON answer (a non-dict answer comes as ``{"result": ...}``, a
        non-JSON one as ``{"text": ...}``). Raises SGLangError on a non-2xx status, on a
        transport failure, or on an answer with ``success: false``."""
        data = None if call.body is None else json.dumps(call.body).encode()
        req = urllib.request.Request(self.url + call.path, data=data, method=call.method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(self.url, call.path, e.code, e.read().decode(errors="replace")) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise SGLangError(self.url, call.path, None, str(e)) from None
        if not raw:
            return {}
        try:
            out = json.loads(raw)
        except json.JSONDecodeError:
            return {"text": raw.decode(errors="replace")}
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(self.url, call.path, None, str(out.get("message")))
        return out if isinstance(out, dict) else {"result": out}

    def capabilities(self, refresh: bool = False) -> ServerCapabilities:
        """The one capability detection (the async pool runs it in a thread): cached, unless
        ``refresh`` (a restarted server may run another SGLang)."""
        if self._capabilities is None or refresh:
            try:
                spec = self.send(openapi())
            except SGLangError as e:
                if e.status != 404:
                    raise
                spec = None
            try:
                info = self.send(server_info())
            except SGLangError as e:  # SGLang < 0.5 only has the deprecated name
                if e.status != 404:
                    raise
                info = self.send(Call("GET", "/get_server_info"))
            self._capabilities = capabilities_from(info, spec)
        return self._capabilities

    def model_info(self) -> dict:
        return self.send(model_info())

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))
