"""The pytest side of the test support layer (helpers: tests/support/).

Two tiers. ``make test`` runs everything. ``make test-fast`` runs ``-m "not slow"``: the
pure-Python and single-process tests (under 2 minutes). A test is ``slow`` exactly when it starts
processes -- torchrun ranks, SGLang or stand-in servers, reward workers, a Slurm cluster, any
subprocess -- itself or through a fixture it uses. Mark it in its module (``pytestmark``) or on
the test.

``--audit-processes`` (on in ``make test-fast``) checks the marks: it records every process a
test or one of its fixtures starts (subprocess.Popen, asyncio subprocesses, multiprocessing) and
fails the run when a test without the mark started one, or a marked test that ran started none.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import warnings
from pathlib import Path

import pytest

# Tests that start processes in files whose owners have not marked them yet: marked here.
SLOW_ELSEWHERE: dict[str, set[str] | None] = {}


def pytest_addoption(parser):
    parser.addoption("--audit-processes", action="store_true",
                     help="fail if a test not marked slow starts a process, or a slow test starts none")


def pytest_collection_modifyitems(config, items):
    seen: dict[str, set[str]] = {}
    for item in items:
        file, name = Path(str(item.fspath)).name, getattr(item, "originalname", item.name)
        names = SLOW_ELSEWHERE.get(file, ())
        if names is None or name in names:
            item.add_marker(pytest.mark.slow)
        seen.setdefault(file, set()).add(name)
    for file, names in SLOW_ELSEWHERE.items():
        missing = sorted((names or set()) - seen.get(file, set())) if file in seen else []
        if missing:
            warnings.warn(f"tests/conftest.py SLOW_ELSEWHERE: no test {missing} in {file}")


# ---------------------------------------------------------------- --audit-processes
class _Audit:
    def __init__(self):
        self.spawns: list[str] = []
        self.spawning_fixtures: set[int] = set()
        self.tests: dict[str, dict] = {}

    def install(self) -> None:
        popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
        spawns = self.spawns

        def init(popen, args, *a, **kw):
            spawns.append(args if isinstance(args, str) else " ".join(map(str, args)))
            return popen_init(popen, args, *a, **kw)

        def start(process):
            spawns.append(f"multiprocessing {process.name}")
            return process_start(process)

        subprocess.Popen.__init__ = init
        multiprocessing.process.BaseProcess.start = start

    def mismatches(self) -> list[str]:
        out = []
        for nodeid, t in self.tests.items():
            if t["spawned"] and not t["slow"]:
                out.append(f"{nodeid}: starts processes but is not marked slow ({t['first']})")
            elif t["slow"] and t["ran"] and not t["spawned"]:
                out.append(f"{nodeid}: marked slow but starts no process")
        return out


def pytest_configure(config):
    if config.getoption("--audit-processes"):
        audit = _Audit()
        audit.install()
        config._areal_audit = audit


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    audit = getattr(request.config, "_areal_audit", None)
    n = len(audit.spawns) if audit else 0
    yield
    if audit and len(audit.spawns) > n:
        audit.spawning_fixtures.add(id(fixturedef))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    audit = getattr(item.config, "_areal_audit", None)
    n = len(audit.spawns) if audit else 0
    yield
    if audit:
        own = audit.spawns[n:]
        defs = [d for ds in item._fixtureinfo.name2fixturedefs.values() for d in ds]
        via_fixture = [d.argname for d in defs if id(d) in audit.spawning_fixtures]
        t = audit.tests.setdefault(item.nodeid, {"ran": False})
        t.update(slow=item.get_closest_marker("slow") is not None, spawned=bool(own or via_fixture),
                 first=own[0][:120] if own else f"via fixture {via_fixture[0]}" if via_fixture else "")


_RAN: set[str] = set()  # tests whose call phase ran (not skipped in setup)


def pytest_runtest_logreport(report):
    if report.when == "call":
        _RAN.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    audit = getattr(session.config, "_areal_audit", None)
    if audit is None:
        return
    for nodeid, t in audit.tests.items():
        t["ran"] = nodeid in _RAN
    audit.found = audit.mismatches()
    if audit.found and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    audit = getattr(config, "_areal_audit", None)
    if audit is None:
        return
    found = getattr(audit, "found", [])
    terminalreporter.section("process audit (--audit-processes)")
    started = sum(t["spawned"] for t in audit.tests.values())
    terminalreporter.line(f"{len(audit.tests)} tests audited, {started} started processes")
    for line in found:
        terminalreporter.line(line, red=True)
