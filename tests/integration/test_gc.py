"""Garbage collection through the CLI: old rejected engines and their blobs go; fresh and tagged ones stay,
and every remaining engine still pulls and verifies."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_cli_build import kiln, last_json

pytestmark = pytest.mark.slow
QUICK = ["--backend", "checkpoint", "--calib-samples", "8", "--calib-seq-len", "64", "--eval-max-tokens", "1024",
         "--override-reason", "a test build: a short evaluation", "--json"]


def test_gc_removes_rejected_engines_and_keeps_fresh_ones(tmp_path):
    home = tmp_path / "kiln"
    good = last_json(kiln("build", "examples/tiny-llama", *QUICK, home=home, check=True))
    bad_proc = kiln("build", "examples/tiny-llama", *QUICK, "--gate", "min_top1_agreement=1.5", home=home)
    assert bad_proc.returncode == 1
    bad = last_json(bad_proc)
    blobs_before = {p.name for p in (home / "store").rglob("sha256/*")}

    dry = kiln("gc", "--dry-run", "--keep", "0", "--older-than-days", "0", home=home, check=True)
    assert bad["digest"] in dry.stdout and good["digest"] not in dry.stdout
    assert {p.name for p in (home / "store").rglob("sha256/*")} == blobs_before  # dry run deleted nothing

    kiln("gc", "--keep", "0", "--older-than-days", "0", home=home, check=True)
    listed = json.loads(kiln("artifacts", "list", "--json", home=home, check=True).stdout)
    assert [a["digest"] for a in listed] == [good["digest"]]
    assert bad["digest"].split(":")[1] not in {p.name for p in (home / "store").rglob("sha256/*")}
    kiln("pull", good["digest"], str(tmp_path / "pulled"), home=home, check=True)
    fsck = kiln("fsck", home=home, check=True)
    assert "0 corrupted" in fsck.stdout
