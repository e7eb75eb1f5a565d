"""``kiln models`` and ``GET /v1/support`` give one answer: the support matrix with what ran where (each row's
``verified``), read from the same index; without an index the CLI still answers and says it has no build history."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from kiln import db
from kiln.tables import Artifact, Build
from kiln.settings import get_settings

KEY = ("gemma2", "fp8", "trtllm-engine")  # supported by the tables; the suite never builds it


def record_build(sessions, *, family="gemma2", precision="fp8", backend="trtllm-engine", target="sm90") -> str:
    """What a service build leaves behind: its build row, succeeded, and the validated engine it published."""
    d = "sha256:" + uuid.uuid4().hex * 2
    when = datetime(2026, 12, 4, 8, 0, tzinfo=timezone.utc)
    with sessions() as s:
        s.add(Artifact(digest=d, build_key=d, repository="acme/gemma", tag=f"{precision}-{target}-latency-{backend}",
                       status="fresh", precision=precision, target=target, profile="latency", backend=backend,
                       checkpoint_ref="hf://acme/gemma@main", checkpoint_digest=d, size=1,
                       provenance={"family": family, "toolchain": {"torch": "2.13"}},
                       validation={"passed": True, "metrics": {}, "gates": []}, created_at=when))
        s.add(Build(id=uuid.uuid4().hex, request_key=d, build_key=d, digest=d, queue="q", status="succeeded",
                    spec={"precision": precision, "backend": backend, "target": target}, created_at=when,
                    finished_at=when))
        s.commit()
    return d


def row(doc: dict, key=KEY) -> dict:
    return next(r for r in doc["support"] if (r["family"], r["precision"], r["backend"]) == key)


def cli_json(*args: str) -> dict:
    r = CliRunner().invoke(main, ["models", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.fixture
def served_index():
    """The API over the CLI's own index (KILN_HOME from the autouse fixture)."""
    settings = get_settings()
    db.upgrade(settings.db_url)
    app = create_app(settings, enqueue=lambda *a, **k: None)
    return TestClient(app), app.state.sessions


def test_the_api_and_the_cli_say_never_built_then_built_after_a_build_is_recorded(served_index):
    client, sessions = served_index
    api, cli = client.get("/v1/support").json(), cli_json()
    assert api == cli  # one document: the same rows, history and recipes
    assert row(api)["supported"] is True and row(api)["verified"]["state"] == "never built"
    assert row(api)["verified"]["engines"] == 0 and api["history"]["registry"] is True

    record_build(sessions)
    record_build(sessions, target="sm100")
    api, cli = client.get("/v1/support").json(), cli_json()
    assert api == cli
    v = row(api)["verified"]
    assert v["state"] == "built" and v["engines"] == 2 and v["latest"].startswith("2026-12-04T08:00")
    assert {t: c["engines"] for t, c in v["targets"].items()} == {"sm90": 1, "sm100": 1}
    assert row(api, ("gemma2", "nvfp4", "trtllm-engine"))["verified"]["state"] == "never built"  # another row
    assert api["history"]["engines"] == 2

    text = CliRunner().invoke(main, ["models"]).output  # the human table: the same distinction, compactly
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("fp8") and "trtllm-engine" in ln
                and "built 2×" in ln)
    assert "sm100 1×" in line and "sm90 1×" in line and "latest 2026-12-04" in line
    assert "what ran where — 2 validated engines in the registry" in text
    gemma2 = text[text.index("Gemma 2 ("):text.index("Gemma 3")]
    assert "never built" in gemma2 and "test suite (cpu)" in gemma2


def test_without_an_index_the_cli_says_it_has_no_build_history_and_creates_none(monkeypatch, tmp_path):
    home = tmp_path / "fresh-home"
    monkeypatch.setenv("KILN_HOME", str(home))
    monkeypatch.delenv("KILN_DATABASE_URL", raising=False)
    doc = cli_json()
    assert doc["history"]["registry"] is False and doc["history"]["note"].startswith("no build history")
    assert row(doc)["verified"]["state"] == "no build history" and row(doc)["verified"]["engines"] is None
    assert row(doc, ("llama", "fp8", "aot-inductor"))["verified"]["state"] == "test suite"
    assert not (home / "kiln.db").exists()  # reading the history creates no index
    text = CliRunner().invoke(main, ["models"]).output
    assert "what ran where — no build history" in text and "· no build history" in text


def test_an_unreadable_registry_is_reported_not_fatal(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_DATABASE_URL", f"sqlite:///{tmp_path / 'missing-dir' / 'kiln.db'}")
    doc = cli_json()
    assert doc["history"]["registry"] is False and "KILN_DATABASE_URL could not be read" in doc["history"]["note"]
    assert row(doc)["verified"]["state"] == "no build history"


def test_markdown_marks_what_the_suite_runs():
    from api.cli_models import support_table_markdown

    lines = support_table_markdown().splitlines()
    header = [c.strip() for c in next(ln for ln in lines if ln.startswith("| family")).split("|")]
    columns = [header.index(f"{b} {p}") for b in ("aot-inductor", "checkpoint", "trtllm-engine") for p in ("fp8", "nvfp4")]

    def cells(family: str) -> list[str]:
        row = [c.strip() for c in next(ln for ln in lines if ln.startswith(f"| {family} ")).split("|")]
        return [row[i] for i in columns]

    assert cells("Llama") == ["yes", "yes", "yes", "yes", "legacy", "legacy [1]"]
    assert cells("Mistral") == ["yes", "opt-in", "yes", "yes", "legacy", "legacy [1]"]
    assert cells("Qwen3-MoE") == ["yes", "yes", "yes", "untested", "no [2]", "no [2]"]

