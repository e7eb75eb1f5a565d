"""Alembic environment. The URL comes from the config Kiln builds (kiln.db.alembic_config) or KILN_DATABASE_URL.
On PostgreSQL, lock and statement timeouts keep a migration from hanging behind a long transaction."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from kiln.tables import Base
from kiln.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().db_url


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _migrate(conn) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SET lock_timeout = '10s'"))
        conn.execute(text("SET statement_timeout = '120s'"))
    context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=conn.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:  # handed over by kiln.db (its engine, its transaction)
        _migrate(conn)
        return
    engine = create_engine(url)
    with engine.begin() as conn:
        _migrate(conn)
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
