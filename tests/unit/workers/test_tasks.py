"""The build task's process set-up: each pool process of a worker running several builds at once takes its share
of the cores (torch's default of one thread per core in every process makes concurrent builds spin against each
other), and ``kiln worker`` refuses a concurrency below one before it registers anything."""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from workers.tasks import _share_cores, threads_per_build


@pytest.mark.parametrize("cpus, concurrency, threads", [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 3, 5), (8, 0, 8),
                                                        (1, 1, 1)])
def test_threads_per_build_share_the_cores(cpus, concurrency, threads):
    assert threads_per_build(cpus, concurrency) == threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("concurrency, omp, expected", [("2", None, max(1, (os.cpu_count() or 1) // 2)),
                                                        ("1", None, None), ("2", "3", None), (None, None, None)])
def test_a_pool_process_takes_its_share_unless_the_operator_chose(monkeypatch, threads, concurrency, omp, expected):
    torch.set_num_threads(7)  # a value neither branch would set
    for var, value in (("KILN_WORKER_CONCURRENCY", concurrency), ("OMP_NUM_THREADS", omp)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    _share_cores()
    assert torch.get_num_threads() == (expected if expected is not None else 7)


def test_kiln_worker_refuses_a_concurrency_below_one_in_one_line(tmp_path, monkeypatch):
    from api.cli import main

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(main, ["worker", "--concurrency", "0"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: concurrency:"), result.output
    assert not (tmp_path / "home" / "kiln.db").exists()  # nothing registered, nothing created


def test_the_celery_app_acks_late_limits_time_and_routes_the_embedded_broker(tmp_path):
    """The one Celery app's settings (workers/celery_app.py), per broker: what makes a killed worker's build
    come back (late acks, requeue on a lost worker, one message per process, Redis's visibility timeout past the
    hard limit) and what bounds a hung one."""
    from workers.celery_app import (BUILD_HARD_LIMIT_S, BUILD_SOFT_LIMIT_S, BUILD_TASK_OPTIONS, broker_url_for_celery,
                                    make_app)

    assert (BUILD_SOFT_LIMIT_S, BUILD_HARD_LIMIT_S) == (4 * 3600, 4 * 3600 + 300)
    assert BUILD_TASK_OPTIONS == {"acks_late": True, "reject_on_worker_lost": True, "max_retries": 5}
    assert broker_url_for_celery("sqla+sqlite:////srv/kiln/broker.db") == "kilnsqla+sqlite:////srv/kiln/broker.db"
    assert broker_url_for_celery("sqla+postgresql://db/kiln") == "sqla+postgresql://db/kiln"
    assert broker_url_for_celery("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    expected = {"task_acks_late": True, "task_reject_on_worker_lost": True, "worker_prefetch_multiplier": 1,
                "task_default_queue": "kiln.default", "task_ignore_result": True,
                "task_soft_time_limit": BUILD_SOFT_LIMIT_S, "task_time_limit": BUILD_HARD_LIMIT_S,
                "broker_connection_retry_on_startup": True, "worker_hijack_root_logger": False,
                "worker_proc_alive_timeout": 120.0}
    for broker in ("redis://127.0.0.1:6379/3", "rediss://cache:6380/0", f"sqla+sqlite:///{tmp_path / 'b.db'}"):
        app = make_app(broker)
        assert app.main == "kiln" and "workers.tasks" in app.conf.include
        assert {k: app.conf[k] for k in expected} == expected, broker
        assert app.conf.broker_url == broker_url_for_celery(broker)
        redis = broker.startswith("redis")
        assert app.conf.broker_transport_options == ({"visibility_timeout": BUILD_HARD_LIMIT_S + 600} if redis else {})
    default = make_app()  # no argument: the settings' broker (the embedded SQLite one here)
    assert default.conf.broker_url.startswith("kilnsqla+sqlite:")


def test_worker_name_is_the_configured_one_or_host_and_parent(monkeypatch):
    import socket

    from workers.tasks import worker_name

    monkeypatch.setenv("KILN_WORKER_NAME", "gpu-node-7")
    assert worker_name() == "gpu-node-7"
    monkeypatch.setenv("KILN_WORKER_NAME", "")
    assert worker_name() == f"{socket.gethostname()}-{os.getppid()}"
