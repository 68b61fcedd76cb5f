"""Reward worker process: ``python -m areal_mega.reward.worker --preload math_verify``.

Protocol (one JSON object per line): the parent writes ``{"fn": "module:function", "args":
[...]}`` to stdin; the worker answers ``{"ok": true, "value": <float, or the JSON value the
function returned when it is not a number>}`` or ``{"ok": false,
"error": "..."}`` on its original stdout. It prints ``{"ready": true}`` once the preloaded
modules are imported, so import time never counts against a call's timeout. EOF on stdin (the
parent went away) ends the worker. The function runs in this process's main thread, which is
what libraries using ``signal.alarm`` (math-verify) need.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Callable

from areal_mega.kinds import resolve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preload", action="append", default=[])
    args = ap.parse_args()
    # Answers go to the original stdout only; anything the reward code prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    for mod in args.preload:
        importlib.import_module(mod)
    out.write(json.dumps({"ready": True}) + "\n")
    cache: dict[str, Callable[..., Any]] = {}
    for line in sys.stdin:
        try:
            req = json.loads(line)
            fn = cache.get(req["fn"]) or cache.setdefault(req["fn"], resolve("reward", req["fn"]))
            value = fn(*req.get("args", []))
            reply = {"ok": True, "value": value if isinstance(value, (dict, list)) else float(value)}
        except Exception as e:  # reported to the parent, which scores 0
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
