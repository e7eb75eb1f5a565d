"""S3 faults during publish and pull — server errors, timeouts, truncated reads — injected between Kiln and a
real S3 server (moto over HTTP): writes and reads are retried with backoff and verified by digest; persistent
failure surfaces as StorageUnavailable with nothing half-written visible; corruption is refused and reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import boto3
import pytest
from botocore.config import Config

from artifacts.oci import push_engine_image, pull_image
from artifacts.s3 import S3BlobStore
from kiln.digests import sha256_bytes
from kiln.errors import DigestMismatch, StorageUnavailable
from tests.conftest import REPO
from tests.integration.faultproxy import FaultProxy


@pytest.fixture(scope="module")
def moto_port():
    from tests.s3server import moto_s3

    with moto_s3() as endpoint:
        yield int(endpoint.rsplit(":", 1)[1])


@pytest.fixture
def proxy(moto_port):
    p = FaultProxy(moto_port)
    yield p
    p.close()


@pytest.fixture
def store(proxy, moto_port):
    bucket = f"faults-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto_port}").create_bucket(Bucket=bucket)
    client = boto3.client("s3", endpoint_url=proxy.url, config=Config(
        retries={"mode": "standard", "max_attempts": 4}, read_timeout=2, connect_timeout=2,
        s3={"addressing_style": "path"}))
    return S3BlobStore(bucket, "engines", endpoint_url=proxy.url, client=client)


def test_publish_survives_server_errors(store, proxy):
    data = os.urandom(3 << 20)
    proxy.inject("PUT", "error", times=2, status=503)
    info = store.put_bytes(data)
    assert info.digest == sha256_bytes(data) and store.get_bytes(info.digest) == data
    assert [o for _, _, o in proxy.seen].count("error 503") == 2


def test_multipart_publish_survives_part_failures(store, proxy, tmp_path):
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(17 << 20))
    proxy.inject("PUT", "error", times=2, status=500)
    info = store.put_file(f)
    assert store.verify(info.digest)


def test_reads_survive_truncation_and_timeouts(store, proxy):
    data = os.urandom(1 << 20)
    digest = store.put_bytes(data).digest
    proxy.inject("GET", "truncate", times=1)
    assert store.get_bytes(digest) == data
    proxy.inject("GET", "slow", times=1, seconds=3)  # longer than the client's read timeout
    assert store.get_bytes(digest) == data
    outcomes = [o for _, _, o in proxy.seen]
    assert "truncated" in outcomes and "slow" in outcomes


def test_pull_of_an_engine_survives_a_truncated_layer(store, proxy, tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(os.urandom(2 << 20))
    (engine / "config.json").write_text(json.dumps({"version": "test"}))
    image = push_engine_image(store, engine, annotations={}, labels={})
    proxy.inject("GET", "truncate", times=1)
    pull_image(store, image.digest, tmp_path / "pulled")
    assert (tmp_path / "pulled" / "rank0.engine").read_bytes() == (engine / "rank0.engine").read_bytes()


def test_persistent_failure_is_storage_unavailable_and_leaves_nothing(store, proxy):
    data = os.urandom(4096)
    proxy.inject("PUT", "error", times=100, status=500)
    with pytest.raises(StorageUnavailable):
        store.put_bytes(data)
    proxy.clear()
    assert not store.exists(sha256_bytes(data))


def test_corrupted_blob_is_refused_on_read_and_reported_by_fsck(store, moto_port, tmp_path):
    data = os.urandom(8192)
    digest = store.put_bytes(data).digest
    raw = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{moto_port}")
    key = f"engines/blobs/sha256/{digest.split(':')[1]}"
    raw.put_object(Bucket=store.bucket, Key=key, Body=b"x" + data[1:])
    with pytest.raises(DigestMismatch):
        store.get_bytes(digest)
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home"), "KILN_STORE_URL": f"s3://{store.bucket}/engines",
           "KILN_S3_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}"}
    proc = subprocess.run([sys.executable, "-m", "api.cli", "fsck"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert f"corrupted {digest}" in proc.stdout
