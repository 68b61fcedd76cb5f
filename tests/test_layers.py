"""The package's layers, read from its source: which room may import which (issue 20).

Every ``import`` in ``areal_mega/`` is parsed (module level and inside functions alike, since a
function-level import is still a dependency); imports under ``if TYPE_CHECKING:`` count for the
rules but not for cycles (they never run). Each rule has a negative control: the same checker
run on a made-up module that breaks it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "areal_mega"

# (room, what it must never import, why)
RULES = [
    ("areal_mega.rollout", "areal_mega.megatron", "the generation side never imports the learner's room"),
    ("areal_mega.simulator", "areal_mega.launcher", "the launcher uses the simulator, not the other way round"),
    ("areal_mega.trainer", "areal_mega.launcher", "the trainer runs with or without the launcher"),
    ("areal_mega.batching", "areal_mega.megatron", "pure batch code sits below both rollout and learner"),
    ("areal_mega.batching", "areal_mega.rollout", "pure batch code sits below both rollout and learner"),
]
# (room, the only part of the package it may import, why)
ONLY = [
    ("areal_mega.api", "areal_mega.api", "the contracts sit below every implementation"),
]
# Known cycles (each a set of modules), left for their owners; a new one fails the test.
KNOWN_CYCLES = [
    # the package re-exports client and server, and server imports a sibling through the package
    {"areal_mega.inference", "areal_mega.inference.client", "areal_mega.inference.server"},
    # the HTTP endpoint wraps the agent client; the agent starts that endpoint (a function-level import)
    {"areal_mega.workflows.agent", "areal_mega.workflows.agent_http"},
]


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module or module.name, under TYPE_CHECKING?) for every import in ``source``."""
    tree = ast.parse(source)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in typing_only) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out += [(f"{name}.{a.name}", id(node) in typing_only) for a in node.names]
    return out


def _graph(files: dict[str, tuple[str, bool]]) -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported areal_mega module, typing only?)] (``from m import f`` -> m)."""
    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None
    graph = {}
    for mod, (src, is_pkg) in files.items():
        deps = []
        for name, typing_only in _imports(src, mod, is_pkg):
            if name.startswith("areal_mega"):
                target = resolve(name)
                if target and target != mod:
                    deps.append((target, typing_only))
        graph[mod] = deps
    return graph


def _package_files(root: Path = PKG) -> dict[str, tuple[str, bool]]:
    return {_module_name(p, root): (p.read_text(), p.name == "__init__.py") for p in sorted(root.rglob("*.py"))}


def _violations(graph) -> list[str]:
    out = []
    for mod, deps in graph.items():
        for room, banned, why in RULES:
            if mod == room or mod.startswith(room + "."):
                out += [f"{mod} imports {d} ({why})" for d, _ in deps if d == banned or d.startswith(banned + ".")]
        for room, allowed, why in ONLY:
            if mod == room or mod.startswith(room + "."):
                out += [f"{mod} imports {d} ({why})" for d, _ in deps
                        if d.startswith("areal_mega.") and not (d == allowed or d.startswith(allowed + "."))]
    return out


def _cycles(graph) -> list[set[str]]:
    """Strongly connected components of more than one module (runtime imports only)."""
    edges = {m: {d for d, typing_only in deps if not typing_only} for m, deps in graph.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return out


@functools.cache
def _package_graph():
    return _graph(_package_files())


def test_rooms_import_only_what_they_may():
    graph = _package_graph()
    assert "areal_mega.rollout.batch" in graph and "areal_mega.simulator.planner" in graph  # the parse saw them
    assert _violations(graph) == []


def test_no_new_import_cycle():
    cycles = _cycles(_package_graph())
    assert [c for c in cycles if c not in KNOWN_CYCLES] == []


def test_the_checks_catch_what_they_forbid(tmp_path):
    """Negative controls: made-up modules that break each rule, and a two-module cycle through a
    function-level import."""
    pkg = tmp_path / "areal_mega"
    for d in ("rollout", "simulator", "trainer", "launcher", "megatron", "batching", "api"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "rollout" / "batch.py").write_text("def f():\n    from areal_mega.megatron.packing import x\n")
    (pkg / "megatron" / "packing.py").write_text("x = 1\n")
    (pkg / "simulator" / "planner.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                  "    from areal_mega.launcher import cli\n")
    (pkg / "launcher" / "cli.py").write_text("from ..simulator import planner\n")
    (pkg / "trainer" / "config.py").write_text("import areal_mega.launcher.cli\n")
    (pkg / "batching" / "packing.py").write_text("from areal_mega.rollout import batch\n")
    (pkg / "launcher" / "plan.py").write_text("def g():\n    from areal_mega.trainer import loop\n")
    (pkg / "trainer" / "loop.py").write_text("from areal_mega.launcher.plan import g\n")
    (pkg / "api" / "generation.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from areal_mega.rollout.batch import f\n")
    graph = _graph(_package_files(pkg))
    bad = _violations(graph)
    assert any(v.startswith("areal_mega.api.generation imports areal_mega.rollout.batch") for v in bad)
    assert any(v.startswith("areal_mega.rollout.batch imports areal_mega.megatron.packing") for v in bad)
    assert any(v.startswith("areal_mega.simulator.planner imports areal_mega.launcher.cli") for v in bad)
    assert any(v.startswith("areal_mega.trainer.config imports areal_mega.launcher.cli") for v in bad)
    assert any(v.startswith("areal_mega.batching.packing imports areal_mega.rollout.batch") for v in bad)
    # the relative import resolves; TYPE_CHECKING-only edges make no cycle, a runtime one does
    assert ("areal_mega.simulator.planner", False) in graph["areal_mega.launcher.cli"]
    assert _cycles(graph) == [{"areal_mega.launcher.plan", "areal_mega.trainer.loop"}]


def test_public_surfaces_name_what_exists():
    """Every ``__all__`` entry is defined or imported by its module (a stale name breaks
    ``from m import *`` and misleads readers)."""
    missing = []
    for mod, (src, _) in _package_files().items():
        tree = ast.parse(src)
        names = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names}
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    names |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}  # a, b = ... too
        for n in tree.body:
            if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets):
                missing += [f"{mod}.{e.value}" for e in n.value.elts if e.value not in names]
    assert missing == []
