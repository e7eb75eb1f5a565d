"""Reading checkpoints, per source (builder/sources/): the I/O table covers every source kind of kiln/sources.py,
only a source a tracked model follows has a latest revision, and an s3:// checkpoint is read with the engine
store's client settings. (Each kind's identify and materialize: tests/unit/builder/test_resolve.py.)"""

from __future__ import annotations

import pytest

from builder.resolve import SOURCE_IO, latest_revision
from kiln.errors import SpecError
from kiln.sources import SOURCES, TRACKED


def test_every_source_kind_has_its_reading_and_nothing_else_does():
    assert set(SOURCE_IO) == set(SOURCES)
    assert all(callable(io.identify) for io in SOURCE_IO.values())


def test_only_the_tracked_source_has_a_latest_revision():
    assert [kind for kind, io in SOURCE_IO.items() if io.latest is not None] == [TRACKED.kind]


@pytest.mark.parametrize("kind", [k for k in SOURCES if k != TRACKED.kind])
def test_a_source_without_revisions_is_refused_before_any_read(kind, tmp_path):
    ref = SOURCES[kind].examples[0].format(root=tmp_path)
    with pytest.raises(SpecError) as err:
        latest_revision(ref, cache_root=tmp_path / "cache")
    assert err.value.field == "checkpoint" and err.value.fix == "give hf://org/name@branch"
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:9"])
def test_s3_checkpoints_are_read_with_the_stores_retry_and_addressing_settings(endpoint):
    from artifacts.s3 import make_s3_client
    from builder.sources.s3 import _client

    ours, store = _client(endpoint).meta.config, make_s3_client(endpoint).meta.config
    assert (ours.retries, ours.s3) == (store.retries, store.s3)
    assert ours.retries["mode"] == "standard"
    assert (ours.s3 or {}).get("addressing_style") == ("path" if endpoint else None)
