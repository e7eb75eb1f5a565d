"""Session services of the integration tests."""

from __future__ import annotations

import shutil

import pytest

from scripts.devstack import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """The suite's own ``redis-server`` on a free port (no persistence), stopped at the end of the session."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis") / "redis-server.log")
    yield server
    server.stop()
