"""Shared fixtures. Tests never touch the user's ~/.kiln: every test gets its own KILN_HOME."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny-llama"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each of the suite's two xdist workers (pyproject.toml) gets one core: torch's intra-op threads (and every
    # kiln process a test starts, which inherits this) stay at one. Two concurrent builds of the shipped model
    # with torch's default of one thread per core took 94 s together, as long as running them one after the
    # other; with one thread each, 44 s — as long as one alone (docs/testing.md). Set before anything imports
    # torch, which reads it once.
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("kiln-home")
    monkeypatch.setenv("KILN_HOME", str(home))
    monkeypatch.setenv("KILN_CHECKPOINT_ROOTS", os.pathsep.join([str(REPO), str(home.parent)]))
    yield home


#: Modules whose tests are spread over the pytest-xdist workers one by one; tests of one class in them stay
#: together (they share its fixtures). Every other module runs on one worker, its module fixtures built once.
SPREAD = {"tests/integration/test_families.py", "tests/integration/test_cli_build.py"}
#: Seconds a module's tests took on two xdist workers (2026-12-02): the longest start first, so that no long
#: module is left to run alone at the end (only the order depends on these; a module not listed counts 0).
WEIGHTS = {"tests/integration/test_cli_build.py": 650, "tests/integration/test_families.py": 110,
           "tests/integration/test_service.py": 320, "tests/integration/test_report.py": 275,
           "tests/integration/test_faults.py": 270, "tests/integration/test_oci.py": 230,
           "tests/integration/test_cli_ci.py": 220, "tests/integration/test_dashboard.py": 170,
           "tests/integration/test_freshness.py": 130, "tests/integration/test_gc.py": 100,
           "tests/integration/test_serve.py": 100, "tests/integration/test_security.py": 100,
           "tests/integration/test_ci_remote.py": 70, "tests/integration/test_real_fp8.py": 700,
           "tests/integration/test_real_nvfp4.py": 450, "tests/integration/test_ladder.py": 150}


def work_unit(nodeid: str) -> str:
    """What runs on one xdist worker: a module, or in a :data:`SPREAD` module a class or a single test."""
    parts = nodeid.split("::")
    if parts[0] not in SPREAD:
        return parts[0]
    return "::".join(parts[:2]) if len(parts) > 2 else nodeid


def pytest_xdist_make_scheduler(config, log):
    """The suite's two xdist workers (pyproject.toml) take whole :func:`work_unit` s, in collection order.
    (xdist's own ``--dist loadgroup`` does not group under pytest 9.2: it renames ``item._nodeid``, which pytest
    9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The heaviest modules first (xdist keeps the collection order: ``--no-loadscope-reorder``)."""
    items.sort(key=lambda item: -WEIGHTS.get(Path(item.path).relative_to(REPO).as_posix(), 0))  # stable
