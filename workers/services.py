"""The services a Kiln process works with, built from its settings in one place: the database sessions, the
blob store, the bell that wakes event-stream readers, and the function that hands builds to the broker. The CLI
(``api/cli_base.py``), the API (``api/app.py``) and the worker (``workers/runner.py``, ``api/cli_service.py``)
each take them from :func:`build_services`, so they agree on how each one is made."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from artifacts.factory import open_store
from artifacts.interfaces import BlobStore
from kiln import db
from kiln.bell import Bell
from kiln.settings import Settings, get_settings
from workers.enqueue import Enqueue, celery_enqueue


class Services:
    """What :func:`build_services` builds. The sessions are made at once (cheap: the engine is the process's,
    ``kiln.db.get_engine``); the store, the autocommit read engine and sessions, and the bell when first asked for."""

    def __init__(self, settings: Settings, *, enqueue: Enqueue | None = None) -> None:
        self.settings = settings
        #: read-write sessions (each commit wakes the build's event-stream readers: ``kiln.bell.install``)
        self.sessions: sessionmaker[Session] = db.session_factory(settings.db_url)
        #: the broker's side of a send; call sites go through ``workers.enqueue.send_after_commit``
        self.enqueue: Enqueue = enqueue or celery_enqueue

    @cached_property
    def store(self) -> BlobStore:
        """The store ``KILN_STORE_URL`` names (``artifacts.factory.STORES``; each store reads its own settings)."""
        return open_store(self.settings.store, self.settings)

    @cached_property
    def read_engine(self) -> Engine:
        """The engine whose connections run each statement on its own (no BEGIN / ROLLBACK round trips)."""
        return db.get_engine(self.settings.db_url, autocommit=True)

    @cached_property
    def read_sessions(self) -> sessionmaker[Session]:
        """Sessions on :attr:`read_engine` (the API's hot reads)."""
        return sessionmaker(self.read_engine, expire_on_commit=False)

    @cached_property
    def bell(self) -> Bell:
        """Wakes this process's event-stream readers when a build's events commit (kiln/bell.py)."""
        return Bell(self.settings.db_url)


def build_services(settings: Settings | None = None, *, enqueue: Enqueue | None = None,
                   upgrade_embedded: bool = False) -> Services:
    """The services for ``settings`` (default: the environment's). ``upgrade_embedded``: bring an embedded
    (SQLite) database's schema up to date first, as local commands do; a server database is migrated by its
    operator. ``enqueue``: the broker's side of a send (tests record instead of sending)."""
    settings = settings or get_settings()
    if upgrade_embedded and settings.db_url.startswith("sqlite"):
        db.upgrade(settings.db_url)
    return Services(settings, enqueue=enqueue)
