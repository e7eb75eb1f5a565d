"""The ``--server`` commands against the API in process (httpx.Client replaced by a TestClient of a real app and
SQLite index; no build runs): ``--dry-run`` plans on the server and queues nothing, ``--no-wait`` says the build's
id and where to follow it, ``kiln keys public`` never makes a key and reads a server's, and a wrong ``--server`` or
token is one line naming what to change, exit 2, before anything is sent."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from tests.conftest import REPO, TINY

BOOT = "kiln_bootstrap_for_cli_remote_tests_0123456789"
SPEC = [str(TINY), "--backend", "checkpoint", "--calib-samples", "8"]
MATRIX = (f"defaults:\n  checkpoint: {TINY}\n  backend: checkpoint\n  calibration: {{samples: 8}}\n"
          "matrix:\n  - precision: fp8\n  - precision: nvfp4\n")


class Server:
    """A Kiln API in process, reached by every httpx.Client api.remote makes (its base_url kept, as a real
    client's: a wrong path below the root reaches the app as it would reach a server)."""

    def __init__(self, tmp_path, monkeypatch, **settings):
        import api.remote
        from api.app import create_app
        from kiln import db
        from kiln.settings import Settings

        self.settings = Settings(home=tmp_path / "server", checkpoint_roots=str(REPO), **settings)
        db.upgrade(self.settings.db_url)
        self.queued: list = []
        self.app = create_app(self.settings, enqueue=lambda *a: self.queued.append(a))
        self.requests: list[tuple[str, str]] = []

        def client(base_url, timeout, headers):
            c = TestClient(self.app, base_url=base_url, headers=headers)
            request = c.request

            def counted(method, url, **kw):
                self.requests.append((method, url))
                return request(method, url, **kw)

            c.request = counted  # type: ignore[method-assign]
            return c

        monkeypatch.setattr(api.remote.httpx, "Client", client)

    def builds(self) -> int:
        from kiln.tables import Build

        with self.app.state.sessions() as s:
            return s.scalar(select(func.count()).select_from(Build))


def kiln(*args: str):
    from api.cli import main

    return CliRunner().invoke(main, list(args))


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: "), result.stderr
    return lines[0]


# -- 1. --dry-run never submits ----------------------------------------------------------------------------------
def test_dry_run_with_server_prints_the_servers_plan_and_queues_nothing(tmp_path, monkeypatch):
    server = Server(tmp_path, monkeypatch)
    result = kiln("build", *SPEC, "--server", "http://kiln", "--dry-run", "--no-wait", "--json")
    assert result.exit_code == 0, result.output
    assert server.queued == [] and server.builds() == 0
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["build_key"].startswith("sha256:") and plan["spec"]["backend"] == "checkpoint"
    assert plan["submission"]["outcome"] == "new-build" and "no such worker is live" in plan["submission"]["reason"]
    assert [m for m, _ in server.requests] == ["POST"] and server.requests[0][1].endswith("/v1/builds/plan")

    # the submission it describes: once the build exists, the plan says it would join it
    submitted = kiln("build", *SPEC, "--server", "http://kiln", "--no-wait", "--json")
    assert submitted.exit_code == 0 and server.builds() == 1, submitted.output
    build_id = json.loads(submitted.stdout.strip().splitlines()[-1])["id"]
    again = kiln("build", *SPEC, "--server", "http://kiln", "--dry-run")
    assert again.exit_code == 0 and server.builds() == 1 and len(server.queued) == 1, again.output
    assert json.loads(again.stdout)["submission"] == {"queue": plan["submission"]["queue"],
                                                      "outcome": "existing-build", "build": build_id,
                                                      "status": "queued"}


def test_dry_run_of_a_document_with_server_plans_every_entry_and_queues_nothing(tmp_path, monkeypatch):
    server = Server(tmp_path, monkeypatch)
    doc = tmp_path / "kiln.yaml"
    doc.write_text(MATRIX)
    result = kiln("build", "-f", str(doc), "--server", "http://kiln", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout.strip().splitlines()[-1])
    assert body["file"] == str(doc) and [p["spec"]["precision"] for p in body["plans"]] == ["fp8", "nvfp4"]
    assert server.queued == [] and server.builds() == 0
    doc.write_text(MATRIX + "  - precision: int3\n")  # refused as the submission would be, naming the entry
    refused = kiln("build", "-f", str(doc), "--server", "http://kiln", "--dry-run")
    assert refused.exit_code == 2 and "matrix.2.precision" in one_line(refused) and f"in {doc}" in refused.stderr


def test_the_plan_route_answers_what_a_submission_would_do_and_writes_nothing(tmp_path, monkeypatch):
    server = Server(tmp_path, monkeypatch)
    c = TestClient(server.app)
    spec = {"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint", "calibration": {"samples": 8}}
    r = c.post("/v1/builds/plan", json=spec)
    assert r.status_code == 200 and r.json()["submission"]["outcome"] == "new-build", r.text
    assert server.builds() == 0 and server.queued == []
    bad = c.post("/v1/builds/plan", json={**spec, "precision": "int3"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "precision"


# -- 2. --no-wait says the build id ------------------------------------------------------------------------------
def test_no_wait_prints_the_build_id_and_where_to_follow_it(tmp_path, monkeypatch):
    server = Server(tmp_path, monkeypatch)
    result = kiln("build", *SPEC, "--server", "http://kiln:8000/", "--no-wait")
    assert result.exit_code == 0, result.output
    assert server.builds() == 1
    (line,) = result.stdout.strip().splitlines()
    with server.app.state.sessions() as s:
        from kiln.tables import Build

        build_id = s.scalars(select(Build.id)).one()
    assert line.startswith(f"build {build_id} queued on http://kiln:8000; ")
    assert f"GET http://kiln:8000/v1/builds/{build_id}" in line
    doc = tmp_path / "kiln.yaml"  # -f: each entry's line names its build
    doc.write_text(MATRIX)
    entries = kiln("build", "-f", str(doc), "--server", "http://kiln", "--no-wait")
    assert entries.exit_code == 0 and server.builds() == 2, entries.output  # fp8 joins the build above
    with server.app.state.sessions() as s:
        ids = set(s.scalars(select(Build.id)))
    assert {line.rsplit(", build ", 1)[-1] for line in entries.stderr.splitlines() if ", build " in line} == ids


# -- 3. kiln keys public never makes a key -----------------------------------------------------------------------
def test_keys_public_without_a_key_says_so_and_makes_none(tmp_path, monkeypatch, _isolated_home):
    monkeypatch.delenv("KILN_SIGNING_KEY", raising=False)
    result = kiln("keys", "public")
    assert result.exit_code == 2 and result.stdout == ""
    line = one_line(result)
    assert "KILN_SIGNING_KEY" in line and "kiln keys public --server" in line
    assert not (_isolated_home / "keys").exists()
    assert kiln("keys", "public", "--trusted").exit_code == 2 and not (_isolated_home / "keys").exists()


def test_keys_public_with_server_prints_the_servers_signing_key(tmp_path, monkeypatch, _isolated_home):
    from artifacts.signing import configured_signer

    server = Server(tmp_path, monkeypatch)
    result = kiln("keys", "public", "--server", "http://kiln")
    assert result.exit_code == 0, result.output
    assert result.stdout == configured_signer(server.settings).public_pem.decode()
    assert not (_isolated_home / "keys").exists()  # the server's key, not one made here
    r = TestClient(server.app).get("/v1/keys", headers={"Accept": "application/x-pem-file"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-pem-file")
    assert r.text == result.stdout
    assert TestClient(server.app).get("/v1/keys").json()["keys"][0]["signing"] is True  # JSON otherwise


# -- 5. a wrong --server or token --------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ("build", *SPEC, "--no-wait"), ("build", *SPEC, "--dry-run"), ("report", "sha256:" + "a" * 64),
    ("resolve", "acme/tiny", "--precision", "fp8", "--target", "h100", "--profile", "latency"), ("models",), ("keys", "public"), ("pull", "acme/tiny@sha256:" + "a" * 64, "out"),
])
def test_a_server_without_its_scheme_is_refused_at_once_naming_the_fix(tmp_path, monkeypatch, args):
    server = Server(tmp_path, monkeypatch)
    t0 = time.monotonic()
    result = kiln(*args, "--server", "127.0.0.1:8731")
    assert result.exit_code == 2 and time.monotonic() - t0 < 5
    line = one_line(result)
    assert "--server" in line and "--server http://127.0.0.1:8731" in line
    assert server.requests == []


def test_a_server_ending_in_v1_is_refused_as_not_the_service_root(tmp_path, monkeypatch):
    server = Server(tmp_path, monkeypatch)
    result = kiln("build", *SPEC, "--server", "http://kiln:8000/v1", "--no-wait")
    assert result.exit_code == 2
    line = one_line(result)
    assert "service root, without /v1" in line and "--server http://kiln:8000)" in line
    assert server.requests == [] and server.builds() == 0


@pytest.mark.parametrize("token,words", [("kiln_wrong", "refused the token in KILN_TOKEN"),
                                         (None, "requires a token")])
def test_a_wrong_or_missing_token_is_exit_2_naming_kiln_token(tmp_path, monkeypatch, token, words):
    server = Server(tmp_path, monkeypatch, auth="required", bootstrap_token=BOOT)
    if token:
        monkeypatch.setenv("KILN_TOKEN", token)
    else:
        monkeypatch.delenv("KILN_TOKEN", raising=False)
    result = kiln("build", *SPEC, "--server", "http://kiln", "--no-wait")
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert words in line and "set KILN_TOKEN to" in line
    assert server.builds() == 0
