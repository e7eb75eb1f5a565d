"""The GitHub Actions build step (examples/ci/github/kiln-build.yml), run by bash against a real ``kiln serve``
with the real CLI: ``kiln build --server --wait --junit --report-html`` end to end, its step outputs and summary;
then what a deploy script does next — ``kiln resolve --server`` and ``kiln pull --server --json`` with the
checkpoint artifact's serving configurations beside its files."""

from __future__ import annotations

import json
import shlex
import stat
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
import yaml

from tests.ci_steps import ENTRY, run_github_build_step
from tests.conftest import REPO
from scripts.devstack import served as embedded

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with embedded(tmp_path_factory.mktemp("ci-remote") / "kiln", {}) as s:
        yield s


def test_github_build_step_against_a_real_server_then_resolve_and_pull(served, tmp_path):
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir()
    # the real CLI of this checkout; calibration and evaluation kept small (the template passes the rest)
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m api.cli "
                    "\"$@\" --calib-samples 8 --calib-seq-len 64 --eval-max-tokens 1024"
                    " --override-reason 'a test build: a short evaluation'\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    digest, work, summary = run_github_build_step(served, tmp_path, model="acme/ci", env={
        **served.env, "PATH": f"{shim.parent}:{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert digest in summary
    reports = work / "kiln-reports"
    root = ET.parse(reports / "junit.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["digest"] == digest and props["verdict"] == "pass" and root.findall(".//testcase")
    assert digest in (reports / "report.html").read_text()
    assert json.loads((reports / "digest.json").read_text()) == {ENTRY: digest}

    resolved = served.kiln("resolve", "acme/ci", "--precision", "fp8", "--target", "cpu", "--profile", "latency",
                           "--backend", "checkpoint", "--server", served.url)
    assert resolved.returncode == 0 and resolved.stdout == digest + "\n", resolved.stderr
    none = served.kiln("resolve", "acme/ci", "--precision", "nvfp4", "--target", "cpu", "--backend", "checkpoint",
                       "--server", served.url)
    assert none.returncode == 2 and "no engine for acme/ci nvfp4" in none.stderr

    dest = tmp_path / "pulled"
    pulled = served.kiln("pull", f"acme/ci@{digest}", str(dest), "--server", served.url, "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["digest"] == digest
    manifest = json.loads((dest / "serving" / "serving.json").read_text())
    assert manifest["runtimes"]["tensorrt-llm"]["argv"][0] == "trtllm-serve"
    assert yaml.safe_load((dest / "serving" / "vllm.yaml").read_text())["max-num-seqs"] == 1


def test_github_build_file_step_against_a_real_server(served, tmp_path):
    """The step's build-file path: a kiln.yaml of the calling repository built with `kiln build -f --server --wait
    --json --timeout`, each engine's digest under its entry's name and its JUnit and HTML reports fetched."""
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m api.cli "
                    "\"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    doc = tmp_path / "kiln.yaml"
    doc.write_text(yaml.safe_dump({"defaults": {
        "checkpoint": str(REPO / "examples" / "tiny-llama"), "model_name": "acme/ci-file", "target": "cpu",
        "profile": "latency", "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
        "override_reason": "a test build: a short evaluation"},
        "matrix": [{"precision": "fp8", "backend": "checkpoint"}]}))
    digest, work, summary = run_github_build_step(served, tmp_path, model="acme/ci-file", build_file=doc, env={
        **served.env, "PATH": f"{shim.parent}:{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert f"- fp8-cpu-latency-checkpoint: `{digest}`" in summary and "build file:" in summary
    reports = work / "kiln-reports"
    assert json.loads((reports / "digest.json").read_text()) == {"fp8-cpu-latency-checkpoint": digest}
    root = ET.parse(reports / "junit-fp8-cpu-latency-checkpoint.xml").getroot()
    assert {p.get("name"): p.get("value") for p in root.iter("property")}["digest"] == digest
    assert digest in (reports / "report-fp8-cpu-latency-checkpoint.html").read_text()
    assert json.loads((reports / "build.json").read_text().strip().splitlines()[-1])["exit"] == 0
