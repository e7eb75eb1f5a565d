"""Celery tasks: thin wrappers around workers.runner (which wraps the same Builder the CLI uses)."""

from __future__ import annotations

import os
import socket

from celery.signals import worker_process_init

from kiln.errors import StorageUnavailable
from kiln.settings import get_settings
from workers.celery_app import app
from workers.runner import run_build as run_build_row


@worker_process_init.connect
def _preload(**_) -> None:
    """Each pool process imports the quantizer when it starts (after the fork: nothing heavy is imported into the
    parent), so the first build a process runs is not seconds slower than the next."""
    from builder.quantize import preload

    preload()


def worker_name() -> str:
    return os.environ.get("KILN_WORKER_NAME") or f"{socket.gethostname()}-{os.getppid()}"


@app.task(name="kiln.run_build", bind=True, acks_late=True, reject_on_worker_lost=True,
          autoretry_for=(StorageUnavailable,), retry_backoff=5, retry_backoff_max=300, max_retries=5)
def run_build(self, build_id: str) -> str:
    return run_build_row(build_id, get_settings(), worker_name())
