"""The Celery application. Tasks are acknowledged late and rejected (requeued) when their worker process dies,
one build at a time per worker process, with time limits; the broker is Redis in production and a SQLite file
(``sqla+sqlite://``) in the embedded default."""

from __future__ import annotations

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla

from kiln.settings import get_settings

BUILD_SOFT_LIMIT_S = 4 * 3600
BUILD_HARD_LIMIT_S = BUILD_SOFT_LIMIT_S + 300
#: A build task retries only a storage error (kiln.errors.StorageUnavailable), this many times, after
#: ``retry_delay_s(n)`` seconds; on its last try the build fails with the storage error as its reason.
BUILD_MAX_RETRIES = 5
BUILD_TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": True, "max_retries": BUILD_MAX_RETRIES}


def retry_delay_s(retries: int) -> int:
    """Exponential backoff: 5, 10, 20, ... seconds, at most 300."""
    return min(300, 5 * 2 ** retries)



#: How often an idle worker asks the embedded SQLite broker for a message. kombu's SQLAlchemy transport waits a
#: second between polls, which a build submitted to an idle worker paid on average half of; one indexed SELECT
#: per queue every 50 ms costs the idle worker nothing measurable. (Redis is not polled: BRPOP blocks.)
EMBEDDED_BROKER_POLL_S = 0.05


class EmbeddedBrokerTransport(kombu_sqla.Transport):
    """kombu's SQLAlchemy transport polling every :data:`EMBEDDED_BROKER_POLL_S`. The interval cannot be set
    through Celery's ``broker_transport_options``: that transport hands every option to ``create_engine``."""

    polling_interval = EMBEDDED_BROKER_POLL_S


#: ``sqla+sqlite://`` URLs are served by :class:`EmbeddedBrokerTransport` (see :func:`broker_url_for_celery`)
TRANSPORT_ALIASES.setdefault("kilnsqla", f"{__name__}:EmbeddedBrokerTransport")


def broker_url_for_celery(broker: str) -> str:
    """The URL Celery gets: the embedded SQLite broker through :class:`EmbeddedBrokerTransport`; any other
    broker unchanged."""
    return "kilnsqla+" + broker.removeprefix("sqla+") if broker.startswith("sqla+sqlite:") else broker


def make_app(broker_url: str | None = None) -> Celery:
    broker = broker_url or get_settings().broker
    app = Celery("kiln", broker=broker_url_for_celery(broker), include=["workers.tasks"])
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="kiln.default",
        task_ignore_result=True,
        task_soft_time_limit=BUILD_SOFT_LIMIT_S,
        task_time_limit=BUILD_HARD_LIMIT_S,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # A pool process imports the quantizer as it starts (workers/tasks.py), seconds on a small machine;
        # Celery's default (4 s) would take that for a hung start and replace the process, over and over.
        worker_proc_alive_timeout=120.0,
    )
    if broker.startswith(("redis://", "rediss://")):
        # Redis redelivers an unacknowledged message after this long; builds are idempotent (state in the DB)
        app.conf.broker_transport_options = {"visibility_timeout": BUILD_HARD_LIMIT_S + 600}
    return app


app = make_app()
