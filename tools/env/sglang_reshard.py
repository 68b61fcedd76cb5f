"""areal_mega's resharding receiver inside SGLang (installed as ``areal_mega_sglang_reshard``).

Every TP rank of an SGLang server receives only its own shard, straight from the learner ranks
that own it, and writes it into its own (fused, sharded) parameters. The extension point is
SGLang's custom weight loader (0.5.23): the server starts with

    --custom-weight-loader areal_mega_sglang_reshard.receive

and the learner calls ``/update_weights_from_tensor`` with ``load_format`` equal to that path and
one payload per TP rank (``serialized_named_tensors[tp_rank]``): a single uint8 tensor holding a
JSON command for that rank. Inside the weight-update session SGLang calls ``receive(model,
named_tensors)`` on every TP rank; the HTTP call returns when every rank has returned.

Commands (one per call, per rank)::

    {"op": "join",  "group": name, "backend", "address", "port", "world_size", "rank", "timeout_s"}
    {"op": "check", "group": name, "params": {sglang name: [shape, dtype]},
     "messages": [[src, nbytes, [[param, index, box, dtype, offset], ...]], ...]}  -> status to rank 0
    {"op": "sync",  "group": name[, "messages": [...]]}                         -> status to rank 0
    {"op": "leave", "group": name}

A passed ``check`` keeps the rank's messages (the plan's, the same every sync) for the group, so
a ``sync`` command is a few bytes (SGLang forwards every payload to every TP rank); a ``sync``
that carries its own messages (the bench's raw transfer) uses those. ``sync`` receives the
messages in the given order (the plan's deadlock-free order, see
areal_mega/weight_sync/reshard.py): a message whose pieces lie back to back in one parameter
(``direct_target``) straight into the parameter; the others into two reused flat
buffers (the next arrives while this one is written), each piece then copied into place. A failure never raises into SGLang's scheduler (that would kill
the server): the rank keeps draining its messages so the learner's senders never hang, then
reports the error in its status (a fixed-size JSON message to group rank 0, the learner's
coordinator), and the learner raises it.

Version-checked at import: the SGLang versions whose parameter layout areal_mega's planner
(areal_mega/weight_sync/sglang_layout.py) was read from. Only torch and SGLang are imported: this
file is copied into the SGLang environment (tools/env/make_venv.sh; containers: docs/weight_sync.md).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

PROTOCOL = 3
"""2 -> 3: a sync runs SGLang's post_load_weights for what it wrote (``post_load``; MLA needs it)."""
SUPPORTED_SGLANG = ("0.5.23",)
STATUS_BYTES = 4096
COMMAND = "areal_mega_reshard"
"""The one tensor name of a payload."""

logger = logging.getLogger("areal_mega_sglang_reshard")


def unsupported() -> str | None:
    """Why this SGLang cannot be resharded into, or None. Checked when imported (logged) and by
    every ``check`` (reported to the learner, which refuses before sending): an unsupported
    version never raises into SGLang, whose scheduler would die of it."""
    try:
        from sglang.version import __version__
    except ImportError:  # imported outside SGLang (the learner's tests): nothing to check
        return None
    if __version__ not in SUPPORTED_SGLANG:
        return (f"areal_mega_sglang_reshard: SGLang {__version__} is not supported (parameter layouts read from "
                f"{SUPPORTED_SGLANG}); use weight_sync.mode broadcast")
    return None


if unsupported():
    logging.getLogger(__name__).error(unsupported())

_groups: dict[str, dict] = {}
"""group name -> {"pg", "rank", "buf"}: this process's learner<->engine groups."""


def decode_payload(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.detach().cpu().contiguous().numpy().tobytes()).decode())


def encode_status(status: dict, device: torch.device | str = "cpu") -> torch.Tensor:
    raw = json.dumps(status).encode()[: STATUS_BYTES - 1]
    out = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out.to(device)


def decode_status(t: torch.Tensor) -> dict:
    raw = bytes(t.cpu().numpy().tobytes()).rstrip(b"\0")
    return json.loads(raw.decode())


def _dst(params: dict[str, torch.Tensor], piece: list) -> torch.Tensor:
    """The view ``param[index][box]`` of one piece ``[param, index, box, dtype, offset]``."""
    name, index, box = piece[0], piece[1], piece[2]
    dst = params[name].data
    for i in index:
        dst = dst[i]
    for d, (a, b) in enumerate(box):
        dst = dst.narrow(d, a, b - a)
    return dst


def write_piece(params: dict[str, torch.Tensor], buf: torch.Tensor, piece: list) -> None:
    """Copy one piece out of the flat uint8 ``buf`` into ``param[index][box]``."""
    dst = _dst(params, piece)
    dt = getattr(torch, piece[3])
    off = piece[4]
    src = buf[off: off + dst.numel() * dt.itemsize].view(dt).view(dst.shape)
    dst.copy_(src)


def direct_target(params: dict[str, torch.Tensor], message: list) -> torch.Tensor | None:
    """The parameter bytes a message can be received into directly (no buffer, no write): its
    pieces lie back to back, in order, in one contiguous parameter of the wire dtype (a whole
    shard, or fused qkv rows); else None. The sender sends the same bytes either way (the plan
    orders a destination's pieces by memory: areal_mega/weight_sync/reshard.py ``_cut``)."""
    src, nbytes, pieces = message
    if not pieces or any(p[0] != pieces[0][0] for p in pieces):
        return None
    base = params[pieces[0][0]].data
    if not base.is_contiguous() or str(base.dtype).removeprefix("torch.") != pieces[0][3]:
        return None
    views = [_dst(params, p) for p in pieces]
    start = views[0].data_ptr()
    for v, p in zip(views, pieces):
        if v.data_ptr() - start != p[4] or not v.is_contiguous():
            return None
    if views[-1].data_ptr() + views[-1].numel() * views[-1].element_size() - start != nbytes:
        return None
    first = start - base.data_ptr()
    return base.reshape(-1).view(torch.uint8)[first: first + nbytes]


def apply_messages(params: dict[str, torch.Tensor], messages: list, received) -> str | None:
    """Write the pieces of every message, ``received`` yielding each message's buffer in order
    (None: it was received in place); returns the first error (after draining every message) or None."""
    error = None
    for (src, nbytes, pieces), buf in zip(messages, received):
        if error is not None or buf is None:
            continue
        try:
            for p in pieces:
                write_piece(params, buf, p)
        except Exception as e:  # noqa: BLE001 - reported to the learner, never raised into SGLang
            error = f"{type(e).__name__}: {e}"
    return error


def post_load(model: torch.nn.Module, written: list[str]) -> None:
    """What SGLang's own ``load_weights`` runs after loading, for the parameters a sync wrote:
    DeepseekV2's ``post_load_weights(weight_names=...)`` derives the absorbed MLA ``w_kc`` /
    ``w_vc`` from each written ``kv_b_proj`` (deepseek_weight_loader.py ~586-820, copied in place
    by ``bind_or_assign``). A tensor update does not run it, so without this the server would
    serve the old ``w_kc`` / ``w_vc``. SGLang's own code path: the receiver adds no math of its own."""
    kv_b = sorted(n for n in written if ".kv_b_proj." in n)
    if kv_b and hasattr(model, "post_load_weights"):
        model.post_load_weights(weight_names=kv_b)


def keeps_buffers(device: torch.device) -> bool:
    """Whether this rank keeps its two receive buffers between syncs: on CPU yes (fresh memory
    page-faults), on GPU no (the server's activations need the memory). The learner's senders
    follow the same rule (areal_mega/weight_sync/transport.py ``keeps_buffers``; a test holds
    the two equal)."""
    return torch.device(device).type == "cpu"


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _join(cmd: dict, model: torch.nn.Module, entered: float) -> None:
    from sglang.srt.utils import init_custom_process_group

    old = _groups.pop(cmd["group"], None)
    if old is not None:
        dist.destroy_process_group(old["pg"])
    pg = init_custom_process_group(backend=cmd["backend"], init_method=f"tcp://{cmd['address']}:{cmd['port']}",
                                   world_size=cmd["world_size"], rank=cmd["rank"], group_name=cmd["group"],
                                   timeout=timedelta(seconds=cmd.get("timeout_s", 300)))
    dev = _device(model) if cmd["backend"] == "nccl" else torch.device("cpu")
    _groups[cmd["group"]] = {"pg": pg, "rank": cmd["rank"], "buf": None, "device": dev}


def _report(g: dict, status: dict) -> None:
    dist.send(encode_status({"rank": g["rank"], "protocol": PROTOCOL, **status}, g["device"]), group_dst=0, group=g["pg"])


def _check(cmd: dict, model: torch.nn.Module, entered: float) -> None:
    g = _groups[cmd["group"]]
    params = _params(model)
    problems = [unsupported()] if unsupported() else []
    for name, (shape, dtype) in cmd["params"].items():
        p = params.get(name)
        if p is None:
            problems.append(f"{name}: no such parameter")
        elif list(p.shape) != list(shape) or str(p.dtype).removeprefix("torch.") != dtype:
            problems.append(f"{name}: engine has {list(p.shape)} {str(p.dtype).removeprefix('torch.')}, "
                            f"plan says {list(shape)} {dtype}")
    g["messages"], g["targets"] = (cmd.get("messages") if not problems else None), None
    _report(g, {"ok": not problems, "error": "; ".join(problems[:5]), "num_params": len(params)})


def _received(g: dict, messages: list, targets: list):
    """Each message's buffer, in order (None for one received straight into its parameter); the
    next message is already being received (into the other of two reused buffers, or in place)
    while the caller writes this one. Receives stay in plan order, so the plan's deadlock-freedom
    holds (posting a receive early only helps)."""
    def post(k: int):
        src, nbytes, _ = messages[k]
        buf = targets[k] if targets[k] is not None else g["bufs"][k % 2][:nbytes]
        return (None if targets[k] is not None else buf), dist.irecv(buf, group_src=src, group=g["pg"])

    cur = post(0) if messages else None
    for k in range(len(messages)):
        buf, work = cur
        t = time.perf_counter()
        work.wait()
        g["wait_s"] += time.perf_counter() - t
        cur = post(k + 1) if k + 1 < len(messages) else None
        yield buf


def _sync(cmd: dict, model: torch.nn.Module, entered: float) -> None:
    g = _groups[cmd["group"]]
    kept = "messages" not in cmd
    messages = g.get("messages") if kept else cmd["messages"]
    if messages is None:  # nothing to drain: the learner sends only after a passed check
        _report(g, {"ok": False, "error": "sync before a passed check (no plan kept for this group)"})
        return
    params = _params(model)
    # The kept plan's targets are views: reused while every parameter keeps its storage (the
    # views hold the old storage alive, so an equal address is the same memory); SGLang may
    # re-create parameters (a disk load, a repack), which recomputes them.
    key = tuple((n, p.data.data_ptr(), p.dtype, tuple(p.shape)) for n, p in params.items())
    cached = g.get("targets")
    if kept and cached is not None and cached[0] == key:
        targets, error = cached[1], None
    else:
        if kept:
            g["targets"] = None  # release the old views first
        targets, error = [], None
        for m in messages:
            try:
                targets.append(direct_target(params, m))
            except Exception as e:  # noqa: BLE001 - a bad piece: drained into a buffer, reported below
                targets.append(None)
                error = error or f"{type(e).__name__}: {e}"
        if kept and error is None:
            g["targets"] = (key, targets)
    need = max((m[1] for m, t in zip(messages, targets) if t is None), default=0)
    if g["buf"] is None or g["buf"].numel() < 2 * need:  # two flat buffers, reused (no page faults per message)
        g["buf"] = torch.empty(2 * need, dtype=torch.uint8, device=g["device"])
    g["bufs"] = (g["buf"][:need], g["buf"][need: 2 * need])
    g["wait_s"], t0, started = 0.0, time.perf_counter(), time.time()
    error = apply_messages(params, messages, _received(g, messages, targets)) or error
    if error is None:
        try:
            post_load(model, sorted({p[0] for m in messages for p in m[2]}))
        except Exception as e:  # noqa: BLE001 - reported to the learner, never raised into SGLang
            error = f"post_load_weights: {type(e).__name__}: {e}"
    if not keeps_buffers(g["device"]):
        g["buf"] = g["bufs"] = None
    received = sum(m[1] for m in messages)
    # where this rank's time went (the learner logs it): waiting on the wire vs everything else
    # (writes of packed pieces, posting receives); wall-clock times of entering the loader,
    # starting to receive and finishing, to place this rank on the learner's timeline
    _report(g, {"ok": error is None, "error": error or "", "bytes": received,
                "in_place_bytes": sum(m[1] for m, t in zip(messages, targets) if t is not None),
                "seconds": round(time.perf_counter() - t0, 6), "wait_s": round(g["wait_s"], 6),
                "entered": entered, "started": started, "finished": time.time()})


def _leave(cmd: dict, model: torch.nn.Module, entered: float) -> None:
    g = _groups.pop(cmd["group"], None)
    if g is not None:
        dist.destroy_process_group(g["pg"])


_OPS = {"join": _join, "check": _check, "sync": _sync, "leave": _leave}


def receive(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang custom weight loader: run this rank's command. Never raises into the scheduler."""
    entered = time.time()
    for name, tensor in named_tensors:
        try:
            cmd = decode_payload(tensor) if name == COMMAND else None
            if cmd is None or cmd.get("op") not in _OPS:
                logger.error("areal_mega_sglang_reshard: unknown payload %r", name)
                continue
            with torch.no_grad():
                _OPS[cmd["op"]](cmd, model, entered)
        except Exception:  # noqa: BLE001 - a raise here would take the server down
            logger.exception("areal_mega_sglang_reshard: %s failed", name)
