"""Database engine, sessions and schema upgrades (Alembic, migrations under ``migrations/``)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker


_ENGINES: list[Engine] = []


def _after_fork_in_child() -> None:
    """A forked process (Celery's prefork pool) must not use the parent's pooled connections: the sockets
    would be shared by two processes. Drop them without closing (closing would hurt the parent)."""
    for engine in _ENGINES:
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_after_fork_in_child)


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    engine = _create_engine(url)
    _ENGINES.append(engine)
    return engine


def _create_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _):  # WAL lets the API read while a worker writes
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


def alembic_config(url: str):
    from alembic.config import Config

    import migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
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
