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


#: Modules whose tests are spread over the pytest-xdist workers one by one (no module-scoped fixture ties them
#: together, or the tests that share one carry an ``xdist_group`` mark of their own). Every other module runs on
#: one worker, its module fixtures built once.
SPREAD = {"tests/integration/test_families.py", "tests/integration/test_cli_build.py"}
#: Seconds a module's tests took on two xdist workers (2026-12-02): the longest start first, so that no long
#: module is left to run alone at the end (only the order depends on these; a module not listed counts 0).
WEIGHTS = {"tests/integration/test_cli_build.py": 650, "tests/integration/test_families.py": 110,
           "tests/integration/test_service.py": 320, "tests/integration/test_report.py": 275,
           "tests/integration/test_faults.py": 270, "tests/integration/test_oci.py": 230,
           "tests/integration/test_cli_ci.py": 220, "tests/integration/test_dashboard.py": 170,
           "tests/integration/test_freshness.py": 130, "tests/integration/test_gc.py": 100,
           "tests/integration/test_serve.py": 100, "tests/integration/test_security.py": 100,
           "tests/integration/test_ci_remote.py": 70}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into the node ids (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Group tests by module for ``--dist loadgroup`` (pyproject.toml runs the suite on two xdist workers), the
    heaviest modules first (xdist keeps this order: ``--no-loadscope-reorder``)."""
    for item in items:
        module = Path(item.path).relative_to(REPO).as_posix()
        if module not in SPREAD and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(module))
    items.sort(key=lambda item: -WEIGHTS.get(Path(item.path).relative_to(REPO).as_posix(), 0))  # stable
