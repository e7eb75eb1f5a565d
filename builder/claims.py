"""One producer per stage output, whichever workers need it at once.

The builds of a matrix share their quantize output (its key has no target, profile or backend in it:
``kiln/keys.py``), and they may start together on several workers. Each would find no output, locally or in the
store, and run the same calibration. Before producing, a build therefore claims the stage key in the database
(``stage_claims``): the first insert wins; the others wait, looking for the output in the store (and on their
own disk) until it is there, or until the claim is gone — released by a holder that failed, or lapsed because
its holder died —, and then claim it themselves.

A claim lives :data:`CLAIM_TTL_S` and is renewed by a thread of its holder every third of that while it produces,
so a claim outlives a long stage but not a killed worker by more than the TTL.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import cast

from sqlalchemy import CursorResult, delete, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from kiln.tables import StageClaim

#: how long a claim lasts without renewal (its holder renews it every third of this)
CLAIM_TTL_S = 60.0


def _now() -> datetime:
    return datetime.now(timezone.utc)


class StageClaims:
    def __init__(self, sessions: sessionmaker[Session], *, ttl_s: float = CLAIM_TTL_S, holder: str | None = None):
        self.sessions, self.ttl_s = sessions, ttl_s
        self.holder = holder or f"claim-{uuid.uuid4().hex}"

    def try_claim(self, key: str) -> bool:
        """Claim ``key``: True if this holder now holds it (a fresh claim, or one whose holder lapsed)."""
        expires = _now() + timedelta(seconds=self.ttl_s)
        with self.sessions() as s:
            s.add(StageClaim(key=key, holder=self.holder, expires_at=expires))
            try:
                s.commit()
                return True
            except IntegrityError:
                s.rollback()
            result = s.execute(update(StageClaim).where(StageClaim.key == key, StageClaim.expires_at < _now())
                               .values(holder=self.holder, expires_at=expires)
                               .execution_options(synchronize_session=False))
            taken = cast(CursorResult, result).rowcount  # an UPDATE's result is a cursor result: it has a row count
            s.commit()
            return bool(taken)

    def release(self, key: str) -> None:
        with self.sessions() as s:
            s.execute(delete(StageClaim).where(StageClaim.key == key, StageClaim.holder == self.holder))
            s.commit()

    @contextmanager
    def renewing(self, key: str) -> Iterator[None]:
        """While the body runs, keep this holder's claim on ``key`` alive; release it afterwards."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.ttl_s / 3):
                with self.sessions() as s:
                    s.execute(update(StageClaim).where(StageClaim.key == key, StageClaim.holder == self.holder)
                              .values(expires_at=_now() + timedelta(seconds=self.ttl_s))
                              .execution_options(synchronize_session=False))
                    s.commit()

        thread = threading.Thread(target=renew, name=f"claim-{key[7:19]}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.release(key)
