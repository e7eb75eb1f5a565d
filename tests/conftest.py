"""Shared fixtures. Tests never touch the user's ~/.kiln: every test gets its own KILN_HOME."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "tiny-llama"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("kiln-home")
    monkeypatch.setenv("KILN_HOME", str(home))
    monkeypatch.setenv("KILN_CHECKPOINT_ROOTS", os.pathsep.join([str(REPO), str(home.parent)]))
    yield home


#: Modules whose tests share no module-scoped fixture and each take a minute or more: their tests are spread over
#: the pytest-xdist workers one by one. Every other module runs on one worker, its module fixtures built once.
SPREAD = {"tests/integration/test_families.py"}


def pytest_collection_modifyitems(config, items):
    """Group tests by module for ``--dist loadgroup`` (pyproject.toml runs the suite on two xdist workers)."""
    for item in items:
        module = Path(item.path).relative_to(REPO).as_posix()
        if module not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(module))
