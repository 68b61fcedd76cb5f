"""The compat registry (areal_mega/megatron/compat.py, cpu_compat.py): every entry names its
symptom, a valid megatron-core version range and a test that exists; the registry's verified
versions are the two tiers' pins; ranges are checked, not assumed (entry 10 is fixed upstream in
0.17). Pure Python: no megatron import, no process."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from areal_mega.megatron import compat, cpu_compat
from areal_mega.megatron.compat import Entry

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = {f"compat {n}": e for n, e in compat.ENTRIES.items()} | {
    f"cpu_compat {n}": e for n, e in cpu_compat.ENTRIES.items()
}


def problems(entry: Entry) -> list[str]:
    """What is wrong with one registry entry (empty when it is complete)."""
    out = []
    if len(entry.symptom) < 40:
        out.append("symptom too short to say what breaks")
    try:
        SpecifierSet(entry.versions)
    except InvalidSpecifier:
        out.append(f"versions {entry.versions!r} is not a PEP 440 specifier")
    path, _, name = entry.test.partition("::")
    file = ROOT / path
    if not file.is_file():
        out.append(f"test file {path} does not exist")
    elif name not in {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}:
        out.append(f"test {name} is not defined in {path}")
    return out


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_entry_is_complete(key):
    assert problems(REGISTRY[key]) == []


def test_incomplete_entries_are_caught():
    # The checker above can fail: a bad range, a missing test, a missing file, a one-word symptom.
    assert len(problems(Entry("x", "0.16", "tests/test_compat.py::no_such_test"))) == 3
    assert problems(Entry("y" * 40, ">=0.16.1", "tests/nope.py::t")) == ["test file tests/nope.py does not exist"]


def pin(req: str) -> str:
    return re.search(r"^megatron-core==(\S+)$", (ROOT / "tools/env" / req).read_text(), re.M).group(1)


def test_verified_versions_are_the_two_tiers_pins():
    assert compat.VERIFIED_VERSIONS == (pin("learner.txt"), pin("learner-latest.txt"))


def test_ranges_are_checked_against_the_version():
    old, new = (Version(v) for v in compat.VERIFIED_VERSIONS)
    # Every workaround was needed on the default tier's pin (each one's test fails without it).
    assert [k for k, e in REGISTRY.items() if not e.applies(old)] == []
    # megatron-core 0.17 defines te_general_gemm = None without TE: entry 10 is not applied there.
    assert not compat.ENTRIES[10].applies(new) and compat.ENTRIES[10].applies(old)
    assert compat.ENTRIES[10].applies(Version("0.17.0rc1")) is False  # pre-releases count
