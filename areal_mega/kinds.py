"""The one loader of every open kind: a built-in name or ``package.module:Name``.

    cls = resolve("reward", "math")                          # a built-in: a short name for its import path
    cls = resolve("reward", "my_pkg.rewards:KeywordReward")  # user code, loaded the same way

A kind may declare typed options as a nested dataclass ``Options``; the YAML section's ``options``
is built into it with the checks every built-in section gets (``config.py``: ``OPEN_KINDS``).
What each family's objects must provide is in ``areal_mega/api/`` (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

__all__ = ["BUILTINS", "OPTIONS_OF", "KindError", "describe", "fill_default_options", "options_type", "resolve"]

BUILTINS: dict[str, dict[str, str]] = {
    "workflow": {
        "single_turn": "areal_mega.workflows.single_turn:SingleTurnWorkflow",
        "multi_turn": "areal_mega.workflows.multi_turn:MultiTurnWorkflow",
        "tool": "areal_mega.workflows.tool:ToolWorkflow",
        "agent": "areal_mega.workflows.agent:AgentWorkflow",
    },
    "reward": {
        "math": "areal_mega.reward.builtins:math",
        "code": "areal_mega.reward.builtins:code",
        "function": "areal_mega.reward.builtins:function",
        "format": "areal_mega.reward.builtins:format_",
        "overlong": "areal_mega.reward.builtins:overlong",
        "composite": "areal_mega.reward.builtins:composite",
        "judge": "areal_mega.reward.builtins:judge",
        "multi_judge": "areal_mega.reward.builtins:multi_judge",
        "reward_model": "areal_mega.reward.builtins:reward_model",
        "consistency": "areal_mega.reward.builtins:consistency",
    },
    "advantage": {
        "grpo": "areal_mega.algo.advantages:GRPO",
        "dr_grpo": "areal_mega.algo.advantages:DrGRPO",
        "rloo": "areal_mega.algo.advantages:RLOO",
        "reinforce_pp": "areal_mega.algo.advantages:ReinforcePP",
        "gae": "areal_mega.algo.advantages:GAE",
    },
    "policy_loss": {
        "ppo": "areal_mega.algo.losses:PPOActorLoss",
        "gspo": "areal_mega.algo.losses:GSPOLoss",
        "cispo": "areal_mega.algo.losses:CISPOLoss",
    },
    "prompt_source": {
        "jsonl": "areal_mega.data.dataset:listed_source",
        "parquet": "areal_mega.data.dataset:listed_source",
        "reasoning_gym": "areal_mega.data.dataset:listed_source",
    },
    "agent": {},
    "model": {},  # by default the family registered for the HF model_type (areal_mega/models/registry.py)
    "tool": {
        "calculator": "areal_mega.agent_tools:builtin_calculator",
        "python": "areal_mega.agent_tools:builtin_python",
        "function": "areal_mega.agent_tools:builtin_function",
    },
    "judge_aggregation": {
        "mean": "areal_mega.reward.multi_judge:mean",
        "median": "areal_mega.reward.multi_judge:median",
        "majority": "areal_mega.reward.multi_judge:majority",
        "min": "areal_mega.reward.multi_judge:minimum",
    },
}
"""Each family's built-in names and the import path each stands for. Adding one is optional:
any ``package.module:Name`` works without an entry here."""


OPTIONS_OF: dict[str, str] = {"kind": "options", "adv_estimator": "adv_options", "policy_loss": "loss_options"}
"""The options key of each kind key of a section's ``OPEN_KINDS`` (``{kind key: family}``); a YAML
layer or an override that changes a kind drops the options the lower layer gave the old one."""


class KindError(ValueError):
    """A kind that names no built-in and does not import; the message is one line."""


def describe(family: str) -> str:
    names = sorted(BUILTINS.get(family, {}))
    return f"built-ins: {', '.join(names)}; or 'package.module:Name'" if names else "'package.module:Name'"


def resolve(family: str, kind: str) -> Any:
    """The object ``kind`` names in ``family`` (a class or a function); KindError naming the module
    and the error when it cannot be loaded."""
    if family not in BUILTINS:
        raise KindError(f"unknown component family {family!r} (known: {', '.join(sorted(BUILTINS))})")
    path = BUILTINS[family].get(kind, kind)
    if not isinstance(kind, str) or ":" not in path:
        raise KindError(f"{kind!r} is not one of the {family} kinds ({describe(family)})")
    module, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise KindError(f"{family} {kind!r}: cannot import {module}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- a user module may fail in any way; one line names it
        raise KindError(f"{family} {kind!r}: importing {module} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise KindError(f"{family} {kind!r}: {module} has no callable {attr!r}")
    return obj


def options_type(obj: Any) -> type | None:
    """The typed options a kind declares (its ``Options`` dataclass), None if it takes none."""
    opts = getattr(obj, "Options", None)
    if opts is not None and not (isinstance(opts, type) and dataclasses.is_dataclass(opts)):
        raise KindError(f"{getattr(obj, '__qualname__', obj)}.Options must be a dataclass")
    return opts


def fill_default_options(section: Any) -> None:
    """A config section built in Python without options gets its kinds' defaults (the YAML path
    builds them in config.py): called from ``__post_init__`` of every section with ``OPEN_KINDS``."""
    for kind_key, family in type(section).OPEN_KINDS.items():
        if getattr(section, OPTIONS_OF[kind_key]) is None:
            opts = options_type(resolve(family, getattr(section, kind_key)))
            if opts is not None:
                setattr(section, OPTIONS_OF[kind_key], opts())
