"""Publish and pull throughput of a large engine through Kiln against raw boto3 on the same S3 server.

    python bench/storage_bench.py [--mib 256]

Kiln: ``push_engine_image`` (tar layer + multipart upload with the digest computed in the same pass + config +
manifest) and ``pull_image`` (stream, hash, unpack). Raw: ``boto3 upload_file`` / ``download_file`` of the same
bytes. The S3 server is moto over HTTP on 127.0.0.1 (same machine for both), so ratios, not absolute MB/s,
are the point."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    import boto3
    from moto.server import ThreadedMotoServer

    from artifacts.oci import pull_image, push_engine_image
    from artifacts.s3 import S3BlobStore

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    size = args.mib << 20
    with tempfile.TemporaryDirectory() as d:
        engine = Path(d) / "engine"
        engine.mkdir()
        with open(engine / "rank0.engine", "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        t = time.perf_counter()
        client.upload_file(str(engine / "rank0.engine"), "bench", "raw/rank0.engine")
        raw_up = time.perf_counter() - t
        t = time.perf_counter()
        client.download_file("bench", "raw/rank0.engine", str(Path(d) / "raw.bin"))
        raw_down = time.perf_counter() - t
        store = S3BlobStore("bench", "kiln", endpoint_url=endpoint)
        t = time.perf_counter()
        image = push_engine_image(store, engine, annotations={}, labels={})
        kiln_up = time.perf_counter() - t
        t = time.perf_counter()
        pull_image(store, image.digest, Path(d) / "pulled")
        kiln_down = time.perf_counter() - t
    server.stop()
    mb = size / 1e6
    print(f"engine of {args.mib} MiB")
    print(f"publish: kiln {mb / kiln_up:7.1f} MB/s, raw boto3 upload_file {mb / raw_up:7.1f} MB/s -> ratio {raw_up / kiln_up:.2f} x raw")
    print(f"pull:    kiln {mb / kiln_down:7.1f} MB/s, raw boto3 download_file {mb / raw_down:7.1f} MB/s -> ratio {raw_down / kiln_down:.2f} x raw")


if __name__ == "__main__":
    main()
