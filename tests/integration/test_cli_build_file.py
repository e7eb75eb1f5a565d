"""``kiln build -f`` for real: a two-entry matrix of examples/tiny-llama (quantized checkpoints, small calibration
and evaluation) built one after another in one process on the embedded defaults, then the same document again, all
of it answered from the registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

DOC = """\
defaults:
  checkpoint: examples/tiny-llama
  model_name: acme/matrix
  backend: checkpoint
  target: cpu
  calibration: {samples: 8, seq_len: 64}
  evaluation: {max_tokens: 1024}
  override_reason: "a test build: a short evaluation"
matrix:
  - precision: fp8
  - precision: nvfp4
    calibration: {samples: 16}
"""


def test_a_matrix_builds_every_entry_in_turn_and_reports_each(tmp_path):
    doc = tmp_path / "kiln.yaml"
    doc.write_text(DOC)
    env = {**os.environ, "KILN_HOME": str(tmp_path / "kiln"), "KILN_CHECKPOINT_ROOTS": str(REPO)}

    def build(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "api.cli", "build", "-f", str(doc), *extra], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=1200)

    proc = build("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    body = json.loads(proc.stdout.strip().splitlines()[-1])
    assert body["exit"] == 0 and body["file"] == str(doc)
    rows = body["builds"]
    assert [(r["entry"], r["precision"], r["backend"], r["status"]) for r in rows] == [
        (0, "fp8", "checkpoint", "succeeded"), (1, "nvfp4", "checkpoint", "succeeded")]
    assert all(r["digest"].startswith("sha256:") and r["exit"] == 0 and not r["cache_hit"] for r in rows)
    assert rows[0]["digest"] != rows[1]["digest"]
    assert "[1/2] building acme/matrix fp8" in proc.stderr and "[2/2] building acme/matrix nvfp4" in proc.stderr
    assert "entry 1/2 (fp8 latency cpu checkpoint): succeeded" in proc.stderr
    again = build()  # the table, every entry a cache hit
    assert again.returncode == 0, again.stderr
    table = again.stdout.strip().splitlines()
    assert table[0].split() == ["entry", "model", "precision", "profile", "target", "backend", "status", "exit",
                                "digest"]
    assert [line.split()[-1] for line in table[1:]] == [r["digest"] for r in rows]
    assert again.stderr.count("succeeded (cache hit") == 2, again.stderr
