"""The embedded default, ``kiln serve``: API and a worker on SQLite, a SQLite broker and the local store —
no servers — passing the same API checks as the distributed stack."""

from __future__ import annotations

import pytest

from tests.integration import api_checks
from tests.integration.stack import Stack, tiny_spec
from tests.integration.stack import served as embedded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with embedded(tmp_path_factory.mktemp("serve") / "kiln", {}) as s:
        yield s


def test_embedded_health_and_defaults(served):
    api_checks.health(served)
    assert (served.home / "kiln.db").is_file()


def test_embedded_build_end_to_end(served):
    done = api_checks.submit_follow_and_query(served, tiny_spec())
    blobs = list((served.home / "store").rglob("sha256/*"))
    assert any(done["digest"].endswith(p.name) for p in blobs)


def test_embedded_bad_requests(served):
    api_checks.bad_requests_are_4xx_with_json(served)
