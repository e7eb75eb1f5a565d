"""`kiln resolve`, `kiln report -o FILE` and `kiln pull --json` through the real CLI process, on an engine
published into a KILN_HOME by the real publish stage (no build: fast)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from tests.engines import publish_tiny

REPO = Path(__file__).resolve().parents[3]


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def kiln(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "KILN_HOME": str(home)}, timeout=120)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> tuple[Path, str]:
    home = tmp_path_factory.mktemp("deploy") / "kiln"
    gates = [{"name": "max_ppl_increase_pct", "value": 0.4, "threshold": 3.0, "passed": True}]
    _, _, row = publish_tiny(home, key=b"k", files={"config.json": b"{}", "serving/vllm.yaml": b"max-num-seqs: 8\n"},
                             gates=gates)
    return home, row.digest


def test_resolve_prints_exactly_the_digest(home):
    path, digest = home
    proc = kiln(path, "resolve", "acme/tiny", "--precision", "fp8", "--target", "h100", "--profile", "balanced",
                "--backend", "checkpoint")
    assert proc.returncode == 0 and proc.stdout == digest + "\n", proc.stderr
    body = json.loads(kiln(path, "resolve", "acme/tiny", "--precision", "fp8", "--target", "sm90", "--profile",
                           "balanced", "--backend", "checkpoint", "--json").stdout)
    assert body["reference"] == f"acme/tiny@{digest}" and body["tag"] == "fp8-sm90-balanced-checkpoint"


def test_resolve_asks_for_the_backend_kiln_build_uses_when_none_is_named(home):
    path, _ = home  # no sm90 aot-inductor build exists: the default backend finds none, and says which it asked for
    proc = kiln(path, "resolve", "acme/tiny", "--precision", "fp8", "--target", "h100", "--profile", "balanced")
    assert proc.returncode == 2 and "aot-inductor" in proc.stderr and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1


def test_report_to_a_file_and_pull_json(home, tmp_path):
    path, digest = home
    out = tmp_path / "r" / "junit.xml"
    assert kiln(path, "report", digest, "--format", "junit", "-o", str(out)).returncode == 0
    assert ET.parse(out).getroot().find(".//testcase").get("name") == "max_ppl_increase_pct"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    dest = tmp_path / "pulled"
    proc = kiln(path, "pull", digest, str(dest), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"digest": digest, "repository": "acme/tiny", "status": "fresh",
                                       "dest": str(dest), "server": None, "signed": True, "verified_key": None}
    assert (dest / "serving" / "vllm.yaml").read_text() == "max-num-seqs: 8\n"
    # the serving configs are engine files like the others: the signature covers them, offline
    (tmp_path / "kiln.pub").write_text(kiln(path, "keys", "public").stdout)
    ok = subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", "--signature", str(dest / "model.sig"),
                         "--public_key", str(tmp_path / "kiln.pub"), str(dest)], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_every_command_that_takes_an_engine_takes_a_prefix_or_a_tag(home, tmp_path):
    path, digest = home
    prefix, tag = digest.split(":")[1][:10], "acme/tiny:fp8-sm90-balanced-checkpoint"
    for ref in (prefix, tag):
        shown = kiln(path, "artifacts", "show", ref)
        assert shown.returncode == 0 and json.loads(shown.stdout)["digest"] == digest, shown.stderr
        rep = kiln(path, "report", ref)
        assert rep.returncode == 0 and json.loads(rep.stdout)["digest"] == digest, rep.stderr
        ver = kiln(path, "verify", ref)
        assert ver.returncode == 0 and digest in ver.stdout, ver.stderr
    proc = kiln(path, "pull", prefix, str(tmp_path / "p"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["digest"] == digest, proc.stderr
    missing = kiln(path, "report", "acme/tiny:nvfp4-sm90-latency")
    assert missing.returncode == 2 and "no tag" in missing.stderr and len(missing.stderr.splitlines()) == 1
