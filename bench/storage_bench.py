"""Publish and pull throughput of a large engine through Kiln against raw boto3 on the same S3 server.

    python bench/storage_bench.py [--mib 256] [--rounds 3]

Kiln: ``push_engine_image`` (deterministic tar layer, digest, multipart upload verified against it, config,
manifest) on its own, and as a build's publish stage runs it (the layer surveyed for its digest beforehand, as
the build does beside validation's accuracy pass; the survey's time is printed, not counted), and
``pull_image`` (stream, hash, unpack, verify). Raw: ``boto3 upload_file`` / ``download_file``
of the same bytes with boto3's defaults. The S3 server is moto's, over HTTP on 127.0.0.1, in a process of its
own (as a real server would be: in the benchmark's process it would compete with the client under test for
the GIL). Raw and Kiln runs alternate, ``--rounds`` times each; the medians are compared."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def start_s3_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(100):
        try:
            httpx.get(endpoint, timeout=1)
            return proc, endpoint
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's S3 server did not start")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def empty(store) -> None:
    for digest in list(store.list_digests()):  # moto keeps every object in memory: start empty
        store.delete(digest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    import boto3

    from artifacts.oci import pull_image, push_engine_image, survey_engine_layer
    from artifacts.s3 import S3BlobStore

    server, endpoint = start_s3_server()
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        raw_up, raw_down, kiln_up, kiln_down, kiln_survey, kiln_up_ahead = [], [], [], [], [], []
        with tempfile.TemporaryDirectory() as d:
            engine = Path(d) / "engine"
            engine.mkdir()
            with open(engine / "rank0.engine", "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(1 << 20))
            for r in range(args.rounds):
                for run in ("raw", "kiln") if r % 2 == 0 else ("kiln", "raw"):  # alternate who goes first
                    if run == "raw":
                        raw_up.append(timed(lambda: client.upload_file(str(engine / "rank0.engine"), "bench", "raw")))
                        raw_down.append(timed(lambda: client.download_file("bench", "raw", str(Path(d) / "raw.bin"))))
                        client.delete_object(Bucket="bench", Key="raw")
                        (Path(d) / "raw.bin").unlink()
                        continue
                    store = S3BlobStore("bench", "kiln", endpoint_url=endpoint)
                    t = time.perf_counter()
                    image = push_engine_image(store, engine, annotations={}, labels={"round": str(r)})
                    kiln_up.append(time.perf_counter() - t)
                    kiln_down.append(timed(lambda: pull_image(store, image.digest, Path(d) / "pulled")))
                    shutil.rmtree(Path(d) / "pulled")
                    empty(store)
                    # as a build publishes: the layer surveyed beside validation, then the publish stage
                    t = time.perf_counter()
                    survey = survey_engine_layer(store, engine)
                    kiln_survey.append(time.perf_counter() - t)
                    kiln_up_ahead.append(timed(lambda: push_engine_image(store, engine, annotations={}, labels={
                        "round": str(r)}, layer_survey=survey)))
                    empty(store)
    finally:
        server.terminate()
        server.wait(10)
    mb = args.mib * (1 << 20) / 1e6
    ru, rd, ku, kd, ks, ka = (statistics.median(x) for x in (raw_up, raw_down, kiln_up, kiln_down, kiln_survey,
                                                               kiln_up_ahead))
    print(f"engine of {args.mib} MiB, {args.rounds} alternating rounds, medians (moto S3 server in its own process)")
    print(f"publish: kiln {mb / ku:7.1f} MB/s, raw boto3 upload_file   {mb / ru:7.1f} MB/s -> ratio {ru / ku:.2f} x raw"
          " (push_engine_image on its own: layer surveyed, then uploaded)")
    print(f"publish stage of a build: {mb / ka:7.1f} MB/s -> ratio {ru / ka:.2f} x raw (the layer surveyed beside "
          f"validation's accuracy pass beforehand: {ks:.2f}s, not counted)")
    print(f"pull:    kiln {mb / kd:7.1f} MB/s, raw boto3 download_file {mb / rd:7.1f} MB/s -> ratio {rd / kd:.2f} x raw")
    print("rounds (s): " + "; ".join(f"raw up {a:.2f} kiln up {b:.2f} (stage {g:.2f}) raw down {c:.2f} kiln down {e:.2f}"
                                     for a, b, g, c, e in zip(raw_up, kiln_up, kiln_up_ahead, raw_down, kiln_down)))


if __name__ == "__main__":
    main()
