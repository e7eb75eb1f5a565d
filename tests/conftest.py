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
