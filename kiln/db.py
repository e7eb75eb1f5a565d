"""Database engine, sessions and schema upgrades (Alembic, migrations under ``migrations/``)."""

from __future__ import annotations

import os
import time
from functools import lru_cache
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

#: A pooled connection idle longer than this is pinged before use (see :func:`_ping_when_idle`).
PING_AFTER_IDLE_S = 1.0
#: Connections a process keeps open, and how many more it may open under a burst. The API runs its sync
#: endpoints on Starlette's thread pool (40 threads): a pool smaller than the concurrency opens and closes a
#: server connection per request (each one a forked PostgreSQL backend) once the burst passes the pool.
POOL_SIZE, MAX_OVERFLOW = 16, 24


_ENGINES: list[Engine] = []


def _after_fork_in_child() -> None:
    """A forked process (Celery's prefork pool) must not use the parent's pooled connections: the sockets
    would be shared by two processes. Drop them without closing (closing would hurt the parent)."""
    for engine in _ENGINES:
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_after_fork_in_child)


@lru_cache(maxsize=8)
def get_engine(url: str, autocommit: bool = False) -> Engine:
    """The process's engine for ``url``. ``autocommit``: a second engine, with its own pool, whose connections
    run each statement on its own (no BEGIN / ROLLBACK round trips, no isolation level switched per checkout)."""
    if autocommit and url.startswith("sqlite") and url.split("///", 1)[-1] in ("", ":memory:"):
        return get_engine(url)  # a second engine would open a second, empty, in-memory database
    options = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None} if autocommit else {}
    engine = _create_engine(url, **options)
    _ENGINES.append(engine)
    return engine


def _create_engine(url: str, **options) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **options)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _):  # WAL lets the API read while a worker writes
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    engine = create_engine(url, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW, **options)
    _ping_when_idle(engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Pessimistic disconnect handling at a lower price than ``pool_pre_ping``, which costs a round trip on
    every checkout: only a connection that sat in the pool longer than :data:`PING_AFTER_IDLE_S` is pinged
    (a dead one raises DisconnectionError, and the pool replaces it). A connection in steady use is not; if
    the server went away since its last use, that one statement fails, SQLAlchemy invalidates the whole pool,
    and the API answers 503 once (``api/app.py``)."""

    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _used(_dbapi_conn, record) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn, record, _proxy) -> None:
        if time.monotonic() - record.info.get("idle_since", 0.0) < PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            if engine.dialect.is_disconnect(exc, dbapi_conn, None):
                raise DisconnectionError(str(exc)) from exc
            raise


def session_factory(url: str) -> sessionmaker[Session]:
    from kiln import bell

    bell.install()  # a session adding a build event wakes that build's event-stream readers (PostgreSQL NOTIFY)
    return sessionmaker(get_engine(url), expire_on_commit=False)


def alembic_config(url: str):
    from importlib.util import find_spec

    from alembic.config import Config

    # found by name, not imported: the migrations import the schema, never the other way (pyproject's contracts)
    found = find_spec("migrations")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError("the migrations package is not installed beside kiln")
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(list(found.submodule_search_locations)[0])))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _run(url: str, action: str, revision: str) -> None:
    from alembic import command

    cfg = alembic_config(url)
    with get_engine(url).begin() as conn:  # get_engine creates the SQLite file's folder
        cfg.attributes["connection"] = conn
        getattr(command, action)(cfg, revision)


def upgrade(url: str, revision: str = "head") -> None:
    _run(url, "upgrade", revision)


def downgrade(url: str, revision: str) -> None:
    _run(url, "downgrade", revision)
