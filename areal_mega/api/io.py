"""Data that crosses the inference boundary: requests, results, sampling settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

__all__ = ["GenerationRequest", "GenerationResult", "SamplingParams"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    """Upper bound on generated tokens for one request."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k cutoff; -1 disables it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (the tokenizer's EOS is added by the caller)."""

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")

    def with_stop_token(self, token_id: int | None) -> "SamplingParams":
        """A copy whose stop ids include ``token_id`` (a tokenizer's EOS; None: unchanged)."""
        stops = list(self.stop_token_ids)
        if token_id is not None and token_id not in stops:
            stops.append(token_id)
        return dataclasses.replace(self, stop_token_ids=stops)


@dataclass
class GenerationRequest:
    input_ids: list[int]
    sampling: SamplingParams
    rid: str | None = None
    """Request id; the client fills a unique one when None."""
    prefix: "GenerationResult | None" = None
    """Tokens already generated for this request (a resumed episode's saved partial answer):
    generation continues after them and the result starts with them, their log-probs and
    versions kept (``max_new_tokens`` counts them)."""


@dataclass
class GenerationResult:
    """One finished generation. ``output_versions[i]`` is the policy version that sampled
    ``output_ids[i]``: an interrupted request resumed after a weight update has mixed versions."""

    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    """"stop" or "length" (aborts are resumed by the client, never returned)."""
    rid: str = ""
    num_interruptions: int = 0
    latency_s: float = 0.0
    routes: "np.ndarray | None" = None
    """MoE routing replay (a pool launched with ``capture_routes``): expert ids [len(input_ids) + len(output_ids) - 1, layers * top_k]
    (int16), row p = the experts every layer routed token p to when it was first fed to the
    model (the last sampled token is never fed). A request resumed after an interruption keeps
    the rows of its first call and takes only the new rows from the resumed one."""
