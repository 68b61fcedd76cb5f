"""One episode's engine calls, recorded so that a checkpoint can save the episode mid-way and a
resumed run can continue it instead of generating it again (docs/resume.md).

Every ``agenerate`` call of an episode goes through its :class:`EpisodeJournal`, which records
the call (a hash of its input ids) and its answer: tokens, behaviour log-probs, policy versions.
A checkpoint saves each call -- finished ones whole, the one in flight with the tokens it holds
(``InferencePool.partial`` after an abort-pause). The resumed episode runs its workflow again
with the saved calls (the replay contract, ``RolloutWorkflow.replayable``): a call whose input
matches a saved finished call is answered from it, one that matches a saved partial call
continues after its tokens (``GenerationRequest.prefix``), and a call the log does not have
(the workflow went another way: ``diverged``) goes to the servers as usual.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import uuid
from typing import Any

import numpy as np

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest, GenerationResult

__all__ = ["EpisodeJournal", "call_key"]


def call_key(input_ids: list[int], max_new_tokens: int) -> str:
    """What identifies a call in a saved log: its input ids and token budget (a hash: the ids
    themselves would double the checkpoint)."""
    h = hashlib.sha1(np.asarray(input_ids, dtype=np.int64).tobytes())
    h.update(str(max_new_tokens).encode())
    return h.hexdigest()


class EpisodeJournal(InferenceEngine):
    """``engine`` for one episode, recording every call; ``saved``: the calls a checkpoint saved
    of this episode (``snapshot``'s records), answered first."""

    def __init__(self, engine: InferenceEngine, saved: list[dict[str, Any]] | None = None) -> None:
        self.engine = engine
        self.calls: list[dict[str, Any]] = []
        self._replay: dict[str, collections.deque[dict[str, Any]]] = collections.defaultdict(collections.deque)
        for rec in saved or ():
            self._replay[rec["key"]].append(rec)
        self.replayed_tokens = 0
        """Tokens answered from the saved log (generated before the checkpoint, not again)."""
        self.continued_calls = 0
        """Saved partial calls continued after their tokens."""
        self.diverged = False
        """A call the saved log did not have while saved calls were left (they are dropped)."""

    @property
    def unused_tokens(self) -> int:
        """Saved tokens no call asked for (a diverged replay): generated, never trained."""
        return sum(len(r["ids"]) for q in self._replay.values() for r in q)

    async def agenerate(self, req: GenerationRequest) -> GenerationResult:
        key = call_key(req.input_ids, req.sampling.max_new_tokens)
        queue = self._replay.get(key)
        saved = queue.popleft() if queue else None
        if saved is None and any(self._replay.values()):
            self.diverged = True
        rec: dict[str, Any] = {"key": key, "rid": None, "ids": [], "lps": [], "vers": [], "finish": None}
        self.calls.append(rec)
        if saved is not None and saved["finish"] is not None:  # answered from the log
            rec.update(saved)
            self.replayed_tokens += len(saved["ids"])
            return GenerationResult(list(req.input_ids), list(saved["ids"]), list(saved["lps"]), list(saved["vers"]),
                                    saved["finish"], rid=saved["rid"] or "")
        if saved is not None and saved["ids"]:  # continue after the saved tokens
            self.replayed_tokens += len(saved["ids"])
            self.continued_calls += 1
            req = dataclasses.replace(req, rid=saved["rid"], prefix=GenerationResult(
                list(req.input_ids), list(saved["ids"]), list(saved["lps"]), list(saved["vers"]), "abort"))
        if req.rid is None:
            req = dataclasses.replace(req, rid=uuid.uuid4().hex)
        rec["rid"] = req.rid
        rec["prefix"] = req.prefix
        res = await self.engine.agenerate(req)
        rec.update(ids=list(res.output_ids), lps=list(res.output_logprobs), vers=list(res.output_versions),
                   finish=res.finish_reason)
        rec.pop("prefix", None)
        return res

    def snapshot(self) -> list[dict[str, Any]]:
        """The calls so far as JSON-able records; a call in flight holds the tokens the engine
        has for it (``partial``; an engine without it: the saved prefix, or none)."""
        out = []
        partial = getattr(self.engine, "partial", None)
        for rec in self.calls:
            if rec["finish"] is None:
                got = partial(rec["rid"]) if partial is not None and rec["rid"] else None
                if got is None and rec.get("prefix") is not None:
                    p = rec["prefix"]
                    got = (p.output_ids, p.output_logprobs, p.output_versions)
                ids, lps, vers = got if got is not None else ([], [], [])
                out.append({"key": rec["key"], "rid": rec["rid"], "ids": list(ids), "lps": list(lps),
                            "vers": list(vers), "finish": None})
            else:
                out.append({k: rec[k] for k in ("key", "rid", "ids", "lps", "vers", "finish")})
        return out

    # -- the rest of the engine is the wrapped one's --------------------------------------------
    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def get_version(self) -> int:
        return self.engine.get_version()

    def set_version(self, version: int) -> None:
        self.engine.set_version(version)

    def __getattr__(self, name: str) -> Any:  # capabilities, capture_routes, ... of the pool
        return getattr(self.engine, name)
