"""Reward functions by dotted path ("package.module:function"): exact lookup, no guessing."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def load_callable(path: str) -> Callable[..., Any]:
    """"package.module:function" -> the function (ValueError naming the path otherwise)."""
    if ":" not in path:
        raise ValueError(f"reward function {path!r}: expected 'module:function'")
    mod_name, fn_name = path.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward function {path!r}: cannot import {mod_name}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {mod_name} has no callable {fn_name!r}")
    return fn
