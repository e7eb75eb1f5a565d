"""Celery tasks: thin wrappers around workers.runner (which wraps the same Builder the CLI uses)."""

from __future__ import annotations

import os
import socket

from celery.signals import worker_process_init

from kiln.errors import StorageUnavailable
from kiln.settings import get_settings
from workers.celery_app import BUILD_TASK_OPTIONS, app, retry_delay_s
from workers.runner import run_build as run_build_row


@worker_process_init.connect
def _preload(**_) -> None:
    """Each pool process imports the quantizer when it starts (after the fork: nothing heavy is imported into the
    parent), so the first build a process runs is not seconds slower than the next."""
    from builder.quantize import preload

    preload()


def worker_name() -> str:
    return os.environ.get("KILN_WORKER_NAME") or f"{socket.gethostname()}-{os.getppid()}"


@app.task(name="kiln.run_build", bind=True, **BUILD_TASK_OPTIONS)
def run_build(self, build_id: str) -> str:
    """Retries only a storage error; the last try fails the build instead (``workers.runner.run_build``)."""
    last_try = self.request.retries >= self.max_retries
    try:
        return run_build_row(build_id, get_settings(), worker_name(), last_try=last_try)
    except StorageUnavailable as exc:
        raise self.retry(exc=exc, countdown=retry_delay_s(self.request.retries)) from None
