"""How many YAML keys a user meets: every key reachable from ExperimentConfig's types (a kind's
``options`` counts as one key), and each built-in kind's own option keys apart.

    python tools/count_config_keys.py        # prints JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_mega import kinds  # noqa: E402
from areal_mega.experiment import ExperimentConfig  # noqa: E402


def count(cls: type, seen: tuple = ()) -> int:
    """Keys under ``cls``: each field, plus the keys of a dataclass it holds (a list of the same
    dataclass, e.g. a composite's components, is not walked again)."""
    n, hints = 0, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        n += 1
        sub = [a for a in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(a)]
        for a in sub[:1]:
            if a not in seen:
                n += count(a, (*seen, cls))
    return n


def main() -> None:
    hints = typing.get_type_hints(ExperimentConfig)
    sections = {}
    for f in dataclasses.fields(ExperimentConfig):
        sub = [a for a in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(a)]
        sections[f.name] = count(sub[0]) if sub else 0
    per_kind = {}
    for family, names in kinds.BUILTINS.items():
        for name in names:
            opts = kinds.options_type(kinds.resolve(family, name))
            if opts is not None:
                per_kind[f"{family}:{name}"] = count(opts)
    print(json.dumps({"total": count(ExperimentConfig), "sections": sections, "options_per_kind": per_kind}, indent=1))


if __name__ == "__main__":
    main()
