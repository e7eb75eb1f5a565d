"""kiln.db on a real PostgreSQL: the migrations build exactly the models' schema, the read engine runs each
statement on its own, and pooled connections the server dropped are replaced (before use when they sat idle,
after one failed statement when they were in steady use)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from kiln import db
from kiln.tables import Base
from scripts.devstack import PG, postgres_database


@pytest.fixture
def pg_url():
    with postgres_database() as url:
        db.upgrade(url)
        yield url


def _terminate_backends(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    admin = sa.create_engine(f"{PG}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
    admin.dispose()


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_the_migrations_build_exactly_the_models_schema(kind, tmp_path, request):
    url = request.getfixturevalue("pg_url") if kind == "postgresql" else f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    with db.get_engine(url).connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


def _now_twice(engine) -> tuple:
    with engine.connect() as conn:  # now() is the start time of the current transaction
        first = conn.execute(sa.text("SELECT now()")).scalar()
        conn.execute(sa.text("SELECT pg_sleep(0.01)"))
        return first, conn.execute(sa.text("SELECT now()")).scalar()


def test_the_read_engine_runs_each_statement_outside_a_transaction(pg_url):
    first, second = _now_twice(db.get_engine(pg_url, autocommit=True))
    assert second > first
    first, second = _now_twice(db.get_engine(pg_url))  # the default engine: one transaction
    assert second == first


def test_an_idle_connection_the_server_dropped_is_replaced_before_use(pg_url, monkeypatch):
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 0.05)
    engine = db.get_engine(pg_url)
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
    _terminate_backends(pg_url)
    time.sleep(0.1)  # idle past the threshold: pinged at checkout, found dead, replaced
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
    assert after != before


def test_a_connection_in_steady_use_is_not_pinged_and_a_drop_costs_one_statement(pg_url, monkeypatch):
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 3600.0)
    engine = db.get_engine(pg_url, autocommit=True)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    _terminate_backends(pg_url)
    with pytest.raises(sa.exc.DBAPIError) as failed, engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    assert failed.value.connection_invalidated  # what api/app.py answers 503 for
    with engine.connect() as conn:  # the pool was invalidated: the next checkout connects afresh
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1


def test_a_transaction_adding_a_build_event_notifies_listeners_at_commit_only(pg_url):
    """kiln/bell.py: the NOTIFY rides in the writer's transaction, so a rolled-back event wakes no one, and the
    API's Bell wakes a reader of that build (and no other) when it commits."""
    import asyncio
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    from kiln.bell import CHANNEL, Bell
    from kiln.tables import Build, BuildEvent

    sessions = db.session_factory(pg_url)
    ids = []
    with sessions() as s:
        for _ in range(2):
            b = Build(id=uuid.uuid4().hex, request_key="sha256:" + uuid.uuid4().hex * 2, spec={}, queue="q",
                      status="running")
            s.add(b)
            ids.append(b.id)
        s.commit()
    watched, other = ids
    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with sessions() as s:
            s.add(BuildEvent(build_id=watched, kind="stage", data={}))
            s.flush()
            s.rollback()
        assert list(listener.notifies(timeout=0.5)) == []  # rolled back: nothing delivered
        with sessions() as s:
            s.add(BuildEvent(build_id=watched, kind="stage", data={}))
            s.add(BuildEvent(build_id=watched, kind="stage", data={}))
            s.commit()
        notes = list(listener.notifies(timeout=0.5))
        assert [(n.channel, n.payload) for n in notes] == [(CHANNEL, watched)]  # one per transaction and build

    async def read() -> tuple[bool, bool]:
        bell = Bell(pg_url)
        try:
            warmup = bell.ticket(watched)
            for _ in range(100):  # the LISTEN connection comes up
                if bell._listening:
                    break
                await asyncio.sleep(0.05)
            await bell.wait(warmup, timeout=0.01)
            mine, theirs = bell.ticket(watched), bell.ticket(other)

            def commit():
                with sessions() as s:
                    s.add(BuildEvent(build_id=watched, kind="status", data={"status": "succeeded"}))
                    s.commit()
            await asyncio.to_thread(commit)
            await asyncio.wait_for(bell.wait(mine, timeout=120.0), 60)  # only the notification ends it in time
            return mine.mark.is_set(), theirs.mark.is_set()
        finally:
            await bell.close()

    woke_mine, woke_theirs = asyncio.run(read())
    assert woke_mine and not woke_theirs
