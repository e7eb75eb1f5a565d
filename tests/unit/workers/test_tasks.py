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
