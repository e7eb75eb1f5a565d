"""``kiln pull --server`` and its blob cache on two real fine-tunes: the shipped tiny Llama and a copy with every
weight perturbed are built (FP8, aot-inductor, cpu; the second reuses the first's kernel), served by a real
``kiln api`` process, and pulled one after the other. The bytes that cross the wire are counted by the HTTP client's
transport (every response body, as received), not by Kiln's own counter."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from scripts.devstack import Stack
from tests.integration.test_oci import tree
from tests.unit.builder.test_refit import TINY, perturbed_copy

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE = {"max_batch_size": 1, "max_input_len": 64, "max_seq_len": 64, "max_num_tokens": 64}
EVALUATION = {"seq_len": 64, "max_tokens": 2048, "sequential": False}
CALIBRATION = {"samples": 8, "seq_len": 64}
MiB = 1 << 20


class CountingTransport(httpx.HTTPTransport):
    """A real HTTP transport that counts the body bytes of every response, by URL path, as they arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, int] = defaultdict(int)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        inner, received, path = response.stream, self.received, request.url.path

        class Counted(httpx.SyncByteStream):
            def __iter__(self):
                for chunk in inner:  # type: ignore[union-attr]
                    received[path] += len(chunk)
                    yield chunk

            def close(self) -> None:
                inner.close()  # type: ignore[union-attr]

        response.stream = Counted()
        return response

    def total(self) -> int:
        return sum(self.received.values())

    def blob(self, digest: str) -> int:
        return sum(n for path, n in self.received.items() if path.endswith(f"/blobs/{digest}"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from artifacts.factory import open_store
    from artifacts.oci import read_manifest
    from builder.pipeline import Builder
    from kiln import db
    from kiln.settings import Settings
    from kiln.spec import parse_spec

    root = tmp_path_factory.mktemp("pullcache")
    home = root / "kiln"
    settings = Settings(home=home, checkpoint_roots=os.pathsep.join([str(REPO_ROOT), str(root)]))
    db.upgrade(settings.db_url)
    builder = Builder(settings, open_store(settings.store), db.session_factory(settings.db_url))

    def build(ckpt, name):
        spec = parse_spec({"checkpoint": str(ckpt), "precision": "fp8", "recipe": "fp8", "target": "cpu",
                           "backend": "aot-inductor", "model_name": name, "profile": PROFILE,
                           "evaluation": EVALUATION, "calibration": CALIBRATION,
                           "override_reason": "a test build: a short evaluation"}, settings.roots)
        outcome = builder.build(spec)
        assert outcome.status == "succeeded", outcome
        return outcome.digest, read_manifest(builder.store, outcome.digest)

    s = Stack(home, {})
    with pytest.MonkeyPatch.context() as mp:  # what the builder reads from settings of its own (its signing key)
        mp.setenv("KILN_HOME", str(home))
        s.base, s.base_manifest = build(TINY, "acme/tiny")
        s.tune, s.tune_manifest = build(perturbed_copy(root / "tiny-finetune"), "acme/tiny-finetune")
    pub = root / "kiln.pub"
    pub.write_text(s.kiln("keys", "public").stdout)
    s.pub = pub
    try:
        s.start_api()
        yield s
    finally:
        s.close()


def layers(manifest: dict) -> dict[str, dict]:
    return {d["annotations"]["org.opencontainers.image.title"]: d for d in manifest["layers"]}


def pull(served, ref: str, dest: Path, cache, **kw):
    from api.pull import pull_remote

    transport = CountingTransport()
    with httpx.Client(base_url=served.url, transport=transport, follow_redirects=True) as client:
        got = pull_remote(served.url, ref, dest, client=client, cache=cache, **kw)
    return got, transport


def test_a_finetune_pull_downloads_only_its_weights_and_engine_layers(served, tmp_path):
    from artifacts.blobcache import BlobCache
    from artifacts.verify import keys_from

    base, tune = layers(served.base_manifest), layers(served.tune_manifest)
    assert list(base) == list(tune) == ["kernel.tar", "weights.tar", "engine.tar"]
    assert base["kernel.tar"]["digest"] == tune["kernel.tar"]["digest"]  # one kernel, two fine-tunes
    assert base["weights.tar"]["digest"] != tune["weights.tar"]["digest"]
    kernel, weights = tune["kernel.tar"], tune["weights.tar"]
    print(f"layers of the fine-tune: {({t: d['size'] for t, d in tune.items()})}")
    assert kernel["size"] > MiB  # else the bound below could not tell a cached kernel from a downloaded one

    cache = BlobCache(tmp_path / "node-cache", 1 << 30)
    keys = keys_from(str(served.pub))
    first, wire1 = pull(served, f"acme/tiny@{served.base}", tmp_path / "base", cache, verify_keys=keys)
    assert first.cached == () and first.transferred == first.size
    assert all(wire1.blob(d["digest"]) == d["size"] for d in base.values())

    second, wire2 = pull(served, f"acme/tiny-finetune@{served.tune}", tmp_path / "tune", cache, verify_keys=keys)
    print(f"second pull: {wire2.total()} bytes over HTTP, weights layer {weights['size']}, kernel {kernel['size']}")
    # the done-when bound, counted at the HTTP level: every body of the second pull (manifests, config, referrers,
    # signatures and the layers it lacked) together
    assert wire2.total() < weights["size"] + MiB
    assert second.verified_key is not None and (tmp_path / "tune" / "model.sig").is_file()
    assert second.cached == (kernel["digest"],)
    assert wire2.blob(kernel["digest"]) == 0  # never asked for
    assert second.transferred == second.size - kernel["size"] == weights["size"] + tune["engine.tar"]["size"]

    # the same files as a pull that uses no cache at all
    plain, wire3 = pull(served, f"acme/tiny-finetune@{served.tune}", tmp_path / "plain", False, verify_keys=keys)
    assert plain.cached == () and plain.transferred == plain.size
    assert wire3.total() >= weights["size"] + MiB  # without the cache the bound does not hold: the kernel came too
    assert tree(tmp_path / "tune") == tree(tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "node-cache" / "blobs" / "sha256").iterdir()) == sorted(
        {d["digest"].split(":")[1] for d in [*base.values(), *tune.values()]})


def test_a_corrupted_cached_blob_is_downloaded_again_and_the_pull_verifies(served, tmp_path):
    from artifacts.blobcache import BlobCache
    from artifacts.verify import keys_from

    kernel = layers(served.tune_manifest)["kernel.tar"]
    cache = BlobCache(tmp_path / "node-cache", 1 << 30)
    pull(served, f"acme/tiny@{served.base}", tmp_path / "base", cache)
    blob = cache.path(kernel["digest"])
    damaged = bytearray(blob.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(damaged))
    got, wire = pull(served, f"acme/tiny-finetune@{served.tune}", tmp_path / "tune", cache,
                     verify_keys=keys_from(str(served.pub)))
    assert got.cached == () and got.verified_key is not None
    assert wire.blob(kernel["digest"]) == kernel["size"]
    assert "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest() == kernel["digest"]  # repaired


def test_two_concurrent_pulls_share_one_cache_without_corrupting_it(served, tmp_path):
    from artifacts.blobcache import BlobCache

    cache_root = tmp_path / "node-cache"
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = pull(served, f"acme/tiny-finetune@{served.tune}", tmp_path / name,
                                 BlobCache(cache_root, 1 << 30))[0]
        except BaseException as exc:  # reported below
            results[name] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    blobs = sorted((cache_root / "blobs" / "sha256").iterdir())
    assert len(blobs) == 3 and list((cache_root / "uploads").iterdir()) == []
    for b in blobs:
        assert hashlib.sha256(b.read_bytes()).hexdigest() == b.name


def test_the_cache_is_bounded_least_recently_used_first(served, tmp_path):
    from artifacts.blobcache import BlobCache

    base, tune = layers(served.base_manifest), layers(served.tune_manifest)
    # room for one engine: pulling the second evicts the first's own layers, the shared kernel stays (just used)
    budget = sum(d["size"] for d in tune.values())
    pull(served, f"acme/tiny@{served.base}", tmp_path / "base", BlobCache(tmp_path / "c", budget))
    got, _ = pull(served, f"acme/tiny-finetune@{served.tune}", tmp_path / "tune", BlobCache(tmp_path / "c", budget))
    assert got.cached == (tune["kernel.tar"]["digest"],)
    left = {"sha256:" + p.name for p in (tmp_path / "c" / "blobs" / "sha256").iterdir()}
    assert left == {d["digest"] for d in tune.values()}
    assert base["weights.tar"]["digest"] not in left
    # a budget smaller than a layer keeps nothing, and the pull still succeeds
    small, _ = pull(served, f"acme/tiny@{served.base}", tmp_path / "small", BlobCache(tmp_path / "s", 1024))
    assert small.transferred == small.size and list((tmp_path / "s" / "blobs" / "sha256").iterdir()) == []


def test_kiln_pull_server_says_what_the_cache_held(served, tmp_path):
    env_cache = tmp_path / "cli-cache"
    served.env["KILN_PULL_CACHE_DIR"] = str(env_cache)
    try:
        first = served.kiln("pull", f"acme/tiny@{served.base}", str(tmp_path / "base"), "--server", served.url)
        assert first.returncode == 0, first.stderr
        assert "already here" not in first.stdout and "transferred" in first.stdout
        second = served.kiln("pull", f"acme/tiny-finetune@{served.tune}", str(tmp_path / "tune"), "--server",
                             served.url, "--json")
        assert second.returncode == 0, second.stderr
        out = json.loads(second.stdout)
        kernel = layers(served.tune_manifest)["kernel.tar"]
        assert out["layers_cached"] == [kernel["digest"]] and out["layers"] == 3
        assert out["transferred"] == out["size"] - kernel["size"]
        line = served.kiln("pull", f"acme/tiny-finetune@{served.tune}", str(tmp_path / "again"), "--server",
                           served.url)
        assert line.returncode == 0, line.stderr
        assert "3 of 3 layers already here, 0 B transferred" in line.stdout, line.stdout
        assert len(list((env_cache / "blobs" / "sha256").iterdir())) == 5
        none = served.kiln("pull", f"acme/tiny-finetune@{served.tune}", str(tmp_path / "nocache"), "--server",
                           served.url, "--no-cache", "--json")
        assert none.returncode == 0, none.stderr
        assert json.loads(none.stdout)["layers_cached"] == []
        local = served.kiln("pull", f"acme/tiny@{served.base}", str(tmp_path / "local"), "--no-cache")
        assert local.returncode == 2 and "no_cache" in local.stderr and not (tmp_path / "local").exists()
    finally:
        served.env.pop("KILN_PULL_CACHE_DIR")
