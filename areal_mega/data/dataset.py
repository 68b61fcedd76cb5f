"""Dataset loading, prompt templates and the deterministic train / held-out split."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal

from areal_mega.kinds import fill_default_options, resolve

__all__ = ["DatasetConfig", "DatasetSplit", "build_prompt_source", "listed_source", "PromptDataset", "PromptStream", "format_prompt", "load_dataset"]


@dataclass
class DatasetConfig:
    kind: str = "reasoning_gym"
    """Source: a .jsonl file (one JSON object per line), a .parquet file, reasoning-gym tasks
    generated offline, or "package.module:Name", a prompt source called as ``Name(cfg, tokenizer)``
    (the contract: ``api/data.py``; its own settings in ``options``)."""
    options: Any = None
    """The typed options of a user prompt source (its ``Options`` dataclass), None for built-ins."""
    path: str = ""
    """File for kind jsonl / parquet."""
    prompt_field: str = "question"
    """Field holding the question (dots reach into nested objects: "meta.q")."""
    answer_field: str = "answer"
    """Field holding the reference answer."""
    extra_fields: list[str] = field(default_factory=list)
    """More fields copied into each sample (e.g. "tests" for the code reward)."""
    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic"])
    """reasoning-gym dataset names (e.g. basic_arithmetic, gsm_symbolic, chain_sum)."""
    task_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-task generator settings, e.g. {basic_arithmetic: {max_terms: 3, max_digits: 2}}."""
    size: int = 1000
    """reasoning-gym: samples generated per task."""
    max_samples: int = 0
    """Keep at most this many samples after loading (0 = all)."""
    num_eval: int = 0
    """Held-out samples (taken from a seeded permutation; never trained on)."""
    eval_fraction: float = 0.0
    """Alternative to num_eval: this fraction of the samples is held out (rounded up)."""
    seed: int = 0
    """Seed of generation, of the split and of the per-epoch shuffle."""
    shuffle: bool = True
    """Shuffle the training samples every epoch (seed + epoch)."""
    template: Literal["plain", "chat", "raw"] = "plain"
    """Prompt format: "plain" = "Question: {q}\\nAnswer:"; "chat" = the tokenizer's chat template
    with one user turn; "raw" = the question unchanged."""
    instruction: str = ""
    """Appended to the question before templating (e.g. "Put the final answer in \\\\boxed{}.")."""
    system_prompt: str = ""
    """System message for template "chat" (empty = none)."""
    allow_empty_test_output: bool = False
    """For a code reward: accept tests whose expected output is empty. By default the trainer
    refuses them when it loads the samples (one line naming the sample): an empty program would
    pass them. Tests without an output, or with a null one, are refused either way."""
    dedupe_heldout: bool = True
    """Drop from the training split every sample whose question equals a held-out one, so the
    held-out items are never trained on even when the source repeats questions (generated tasks
    over a small space do: two-term two-digit sums repeat within a few thousand samples)."""

    OPEN_KINDS: ClassVar[dict[str, str]] = {"kind": "prompt_source"}

    def __post_init__(self) -> None:
        fill_default_options(self)

    def validate(self) -> None:
        if self.kind in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"path: kind {self.kind} needs a file path")
        if self.kind == "reasoning_gym" and not self.tasks:
            raise ValueError("tasks: kind reasoning_gym needs at least one task name")
        if self.size < 1:
            raise ValueError(f"size: must be >= 1, got {self.size}")
        if self.num_eval < 0 or self.max_samples < 0:
            raise ValueError("num_eval/max_samples: must be >= 0")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction: must be in [0, 1), got {self.eval_fraction}")
        if self.num_eval and self.eval_fraction:
            raise ValueError("num_eval/eval_fraction: set one, not both")


def _get(obj: dict[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def _sample(row: dict[str, Any], cfg: DatasetConfig, where: str, default_id: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in [("question", cfg.prompt_field), ("answer", cfg.answer_field)] + [(f, f) for f in cfg.extra_fields]:
        try:
            value = _get(row, name)
        except KeyError:
            raise ValueError(f"{where}: no field '{name}' (fields: {sorted(row)})") from None
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise ValueError(f"{where}: field '{name}' is empty")
        out[key] = value
    out["question"] = str(out["question"])
    out["answer"] = str(out["answer"])
    out["id"] = str(row.get("id", default_id))
    return out


def _read_jsonl(cfg: DatasetConfig) -> list[dict[str, Any]]:
    path = Path(cfg.path)
    if not path.exists():
        raise ValueError(f"path: {path} does not exist")
    samples = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            samples.append(_sample(row, cfg, f"{path}:{lineno}", f"{path.stem}/{lineno}"))
    return samples


def _read_parquet(cfg: DatasetConfig) -> list[dict[str, Any]]:
    import pandas as pd

    path = Path(cfg.path)
    if not path.exists():
        raise ValueError(f"path: {path} does not exist")
    frame = pd.read_parquet(path)
    top = [f.split(".")[0] for f in [cfg.prompt_field, cfg.answer_field, *cfg.extra_fields]]
    for col in top:
        if col not in frame.columns:
            raise ValueError(f"{path}: no column '{col}' (columns: {sorted(frame.columns)})")
    return [_sample(row, cfg, f"{path} row {i}", f"{path.stem}/{i}") for i, row in enumerate(frame.to_dict("records"))]


def _generate_reasoning_gym(cfg: DatasetConfig) -> list[dict[str, Any]]:
    import reasoning_gym

    samples = []
    for t, task in enumerate(cfg.tasks):
        try:
            ds = reasoning_gym.create_dataset(task, seed=cfg.seed + 1000 * t, size=cfg.size, **cfg.task_kwargs.get(task, {}))
        except Exception as e:  # unknown name or bad kwargs, reported with the key
            raise ValueError(f"tasks: reasoning-gym cannot build {task!r}: {e}") from None
        for i, entry in enumerate(ds):
            samples.append({"id": f"{task}/{i}", "question": entry["question"], "answer": str(entry["answer"]), "task": task})
    return samples


def format_prompt(question: str, cfg: DatasetConfig, tokenizer: Any = None) -> str:
    text = f"{question} {cfg.instruction}".strip() if cfg.instruction else question
    if cfg.template == "raw":
        return text
    if cfg.template == "plain":
        return f"Question: {text}\nAnswer:"
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("template: 'chat' needs a tokenizer with a chat template (use 'plain' otherwise)")
    messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset:
    """A list of samples; each ``iter()`` is one epoch, reshuffled with seed + epoch."""

    def __init__(self, samples: list[dict[str, Any]], *, seed: int = 0, shuffle: bool = True) -> None:
        self.samples = samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        self.epoch += 1
        return (self.samples[i] for i in order)


class PromptStream:
    """The training prompts as the rollout consumes them: epoch after epoch (each reshuffled with
    seed + epoch, as :class:`PromptDataset`), with a position that a checkpoint can hold.

    A prompt's position is ``(epoch, index)``: the ``index``-th sample of that epoch's order.
    ``state_dict(in_flight)`` records where the stream stands and which positions were drawn but
    not trained (episodes running or finished but not yet in a batch); after
    ``load_state_dict`` those come first, in the order given, then the stream continues where it
    stood. So a run resumed from a checkpoint trains every prompt of an epoch exactly once
    (prompts rejected by the controller's filter count as used, as they do without a restart).
    """

    def __init__(self, dataset: PromptDataset, heldout: list[dict[str, Any]] | None = None) -> None:
        if len(dataset) == 0:
            raise ValueError("rollout dataset is empty")
        self.dataset = dataset
        self._heldout = list(heldout or [])
        self.epoch = 0
        self.cursor = 0
        self._requeued: list[tuple[int, int]] = []
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.dataset)))
            if self.dataset.shuffle:
                random.Random(self.dataset.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep it small
            self._orders[epoch] = order
        return self._orders[epoch]

    def next(self) -> tuple[tuple[int, int], dict[str, Any]]:
        """The next ``(position, sample)``."""
        if self._requeued:
            pos = self._requeued.pop(0)
        else:
            if self.cursor == len(self.dataset):
                self.epoch, self.cursor = self.epoch + 1, 0
            pos = (self.epoch, self.cursor)
            self.cursor += 1
        return pos, self.dataset[self._order(pos[0])[pos[1]]]

    def heldout(self) -> list[dict[str, Any]]:
        return list(self._heldout)

    def state_dict(self, in_flight: list[tuple[int, int]]) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "size": len(self.dataset),
                "seed": self.dataset.seed, "shuffle": self.dataset.shuffle,
                "requeue": [list(p) for p in [*in_flight, *self._requeued]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same = (state["size"], state["seed"], state["shuffle"]) == (len(self.dataset), self.dataset.seed,
                                                                    self.dataset.shuffle)
        if not same:
            raise ValueError(
                f"data: the checkpoint's prompt stream was over {state['size']} samples (seed {state['seed']}, "
                f"shuffle {state['shuffle']}), this run's is over {len(self.dataset)} (seed {self.dataset.seed}, "
                f"shuffle {self.dataset.shuffle}): resume with the same data settings")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._requeued = [tuple(p) for p in state["requeue"]]


@dataclass
class DatasetSplit:
    train: PromptDataset
    eval: list[dict[str, Any]]


def listed_source(cfg: DatasetConfig, tokenizer: Any = None) -> PromptStream:
    """The built-in prompt sources (jsonl, parquet, reasoning_gym): the loaded samples' training
    split as a resumable stream, the held-out split as its ``heldout()``."""
    split = load_dataset(cfg, tokenizer)
    return PromptStream(split.train, split.eval)


def build_prompt_source(cfg: DatasetConfig, tokenizer: Any = None) -> Any:
    """The prompt source ``cfg.kind`` names (``areal_mega.kinds``): ``Kind(cfg, tokenizer)``."""
    return resolve("prompt_source", cfg.kind)(cfg, tokenizer)


def load_dataset(cfg: DatasetConfig, tokenizer: Any = None) -> DatasetSplit:
    """Load, format prompts, split off the held-out samples (seeded), wrap the rest."""
    cfg.validate()
    readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "reasoning_gym": _generate_reasoning_gym}
    if cfg.kind not in readers:
        raise ValueError(f"kind: {cfg.kind!r} is a prompt source, not a list of samples to load (an evaluation "
                         f"set must be jsonl, parquet or reasoning_gym)")
    samples = readers[cfg.kind](cfg)
    if not samples:
        raise ValueError(f"path: dataset {cfg.path or cfg.tasks} has no samples")
    if cfg.max_samples:
        samples = samples[: cfg.max_samples]
    for s in samples:
        s["prompt"] = format_prompt(s["question"], cfg, tokenizer)
    num_eval = cfg.num_eval or math.ceil(cfg.eval_fraction * len(samples))
    if num_eval >= len(samples):
        raise ValueError(f"num_eval: {num_eval} held-out samples leave none of {len(samples)} for training")
    order = list(range(len(samples)))
    random.Random(cfg.seed).shuffle(order)
    held = sorted(order[:num_eval])
    keep = sorted(order[num_eval:])
    if cfg.dedupe_heldout and held:
        seen = {samples[i]["question"] for i in held}
        keep = [i for i in keep if samples[i]["question"] not in seen]
        if not keep:
            raise ValueError(f"num_eval: every training sample repeats a held-out question ({len(held)} held out)")
    return DatasetSplit(
        PromptDataset([samples[i] for i in keep], seed=cfg.seed, shuffle=cfg.shuffle), [samples[i] for i in held]
    )
