"""``kiln build -f FILE`` before any work: what it refuses (one line, exit 2, nothing built, KILN_HOME untouched),
``kiln schema``, and a document submitted to a server in one request (the API in process, --no-wait)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tests.conftest import REPO, TINY

MATRIX = ("defaults:\n  checkpoint: examples/tiny-llama\n  backend: checkpoint\n"
          "matrix:\n  - precision: fp8\n  - precision: nvfp4\n")


def kiln(tmp_path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO), "KILN_CHECKPOINT_ROOTS": str(REPO)}
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, input=stdin)


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "kiln.yaml"
    path.write_text(MATRIX)
    return path


@pytest.mark.parametrize("extra,field,words", [
    (("examples/tiny-llama",), "checkpoint", "CHECKPOINT cannot be given with -f"),
    (("--precision", "nvfp4"), "precision", "--precision cannot be given with -f"),
    (("--calib-samples", "8"), "calib_samples", "--calib-samples cannot be given with -f"),
    (("--gate", "max_mean_kl=0.1"), "gate", "--gate cannot be given with -f"),
    (("--junit", "out.xml"), "junit", "--junit writes one engine's report"),
    (("--timeout", "5"), "timeout", "--timeout limits a wait on a remote build"),
    (("--force", "--dry-run"), "force", "--force rebuilds here"),
])
def test_options_that_describe_one_spec_are_refused_with_f(tmp_path, doc, extra, field, words):
    proc = kiln(tmp_path, "build", "-f", str(doc), *extra, "--json")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("kiln: error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert words in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["error"]["field"] == field
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("text,field,words", [
    (MATRIX + "  - precision: int3\n", "matrix.2.precision", "'int3' is not supported, in "),
    (MATRIX.replace("backend: checkpoint", "target: a100"), "matrix.0.target", "(from defaults), in "),
    (MATRIX + "  - precision: fp8\n    precision: nvfp4\n", "document", "key 'precision' is given twice"),
    ("matrix: [\n", "document", "is not valid YAML"),
    ("- precision: fp8\n", "document", "the document is a list, not a mapping"),
])
def test_one_bad_entry_is_one_line_naming_file_entry_and_field_and_nothing_is_built(tmp_path, doc, text, field, words):
    doc.write_text(text)
    proc = kiln(tmp_path, "build", "-f", str(doc))
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"kiln: error: {field}: ") and words in line, line
    if field != "document" or "given twice" in words:
        assert str(doc) in line
    assert not (tmp_path / "home").exists()  # refused before any work: no database, no store


def test_stdin_is_read_with_dash_and_a_missing_file_is_named(tmp_path):
    proc = kiln(tmp_path, "build", "-f", "-", stdin=MATRIX + "  - {precision: int3}\n")
    assert proc.returncode == 2 and "matrix.2.precision" in proc.stderr and "<stdin>" in proc.stderr
    proc = kiln(tmp_path, "build", "-f", str(tmp_path / "none.yaml"))
    assert proc.returncode == 2 and "kiln: error: file: cannot read" in proc.stderr
    proc = kiln(tmp_path, "build")
    assert proc.returncode == 2 and "kiln: error: checkpoint: no checkpoint given" in proc.stderr


def test_kiln_schema_prints_the_published_schema(tmp_path):
    proc = kiln(tmp_path, "schema")
    assert proc.returncode == 0 and proc.stdout == (REPO / "docs" / "kiln-build.schema.json").read_text()
    out = tmp_path / "schema.json"
    assert kiln(tmp_path, "schema", "-o", str(out)).returncode == 0 and out.read_text() == proc.stdout


def test_with_server_the_document_is_one_request_and_each_build_is_reported(tmp_path, monkeypatch, doc):
    import api.remote
    from api.app import create_app
    from api.cli import main
    from kiln import db
    from kiln.settings import Settings

    settings = Settings(home=tmp_path / "server", checkpoint_roots=str(REPO))
    db.upgrade(settings.db_url)
    queued: list = []
    app = create_app(settings, enqueue=lambda *a: queued.append(a))
    posts: list = []

    def client(base_url, timeout, headers):
        c = TestClient(app, headers=headers)
        request = c.request

        def counted(method, url, **kw):
            if method == "POST":
                posts.append(kw["json"])
            return request(method, url, **kw)

        c.request = counted
        return c

    monkeypatch.setattr(api.remote.httpx, "Client", client)
    doc.write_text(MATRIX.replace("examples/tiny-llama", str(TINY)) + "    calibration: {samples: 8}\n")
    result = CliRunner().invoke(main, ["build", "-f", str(doc), "--server", "http://kiln", "--no-wait", "--json"])
    assert result.exit_code == 0, result.output
    assert len(posts) == 1 and posts[0]["defaults"]["backend"] == "checkpoint" and len(posts[0]["matrix"]) == 2
    body = json.loads(result.stdout.strip().splitlines()[-1])
    assert body["exit"] == 0 and [b["entry"] for b in body["builds"]] == [0, 1]
    assert [b["precision"] for b in body["builds"]] == ["fp8", "nvfp4"] and all(b["status"] == "queued"
                                                                               for b in body["builds"])
    assert len(queued) == 2 and posts[0]["matrix"][1] == {"precision": "nvfp4", "calibration": {"samples": 8}}
    doc.write_text(MATRIX.replace("examples/tiny-llama", str(TINY)) + "  - precision: int3\n")
    refused = CliRunner().invoke(main, ["build", "-f", str(doc), "--server", "http://kiln", "--no-wait"])
    assert refused.exit_code == 2 and len(posts) == 2 and len(queued) == 2  # the server checked, submitted nothing
    assert "matrix.2.precision" in refused.stderr and f"in {doc}" in refused.stderr, refused.stderr
