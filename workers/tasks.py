"""Celery tasks: thin wrappers around workers.runner (which wraps the same Builder the CLI uses)."""

from __future__ import annotations

import os
import socket

from celery.signals import worker_process_init

from kiln.errors import StorageUnavailable
from kiln.settings import get_settings
from workers.celery_app import BUILD_TASK_OPTIONS, app, retry_delay_s
from workers.runner import run_build as run_build_row


def threads_per_build(cpus: int, concurrency: int) -> int:
    """torch's intra-op threads for each of a worker's ``concurrency`` pool processes: the cores shared out, at
    least one. torch's default (one thread per core in every process) makes concurrent builds spin against
    each other: two builds of the shipped model at once took as long as one after the other, 94 s, with the
    default, and 44 s — one build's time — with one thread each, on two cores (docs/performance.md)."""
    return max(1, cpus // max(1, concurrency))


@worker_process_init.connect
def _share_cores(**_) -> None:
    """A pool process of a worker started with ``--concurrency N`` (N > 1) takes its share of the cores, unless
    the operator set ``OMP_NUM_THREADS`` themselves."""
    concurrency = int(os.environ.get("KILN_WORKER_CONCURRENCY", "1") or 1)
    if concurrency > 1 and not os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(threads_per_build(os.cpu_count() or 1, concurrency))


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
