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
from kiln.models import Base
from tests.integration.stack import PG, postgres_database


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
