"""GET /v1/builds filters and pages in SQL (one page read per call, not the table), on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from kiln import db
from kiln.tables import Build
from kiln.settings import Settings


@pytest.fixture(params=["sqlite", "postgresql"])
def client(request, tmp_path):
    if request.param == "sqlite":
        settings = Settings(home=tmp_path / "home")
        db.upgrade(settings.db_url)
        yield _fill(settings)
        return
    from scripts.devstack import postgres_database

    with postgres_database() as url:
        settings = Settings(home=tmp_path / "home", database_url=url)
        db.upgrade(url)
        yield _fill(settings)


def _fill(settings: Settings) -> TestClient:
    app = create_app(settings, enqueue=lambda *a, **k: None)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with app.state.sessions() as s:
        for i in range(30):
            s.add(Build(id=f"b{i:02d}", request_key="sha256:" + uuid.uuid4().hex * 2, queue="q",
                        status="failed" if i % 3 == 0 else "succeeded", stages=[], attempts=0, cancel_requested=False,
                        spec={"model_name": "acme/a" if i % 2 else "acme/b", "precision": "fp8"},
                        created_at=t0 + timedelta(minutes=i)))
        s.commit()
    return TestClient(app)


def test_filters_and_pages_in_sql(client):
    r = client.get("/v1/builds", params={"model": "acme/a", "limit": 5, "offset": 2}).json()
    assert r["total"] == 15 and [b["id"] for b in r["builds"]] == ["b25", "b23", "b21", "b19", "b17"]
    r = client.get("/v1/builds", params={"model": "acme/b", "status": "failed"}).json()
    assert r["total"] == 5 and {b["id"] for b in r["builds"]} == {"b00", "b06", "b12", "b18", "b24"}
    assert client.get("/v1/builds", params={"model": "acme/none"}).json() == {"builds": [], "total": 0, "limit": 50,
                                                                              "offset": 0}
    assert client.get("/v1/builds", params={"limit": 500}).json()["total"] == 30


def test_a_page_is_read_not_the_table(client):
    from sqlalchemy import event

    engine = client.app.state.sessions.kw["bind"]
    statements: list[str] = []

    def record(conn, cursor, statement, *args):
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        client.get("/v1/builds", params={"model": "acme/a", "limit": 5})
    finally:
        event.remove(engine, "before_cursor_execute", record)
    reads = [s for s in statements if "FROM builds" in s and "count(" not in s.lower()]
    assert reads and all("LIMIT" in s for s in reads), statements
