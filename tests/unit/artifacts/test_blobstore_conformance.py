"""One conformance suite for every BlobStore backend (the ``backend`` fixture runs each test on every store
``artifacts.factory.STORES`` registers, opened from its URL: the local store, and S3 over HTTP), then a few checks
only one backend can make."""

from __future__ import annotations

import hashlib
import io
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artifacts import LocalBlobStore, open_store
from artifacts.factory import FIX, STORES, store_class
from artifacts.interfaces import BlobInfo, Survey
from kiln.errors import BlobUnknown, DigestMismatch, InvalidDigest, SpecError, StorageUnavailable
from kiln.settings import Settings

Backend = Any  # the harness in conftest.py (not importable: tests/ has no packages)

MiB = 1 << 20
ABSENT = "sha256:" + "0" * 64


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def big() -> bytes:
    """~17 MiB: three 8 MiB multipart parts on S3, the last one short."""
    return os.urandom(17 * MiB + 12345)


class FailingStream(io.RawIOBase):
    """Yields ``good`` bytes, then raises as a dropped client connection would."""

    def __init__(self, good: int) -> None:
        self.left = good

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        if self.left <= 0:
            raise ConnectionResetError("client went away")
        n = min(len(b), self.left)
        b[:n] = b"x" * n
        self.left -= n
        return n


# -- writing and reading -----------------------------------------------------------------------
def test_put_bytes_then_get_bytes_roundtrips(store):
    info = store.put_bytes(b"hello engine")
    assert info == BlobInfo(digest_of(b"hello engine"), 12)
    assert store.get_bytes(info.digest) == b"hello engine"


def test_put_file_put_stream_and_put_bytes_agree(store, tmp_path):
    data = os.urandom(3000)
    (tmp_path / "blob").write_bytes(data)
    infos = {store.put_file(tmp_path / "blob"), store.put_stream(io.BytesIO(data)), store.put_bytes(data)}
    assert infos == {BlobInfo(digest_of(data), 3000)}
    assert list(store.list_digests()) == [digest_of(data)]


def test_empty_blob(store):
    info = store.put_stream(io.BytesIO(b""))
    assert info == BlobInfo(digest_of(b""), 0)
    assert store.get_bytes(info.digest) == b""
    assert list(store.open_range(info.digest, 0, 10)) == []


@pytest.mark.parametrize("size", [5000, 17 * MiB + 12345])
@pytest.mark.parametrize("how", ["bytes", "file", "stream", "stream_expected", "source"])
def test_reput_is_idempotent_and_does_not_rewrite(backend: Backend, tmp_path, how, size, big):
    store, data = backend.store, big if size > 5000 else os.urandom(5000)
    (tmp_path / "blob").write_bytes(data)
    put = {
        "bytes": lambda: store.put_bytes(data),
        "file": lambda: store.put_file(tmp_path / "blob"),
        "stream": lambda: store.put_stream(io.BytesIO(data)),
        "stream_expected": lambda: store.put_stream(io.BytesIO(data), expected_digest=digest_of(data)),
        "source": lambda: store.put_source(lambda: io.BytesIO(data)),
    }[how]
    first = store.put_bytes(data)
    before = backend.fingerprint(first.digest)
    assert put() == first
    assert backend.fingerprint(first.digest) == before
    assert backend.leftovers() == []


@pytest.mark.parametrize("how", ["file", "stream", "source"])
def test_large_blob_roundtrips(store, tmp_path, big, how):
    (tmp_path / "big").write_bytes(big)
    info = {"file": lambda: store.put_file(tmp_path / "big"), "stream": lambda: store.put_stream(io.BytesIO(big)),
            "source": lambda: store.put_source(lambda: io.BytesIO(big))}[how]()
    assert info == BlobInfo(digest_of(big), len(big))
    assert store.stat(info.digest).size == len(big)
    assert store.get_bytes(info.digest) == big
    edge = 8 * MiB - 10  # a range across the first part boundary
    assert b"".join(store.open_range(info.digest, edge, 20)) == big[edge : edge + 20]
    assert store.verify(info.digest)


@pytest.mark.parametrize("where", [0, 8 * MiB + 5, 17 * MiB + 12000])  # first part, a middle part, the last
def test_a_source_that_changes_between_its_reads_stores_nothing(backend: Backend, big, where):
    for data, at in ((b"small source", 3), (big, where)):
        reads = []

        def open_source():
            reads.append(1)
            changed = bytearray(data)
            if len(reads) > 1:
                changed[at] ^= 0xFF  # the second read differs by one byte
            return io.BytesIO(bytes(changed))

        with pytest.raises(DigestMismatch):
            backend.store.put_source(open_source)
    assert list(backend.store.list_digests()) == []
    assert backend.leftovers() == []


def test_a_source_that_grows_between_its_reads_stores_nothing(backend: Backend, big):
    opened = []

    def open_source():
        opened.append(1)
        return io.BytesIO(big if len(opened) == 1 else big + b"more")

    with pytest.raises(DigestMismatch):
        backend.store.put_source(open_source)
    assert list(backend.store.list_digests()) == [] and backend.leftovers() == []


def test_a_survey_made_ahead_makes_the_upload_the_only_read(backend: Backend, big):
    for data in (b"small source", big):
        survey = backend.store.survey(lambda: io.BytesIO(data))
        assert (survey.digest, survey.size) == (digest_of(data), len(data))
        reads = []

        def open_source():
            reads.append(1)
            return io.BytesIO(data)

        assert backend.store.put_source(open_source, survey) == BlobInfo(digest_of(data), len(data))
        assert len(reads) == 1 and backend.store.get_bytes(digest_of(data)) == data
    assert backend.leftovers() == []


@pytest.mark.parametrize("where", [0, 8 * MiB + 5])
def test_a_source_changed_since_its_survey_is_stored_as_it_is_now(backend: Backend, big, where):
    for data, at in ((b"small source", 3), (big, where)):
        survey = backend.store.survey(lambda: io.BytesIO(data))
        changed = bytearray(data)
        changed[at] ^= 0xFF
        now = bytes(changed)
        assert backend.store.put_source(lambda: io.BytesIO(now), survey) == BlobInfo(digest_of(now), len(now))
        assert backend.store.get_bytes(digest_of(now)) == now
        with pytest.raises(BlobUnknown):
            backend.store.stat(digest_of(data))
    assert backend.leftovers() == []


def test_a_survey_without_part_checksums_still_stores_the_source(backend: Backend, big):
    """A survey another store made (digest and size only, no CRC32s at this store's part size)."""
    survey = Survey(digest_of(big), len(big))
    assert backend.store.put_source(lambda: io.BytesIO(big), survey) == BlobInfo(digest_of(big), len(big))
    assert backend.store.verify(digest_of(big)) and backend.leftovers() == []


def test_expected_digest_mismatch_stores_nothing(backend: Backend, big):
    for data in (b"small", big):
        with pytest.raises(DigestMismatch):
            backend.store.put_stream(io.BytesIO(data), expected_digest=digest_of(b"other"))
    assert list(backend.store.list_digests()) == []
    assert backend.leftovers() == []


@pytest.mark.parametrize("good", [1000, 20 * MiB], ids=["small", "multipart"])
def test_a_failing_stream_leaves_nothing_behind(backend: Backend, good):
    with pytest.raises(ConnectionResetError):  # the caller's error, untranslated
        backend.store.put_stream(FailingStream(good))
    if backend.name == "s3" and good > 16 * MiB:  # two parts went up before the failure
        assert backend.writes()["UploadPart"] == 2
    assert backend.leftovers() == []
    assert list(backend.store.list_digests()) == []


# -- ranges, stat, listing, delete ---------------------------------------------------------------
@pytest.mark.parametrize(
    "offset,length,want",
    [(0, None, slice(0, 100)), (10, 5, slice(10, 15)), (90, 50, slice(90, 100)), (99, None, slice(99, 100)),
     (100, None, slice(0, 0)), (150, 10, slice(0, 0)), (5, 0, slice(0, 0))],
)  # fmt: skip
def test_open_range(store, offset, length, want):
    data = bytes(range(100))
    digest = store.put_bytes(data).digest
    assert b"".join(store.open_range(digest, offset, length)) == data[want]


def test_open_range_refuses_negative_values(store):
    digest = store.put_bytes(b"abc").digest
    for offset, length in [(-1, None), (0, -1)]:
        with pytest.raises(ValueError):
            store.open_range(digest, offset, length)


def test_stat_exists_list_and_delete(store):
    blobs = [store.put_bytes(bytes([i]) * (i + 1)) for i in range(3)]
    assert list(store.list_digests()) == sorted(b.digest for b in blobs)
    assert all(store.exists(b.digest) and store.stat(b.digest) == b for b in blobs)
    store.delete(blobs[0].digest)
    store.delete(blobs[0].digest)  # idempotent
    assert not store.exists(blobs[0].digest)
    assert list(store.list_digests()) == sorted(b.digest for b in blobs[1:])


def test_absent_blob_is_unknown(store):
    assert not store.exists(ABSENT)
    for call in (store.stat, store.get_bytes, store.open_range, store.verify):
        with pytest.raises(BlobUnknown):
            call(ABSENT)
    store.delete(ABSENT)


@pytest.mark.parametrize("bad", ["", "sha256:abc", "md5:" + "0" * 32, "sha256:" + "A" * 64, "../../etc/passwd"])
def test_bad_digests_are_refused(store, bad):
    calls = [store.stat, store.exists, store.get_bytes, store.open_range, store.delete, store.verify,
             store.presigned_url, lambda d: store.put_stream(io.BytesIO(b"x"), expected_digest=d)]  # fmt: skip
    for call in calls:
        with pytest.raises(InvalidDigest):
            call(bad)


# -- integrity --------------------------------------------------------------------------------------
def test_corruption_is_detected(backend: Backend):
    store = backend.store
    digest = store.put_bytes(b"the real engine").digest
    assert store.verify(digest)
    backend.corrupt(digest, b"the evil engine")
    assert not store.verify(digest)
    with pytest.raises(DigestMismatch, match=digest):
        store.get_bytes(digest)
    assert b"".join(store.open_range(digest)) == b"the evil engine"  # ranges are the client's to verify


# -- backend specifics ------------------------------------------------------------------------------
s3_only = pytest.mark.parametrize("backend", ["s3"], indirect=True)
local_only = pytest.mark.parametrize("backend", ["file"], indirect=True)


@s3_only
def test_s3_reput_of_a_known_digest_sends_no_bytes(backend: Backend, tmp_path, big):
    (tmp_path / "big").write_bytes(big)
    backend.store.put_file(tmp_path / "big")
    backend.store.put_bytes(b"small")
    backend.calls.clear()
    backend.store.put_file(tmp_path / "big")
    backend.store.put_bytes(b"small")
    backend.store.put_stream(io.BytesIO(big), expected_digest=digest_of(big))
    assert backend.writes() == {}


@s3_only
def test_s3_large_file_goes_straight_to_its_key_in_8_mib_parts(backend: Backend, tmp_path, big):
    (tmp_path / "big").write_bytes(big)
    info = backend.store.put_file(tmp_path / "big")
    assert backend.writes() == {"CreateMultipartUpload": 1, "UploadPart": 3, "CompleteMultipartUpload": 1}
    assert {key for _, key in backend.calls if key} == {f"engines/test/blobs/sha256/{info.digest[7:]}"}


@s3_only
def test_s3_large_stream_is_staged_then_copied(backend: Backend, big):
    info = backend.store.put_stream(io.BytesIO(big))
    writes = backend.writes()
    assert writes["UploadPart"] == 3 and writes["CopyObject"] == 1
    assert backend.leftovers() == []
    backend.calls.clear()
    assert backend.store.put_stream(io.BytesIO(big)) == info  # hashed, found, aborted: no copy
    assert "CopyObject" not in backend.writes() and "CompleteMultipartUpload" not in backend.writes()
    assert backend.leftovers() == []


@s3_only
def test_s3_copies_part_by_part_above_the_copy_limit(backend: Backend, big):
    store = backend.store
    store.copy_limit = store.copy_part_size = 8 * MiB  # instead of 5 GiB and 512 MiB
    info = store.put_stream(io.BytesIO(big))
    assert backend.writes()["UploadPartCopy"] == 3
    assert store.get_bytes(info.digest) == big
    assert backend.leftovers() == []


def test_s3_checksum_failure_is_a_digest_mismatch():
    """botocore checks S3's stored checksum on GET; its failure means corrupted bytes, not an outage.
    (moto cannot be made to store a wrong checksum, so the translation is checked directly.)"""
    from botocore.exceptions import FlexibleChecksumError

    from artifacts.s3 import s3_errors

    with pytest.raises(DigestMismatch):
        with s3_errors(f"read {ABSENT}", ABSENT):
            raise FlexibleChecksumError(error_msg="Expected checksum x did not match calculated checksum: y")


@s3_only
def test_s3_presigned_url_serves_the_blob(backend: Backend):
    import urllib.request

    digest = backend.store.put_bytes(b"presigned").digest
    url = backend.store.presigned_url(digest, expires_s=60)
    with urllib.request.urlopen(url) as answer:
        assert answer.read() == b"presigned"


def test_s3_unreachable_or_missing_bucket_is_storage_unavailable(s3_endpoint):
    from artifacts.s3 import S3BlobStore, make_s3_client

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    down = S3BlobStore("kiln", client=make_s3_client(dead, max_attempts=1))
    no_bucket = S3BlobStore("no-such-bucket", client=make_s3_client(s3_endpoint, max_attempts=1))
    calls = [lambda: down.put_bytes(b"x"), lambda: down.stat(ABSENT), lambda: list(down.list_digests()),
             lambda: no_bucket.put_bytes(b"x"), lambda: list(no_bucket.list_digests())]  # fmt: skip
    # (A HEAD on a missing bucket is a bare 404, so stat() there can only say BlobUnknown.)
    for call in calls:
        with pytest.raises(StorageUnavailable) as caught:
            call()
        assert caught.value.__suppress_context__  # raised "from None": no botocore above artifacts


@local_only
def test_local_blobs_are_read_only_and_not_presigned(backend: Backend):
    digest = backend.store.put_bytes(b"x").digest
    path = Path(backend.store.root) / "blobs" / "sha256" / digest[7:]
    assert path.stat().st_mode & 0o777 == 0o444
    assert backend.store.presigned_url(digest) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=4096))
def test_local_roundtrip_property(tmp_path_factory, data):
    store = LocalBlobStore(tmp_path_factory.getbasetemp() / "property-store")
    info = store.put_bytes(data)
    assert info == BlobInfo(digest_of(data), len(data))
    assert store.get_bytes(info.digest) == data
    assert b"".join(store.open_range(info.digest, len(data) // 3)) == data[len(data) // 3 :]


# -- factory --------------------------------------------------------------------------------------
def test_every_registered_scheme_opens_its_own_class_from_its_url(backend: Backend):
    """The store the harness opened from its URL is its scheme's class, and its URL opens it again."""
    scheme = backend.name
    assert type(backend.store) is store_class(scheme)
    assert backend.store.url.startswith(f"{scheme}://")
    assert type(open_store(backend.store.url, backend.settings)) is store_class(scheme)


def test_open_store_picks_the_backend(tmp_path, s3_endpoint):
    assert open_store(tmp_path.as_uri()).url == tmp_path.as_uri()
    assert open_store(str(tmp_path / "plain")).url == (tmp_path / "plain").as_uri()
    s3 = open_store("s3://bucket/some/prefix/", Settings(s3_endpoint_url=s3_endpoint))
    assert (type(s3).__name__, s3.url) == ("S3BlobStore", "s3://bucket/some/prefix")
    assert s3._client.meta.endpoint_url == s3_endpoint  # the store read its endpoint from the settings


def test_the_s3_store_reads_its_endpoint_from_the_environment_when_given_no_settings(monkeypatch, s3_endpoint):
    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", s3_endpoint)
    assert open_store("s3://bucket/x")._client.meta.endpoint_url == s3_endpoint


@pytest.mark.parametrize("url, message", [
    ("", "the store URL is empty"), ("gs://bucket/x", "unsupported store URL scheme 'gs'"),
    ("s3://", "'s3://' does not name a bucket"), ("s3://bucket/x?versionId=1", "does not name a bucket"),
    ("file://host/path", "'file://host/path' is not a local absolute path"),
    ("file:relative", "'file:relative' is not a local absolute path"),
])
def test_open_store_refuses_other_urls(url, message):
    with pytest.raises(SpecError) as caught:
        open_store(url)
    assert message in caught.value.message
    assert caught.value.field == "store_url"
    assert caught.value.fix == "use file:///absolute/path, a plain directory path, or s3://bucket/prefix"


def test_the_fix_names_every_registered_form():
    assert FIX.startswith("use ") and all(row.forms in FIX for row in STORES.values())
