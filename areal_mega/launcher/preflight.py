"""Checks before anything starts: every setting a run needs that can be wrong, in seconds.

A wrong path, interpreter or function name fails in the launcher's first seconds with one line
naming the key, not minutes later as a server's traceback. :func:`preflight` returns one line per
check for the dry run and raises :class:`PreflightError` (a ValueError: the launcher prints it as
one line and exits 2) at the first failure. What is checked: docs/launch.md ("Before anything starts").
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LEARNER_MODULES = ("torch", "megatron.core", "transformers")
ENGINE_MODULES = ("sglang",)
_FIND = ("import importlib.util as u, sys\n"
         "missing = [m for m in sys.argv[1:] if u.find_spec(m) is None]\n"
         "print(' '.join(missing)); sys.exit(3 if missing else 0)")


class PreflightError(ValueError):
    """A setting that cannot work; the message is one line and starts with the key."""


def _model_dir(key: str, path: str, here: bool) -> str:
    if not here:
        return f"{key}: {path} (not checked here: planning away from the cluster)"
    p = Path(path)
    if not p.is_dir():
        raise PreflightError(f"{key}: {path} is not a directory (expected an HF model directory with config.json)")
    try:
        cfg = json.loads((p / "config.json").read_text())
    except OSError:
        raise PreflightError(f"{key}: {path} has no config.json (expected an HF model directory)") from None
    except json.JSONDecodeError as e:
        raise PreflightError(f"{key}: {path}/config.json is not valid JSON: {e}") from None
    n = cfg.get("max_position_embeddings")
    return f"{key}: {path} ({cfg.get('model_type', '?')}, max_position_embeddings {n})"


def has_chat_template(model_dir: str) -> bool:
    """Whether the tokenizer files of ``model_dir`` carry a chat template (tokenizer_config.json's
    ``chat_template``, or the chat_template.jinja / .json files transformers also reads)."""
    p = Path(model_dir)
    if (p / "chat_template.jinja").exists() or (p / "chat_template.json").exists():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def _interpreter(key: str, python: str, modules: tuple[str, ...]) -> str:
    exe = python if os.sep in python else (_which(python) or python)
    if not os.path.isfile(exe):
        raise PreflightError(f"{key}: interpreter {python} does not exist")
    if not os.access(exe, os.X_OK):
        raise PreflightError(f"{key}: interpreter {python} is not executable")
    try:
        r = subprocess.run([exe, "-c", _FIND, *modules], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"{key}: interpreter {python} does not run: {e}") from None
    if r.returncode == 3:
        raise PreflightError(f"{key}: interpreter {python} cannot import {', '.join(r.stdout.split())}")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise PreflightError(f"{key}: interpreter {python} does not run (exit {r.returncode}: {last})")
    return f"{key}: {python} (finds {', '.join(modules)})"


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def _learner_interpreter() -> str:
    missing = [m for m in LEARNER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise PreflightError(f"learner interpreter {sys.executable} (the launcher's own) cannot import "
                             f"{', '.join(missing)}: run the launcher with the learner virtualenv's python")
    return f"learner interpreter: {sys.executable} (finds {', '.join(LEARNER_MODULES)})"


def _data(key: str, cfg: Any, here: bool) -> str | None:
    if cfg is None or cfg.kind not in ("jsonl", "parquet"):
        return None
    if not here:
        return f"{key}: {cfg.path} (not checked here: planning away from the cluster)"
    if not Path(cfg.path).is_file():
        raise PreflightError(f"{key}: {cfg.path} does not exist")
    return f"{key}: {cfg.path}"


def _callable(key: str, family: str, path: str, *, coroutine: bool = False) -> str:
    from areal_mega.kinds import KindError, resolve

    try:
        fn = resolve(family, path)
    except KindError as e:
        raise PreflightError(f"{key}: {' '.join(str(e).split())}") from None
    if coroutine and not inspect.iscoroutinefunction(fn):
        raise PreflightError(f"{key}: {path!r} must be an async function (client, sample)")
    return f"{key}: {path} (imports)"


def _rewards(key: str, cfg: Any) -> list[str]:
    out = []
    if cfg.kind == "function":
        out.append(_callable(f"{key}.options.function", "reward", cfg.options.function))
    for i, c in enumerate(getattr(cfg.options, "components", ())):
        out += _rewards(f"{key}.options.components[{i}]", c)
    return out


def preflight(exp: Any, *, engine_python: str | None = None, starts_sglang: bool = True,
              here: bool = True) -> list[str]:
    """Check ``exp`` (an ``ExperimentConfig``) before anything starts: one line per check passed;
    raises :class:`PreflightError` at the first that fails. ``starts_sglang``: the launch starts
    SGLang servers (with ``engine_python``, default ``inference.server.python``); ``here``: this
    machine sees the run's files (False when planning a Slurm job off its cluster)."""
    lines = []
    if exp.model_path:
        lines.append(_model_dir("model_path", exp.model_path, here))
    srv = exp.inference.server
    if starts_sglang and srv.model_path and srv.model_path != exp.model_path:
        lines.append(_model_dir("inference.server.model_path", srv.model_path, here))
    needs_chat = [k for k, on in (("workflow.kind: agent", exp.workflow.kind == "agent"),
                                  ("data.template: chat", exp.data.template == "chat")) if on]
    if needs_chat and exp.model_path:
        if not here:
            lines.append(f"chat template ({needs_chat[0]}): not checked here: planning away from the cluster")
        elif not has_chat_template(exp.model_path):
            raise PreflightError(f"{needs_chat[0].split(':')[0]}: {needs_chat[0].split(': ')[1]!r} needs a tokenizer "
                                 f"with a chat template; {exp.model_path} has none (no chat_template in "
                                 "tokenizer_config.json, no chat_template.jinja)")
        else:
            lines.append(f"chat template ({needs_chat[0]}): found in {exp.model_path}")
    if starts_sglang:
        key = "--engine-python" if engine_python else "inference.server.python"
        python = engine_python or srv.python
        lines.append(_interpreter(key, python, ENGINE_MODULES) if here
                     else f"{key}: {python} (not checked here: planning away from the cluster)")
    lines.append(_learner_interpreter())
    for key, cfg in (("data.path", exp.data), ("eval_data.path", exp.eval_data)):
        line = _data(key, cfg, here)
        if line:
            lines.append(line)
    lines += _rewards("reward", exp.reward)
    opts = exp.workflow.options
    if exp.workflow.kind == "agent":
        lines.append(_callable("workflow.options.function", "agent", opts.function, coroutine=True))
    for i, t in enumerate(getattr(opts, "tools", None) or []):
        if t.kind == "function":
            lines.append(_callable(f"workflow.options.tools[{i}].function", "tool", t.function))
    return lines
