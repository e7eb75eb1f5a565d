"""With --json, stdout always ends with one JSON line: the result, or the error when none was printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def kiln(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,code,exit_code,field", [
    (("build", "/nonexistent", "--precision", "fp8"), "invalid_spec", 2, "checkpoint"),
    (("build", "examples/tiny-llama", "--precision", "int3"), "invalid_spec", 2, "precision"),
    (("resolve", "acme/none", "--precision", "fp8", "--target", "cpu"), None, 2, None),
    (("pull", "ffffffff", "out"), "artifact_unknown", 2, "digest"),
])
def test_an_error_under_json_is_the_stdout_json_line_and_the_stderr_line(tmp_path, args, code, exit_code, field):
    proc = kiln(tmp_path, *args, "--json")
    assert proc.returncode == exit_code, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    body = json.loads(lines[0])
    assert body["exit"] == exit_code and body["error"]["message"]
    if code:
        assert body["error"]["code"] == code
    if field:
        assert body["error"]["field"] == field
    assert proc.stderr.startswith("kiln: error: ") and len(proc.stderr.strip().splitlines()) == 1


def test_without_json_stdout_stays_empty_on_error(tmp_path):
    proc = kiln(tmp_path, "build", "/nonexistent", "--precision", "fp8")
    assert proc.returncode == 2 and proc.stdout == ""


def test_a_result_printed_by_an_earlier_command_in_the_process_does_not_swallow_the_next_error(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from api.cli import main
    from api.output import json_line

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    json_line({"an": "earlier result"})  # as a command run before in this process printed
    result = CliRunner().invoke(main, ["pull", "ffffffff", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout.strip().splitlines()[-1])["error"]["code"] == "artifact_unknown"
