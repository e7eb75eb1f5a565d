"""Builds reach the broker only through workers/enqueue.py's commit hook: a send asked for inside a transaction goes
after that transaction commits, never if it rolls back; and no other module sends a Celery task. Real sessions on
SQLite with the real migrations, as the other worker tests; the broker is a recorder (``Recorder``)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from kiln import db
from kiln.tables import Build
from kiln.states import create_build
from tests.scan import lines_outside
from workers.enqueue import send_after_commit

REPO = Path(__file__).resolve().parents[3]
#: every package of the product and its scripts; a send anywhere in them but the enqueue home fails the scan
SENDS = re.compile(r"\.(delay|apply_async|send_task)\(")
HOME = Path("workers/enqueue.py")


class Recorder:
    """The broker: each send records whether the build's row was visible, at that moment, to another connection
    (a worker's view), beside the steps the test records in ``log``."""

    def __init__(self, sessions, log: list):
        self.sessions, self.log = sessions, log

    def __call__(self, build_id: str, queue: str) -> None:
        with self.sessions() as other:
            self.log.append(("sent", build_id, queue, other.get(Build, build_id) is not None))


@pytest.fixture
def sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    return db.session_factory(url)


def queued() -> Build:
    return Build(id=uuid.uuid4().hex, request_key="sha256:" + "1" * 64, spec={}, queue="kiln.default",
                 status="queued", stages=[], attempts=0, cancel_requested=False)


def test_a_send_asked_for_in_a_transaction_that_commits_goes_after_the_commit(sessions):
    log: list = []
    build = queued()
    with sessions() as s:
        create_build(s, build)
        send = send_after_commit(s, build.id, build.queue, Recorder(sessions, log))
        log.append("asked")
        s.commit()
        log.append("committed")
    # sent once, from inside commit() but after the database committed: another connection saw the row
    assert log == ["asked", ("sent", build.id, "kiln.default", True), "committed"]
    assert send.sent and send.error is None


def test_a_send_asked_for_in_a_transaction_that_rolls_back_is_never_sent(sessions):
    log: list = []
    broker = Recorder(sessions, log)
    with sessions() as s:
        build = create_build(s, queued())
        send = send_after_commit(s, build.id, build.queue, broker)
        s.rollback()
        s.commit()  # the next transaction (empty) commits: the dropped send stays dropped
    with sessions() as s:  # closed without a commit
        build = create_build(s, queued())
        send_after_commit(s, build.id, build.queue, broker)
    with sessions() as s:
        s.commit()
        assert s.get(Build, build.id) is None
    assert log == [] and not send.sent


def test_a_savepoint_that_rolls_back_drops_its_sends_and_a_released_one_waits_for_the_outer_commit(sessions):
    log: list = []
    broker = Recorder(sessions, log)
    kept, dropped = queued(), queued()
    with sessions() as s:
        with s.begin_nested():
            create_build(s, kept)
            send_after_commit(s, kept.id, kept.queue, broker)
        assert log == []  # the savepoint was released; the transaction has not committed
        nested = s.begin_nested()
        create_build(s, dropped)
        send_after_commit(s, dropped.id, dropped.queue, broker)
        nested.rollback()
        s.commit()
    assert log == [("sent", kept.id, "kiln.default", True)]


def test_a_send_the_broker_refuses_leaves_the_reason_on_the_row_and_on_the_callers_copy(sessions):
    def down(build_id: str, queue: str) -> None:
        raise ConnectionError("broker unreachable")

    build = queued()
    with sessions() as s:
        create_build(s, build)
        send = send_after_commit(s, build.id, build.queue, down)
        s.commit()
    reason = "not yet handed to the broker (ConnectionError: broker unreachable); it will be re-enqueued"
    assert isinstance(send.error, ConnectionError) and not send.sent
    assert build.reason == reason
    with sessions() as s:
        assert (s.get(Build, build.id).status, s.get(Build, build.id).reason) == ("queued", reason)


def sends_outside_the_home(root: Path) -> list[str]:
    return lines_outside(root, HOME, SENDS)


def test_no_module_but_the_enqueue_home_sends_a_task():
    """``.delay(`` / ``.apply_async(`` / ``.send_task(`` only in workers/enqueue.py, which sends after commit."""
    assert (REPO / HOME).is_file() and SENDS.search((REPO / HOME).read_text())
    assert sends_outside_the_home(REPO) == [], "send through workers.enqueue.send_after_commit"


def test_the_reconciler_sends_through_the_hook_and_a_refused_send_is_raised_after_its_reason_is_kept(tmp_path):
    from kiln.settings import Settings
    from kiln.states import move_build_if_unchanged
    from tests.unit.workers.test_build_states import CPU, REPO as ROOT, Broker, add_worker, spec_of
    from workers.reconcile import reclaim_orphans
    from workers.submit import submit

    settings = Settings(home=tmp_path / "home", checkpoint_roots=f"{ROOT}:{tmp_path}")
    db.upgrade(settings.db_url)
    sessions = db.session_factory(settings.db_url)
    broker = Broker(sessions)
    made = submit(settings, sessions, spec_of(settings, CPU), broker).build
    add_worker(sessions, "gone", [made.queue], live=False)
    with sessions() as s:
        move_build_if_unchanged(s, s.get(Build, made.id), "running", worker="gone")
        s.commit()
    broker.down = True
    with pytest.raises(ConnectionError):  # the worker's heartbeat loop prints it, as before
        reclaim_orphans(sessions, broker)
    with sessions() as s:
        row = s.get(Build, made.id)
        assert row.status == "queued" and row.reason.startswith("not yet handed to the broker (ConnectionError")
    broker.down = False
    assert reclaim_orphans(sessions, broker) == []  # queued now: the lost message is requeue_lost's to resend
