"""workers/replication.replicate: a failed copy to KILN_REPLICATE_TO is recorded as the build's event, never raised."""

from __future__ import annotations

from sqlalchemy import select

from kiln import db
from kiln.settings import Settings
from kiln.tables import Build, BuildEvent
from workers.replication import replicate


def test_an_engine_gone_before_its_copy_is_a_recorded_failure_naming_why(tmp_path):
    # the engine's row is read when the copy starts: one revoked and collected since the build published it is
    # a domain error on the build's record (artifact_unknown), not a crash reported as an internal error
    settings = Settings(home=tmp_path / "home", replicate_to="127.0.0.1:9/kiln")
    db.upgrade(settings.db_url)
    sessions = db.session_factory(settings.db_url)
    with sessions() as s:
        s.add(Build(id="b" * 32, request_key="r", active_key=None, spec={}, queue="q", status="running", stages=[],
                    attempts=1, cancel_requested=False))
        s.commit()
    gone = "sha256:" + "e" * 64
    data = replicate(settings, None, sessions, "b" * 32, gone)
    assert data is not None and data["error"]["code"] == "artifact_unknown" and gone in data["error"]["message"]
    with sessions() as s:
        kinds = [e.kind for e in s.scalars(select(BuildEvent).where(BuildEvent.build_id == "b" * 32))]
    assert kinds == ["replication_failed"]
