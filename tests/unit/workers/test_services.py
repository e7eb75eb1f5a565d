"""The services (sessions, store, bell, enqueue) are built from settings in one place, workers/services.py, which
the CLI, the API and the worker all use: built there from the settings they are given, and nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import text

from artifacts.local import LocalBlobStore
from kiln import db
from kiln.settings import Settings
from tests.scan import PRODUCT as SHIPPED, lines_outside
from workers.enqueue import celery_enqueue
from workers.services import build_services

REPO = Path(__file__).resolve().parents[3]
PRODUCT = [p for p in SHIPPED if p != "migrations"]
#: the calls that make a service; only workers/services.py makes them (their definitions aside)
MAKERS = re.compile(r"\b(open_store|session_factory|Bell)\(")
HOME = Path("workers/services.py")
DEFINITIONS = re.compile(r"^\s*(def|class) ")


def test_the_services_come_from_the_settings(tmp_path):
    settings = Settings(home=tmp_path / "home", store_url=f"file://{tmp_path / 'store'}")
    services = build_services(settings, upgrade_embedded=True)
    assert services.settings is settings and services.enqueue is celery_enqueue
    assert isinstance(services.store, LocalBlobStore) and services.store.url == (tmp_path / "store").as_uri()
    assert services.store is services.store  # opened once
    assert str(services.sessions.kw["bind"].url) == settings.db_url
    assert services.read_engine is db.get_engine(settings.db_url, autocommit=True)  # the autocommit engine
    assert services.bell.db_url == settings.db_url
    with services.sessions() as s:  # upgrade_embedded: the embedded database has its schema
        assert s.execute(text("SELECT count(*) FROM builds")).scalar() == 0
    recorded = []
    assert build_services(settings, enqueue=lambda *a: recorded.append(a)).enqueue is not celery_enqueue


def test_the_s3_store_reads_its_endpoint_from_the_settings_the_services_were_built_from(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    settings = Settings(home=tmp_path / "home", store_url="s3://bucket/engines", s3_endpoint_url="http://127.0.0.1:9")
    store = build_services(settings).store
    assert (type(store).__name__, store.url) == ("S3BlobStore", "s3://bucket/engines")
    assert store._client.meta.endpoint_url == "http://127.0.0.1:9"


def makers_outside_the_home(root: Path) -> list[str]:
    return lines_outside(root, HOME, MAKERS, unless=DEFINITIONS, packages=PRODUCT)


def test_no_module_but_workers_services_builds_a_service():
    """The CLI (api/cli_base.py), the API (api/app.py) and the worker (workers/runner.py, api/cli_service.py) take
    their store, sessions and bell from workers.services.build_services."""
    assert makers_outside_the_home(REPO) == [], "take it from workers.services.build_services"
