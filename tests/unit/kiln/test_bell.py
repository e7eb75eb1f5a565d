"""kiln/bell.py on the embedded database, and the embedded broker's transport: an event-stream reader wakes on
the commit of another connection (not on a timer), a reader with nothing committed waits out its timeout, and the
worker's broker polls every 50 ms instead of kombu's second. (PostgreSQL's NOTIFY path: tests/integration/test_db.py.)"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from kiln import db
from kiln.bell import Bell
from kiln.tables import Build, BuildEvent


@pytest.fixture
def sqlite_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    return url


def _build(sessions) -> str:
    with sessions() as s:
        b = Build(id=uuid.uuid4().hex, request_key="sha256:" + uuid.uuid4().hex * 2, spec={}, queue="q",
                  status="running")
        s.add(b)
        s.commit()
        return b.id


def _add_event_later(sessions, build_id: str, delay: float) -> threading.Thread:
    def add():
        time.sleep(delay)
        with db.session_factory(str(sessions.kw["bind"].url))() as s:
            s.add(BuildEvent(build_id=build_id, kind="stage", data={"name": "quantize"}))
            s.commit()
    t = threading.Thread(target=add)
    t.start()
    return t


def test_a_reader_wakes_on_another_connections_commit_not_on_its_timeout(sqlite_url):
    sessions = db.session_factory(sqlite_url)
    build_id = _build(sessions)
    bell = Bell(sqlite_url)

    async def read():
        ticket = bell.ticket(build_id)
        writer = _add_event_later(sessions, build_id, 0.2)
        t0 = time.monotonic()
        await asyncio.wait_for(bell.wait(ticket, timeout=120.0), 60)  # a timeout of 120 s: only the commit ends it
        writer.join()
        return time.monotonic() - t0

    waited = asyncio.run(read())
    assert waited < 60  # woken by the commit (the wait's own timeout was 120 s)
    with sessions() as s:
        assert s.query(BuildEvent).filter_by(build_id=build_id, kind="stage").count() == 1


def test_a_commit_before_the_ticket_does_not_wake_the_reader(sqlite_url):
    sessions = db.session_factory(sqlite_url)
    build_id = _build(sessions)
    bell = Bell(sqlite_url)

    async def read():
        ticket = bell.ticket(build_id)
        t0 = time.monotonic()
        await bell.wait(ticket, timeout=0.3)
        return time.monotonic() - t0

    assert asyncio.run(read()) >= 0.3  # nothing committed after the ticket: the wait runs to its timeout


def test_the_embedded_broker_is_polled_every_50_ms(tmp_path):
    from workers.celery_app import EMBEDDED_BROKER_POLL_S, broker_url_for_celery, make_app

    assert broker_url_for_celery("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    app = make_app(f"sqla+sqlite:///{tmp_path / 'broker.db'}")
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        assert conn.transport.polling_interval == EMBEDDED_BROKER_POLL_S == 0.05
        assert conn.transport.client.hostname == f"sqlite:///{tmp_path / 'broker.db'}"
