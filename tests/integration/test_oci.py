"""The /v2 registry API over real HTTP: engines built by the real CLI into a KILN_HOME, served by a real
``kiln api`` process (uvicorn, SQLite, local store), pulled by a real OCI client written by others (skopeo) and by
``kiln pull --server``, every byte checked here against its digest."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import sqlite3
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest

from artifacts import paths
from artifacts.oci import MEDIA_TYPE_IMAGE_MANIFEST
from artifacts.tarball import unpack_tar
from scripts.devstack import Stack

pytestmark = pytest.mark.slow

REPO = "acme/tiny"
TAG = "fp8-cpu-latency-checkpoint"
BUILD = ["build", "examples/tiny-llama", "--backend", "checkpoint", "--calib-samples", "8", "--calib-seq-len", "64",
         "--eval-max-tokens", "1024",
         "--override-reason", "a test build: a short evaluation", "--model-name", REPO, "--json"]
SKOPEO = shutil.which("skopeo")
needs_skopeo = pytest.mark.skipif(SKOPEO is None, reason="skopeo is not installed (apt-get install -y skopeo); "
                                                          "the same checks run over raw HTTP below")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("oci") / "kiln", {})
    for var in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORE_URL"):
        s.env.pop(var, None)
    ok = s.kiln(*BUILD)
    assert ok.returncode == 0, ok.stderr
    s.digest = json.loads(ok.stdout.strip().splitlines()[-1])["digest"]
    bad = s.kiln(*BUILD, "--profile", "balanced", "--gate", "min_top1_agreement=1.5")
    assert bad.returncode == 1, bad.stderr
    s.rejected = json.loads(bad.stdout.strip().splitlines()[-1])["digest"]
    local = s.kiln("pull", f"{REPO}@{s.digest}", str(s.home.parent / "local-pull"))
    assert local.returncode == 0, local.stderr
    s.signed_tree = tree(s.home.parent / "local-pull")  # the engine files and their signature, model.sig
    s.engine_tree = {k: v for k, v in s.signed_tree.items() if k != "model.sig"}  # what the layer holds
    try:
        s.start_api()
        s.host = s.url.removeprefix("http://")
        yield s
    finally:
        s.close()


def skopeo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SKOPEO, "--insecure-policy", *args], capture_output=True, text=True, timeout=120)


def manifest_of(reg) -> dict:
    return httpx.get(f"{reg.url}/v2/{REPO}/manifests/{reg.digest}").json()


def check_layout(layout: Path) -> dict:
    """Every blob of an OCI image layout hashes to its name; returns the one image manifest it holds."""
    assert json.loads((layout / "oci-layout").read_text())["imageLayoutVersion"] == "1.0.0"
    blobs = sorted((layout / "blobs" / "sha256").iterdir())
    assert blobs
    for blob in blobs:
        assert sha_file(blob) == f"sha256:{blob.name}", blob
    [entry] = json.loads((layout / "index.json").read_text())["manifests"]
    manifest_path = layout / "blobs" / "sha256" / entry["digest"].split(":")[1]
    assert manifest_path.stat().st_size == entry["size"]
    data = manifest_path.read_bytes()
    return {"digest": entry["digest"], "manifest": json.loads(data), "bytes": data}


def unpack_layer(path: Path, dest: Path, gzipped: bool = False) -> Path:
    dest.mkdir()
    with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as f:
        unpack_tar(f, dest)
    return dest


# -- a real OCI client -----------------------------------------------------------------------------------------
@needs_skopeo
def test_skopeo_inspect_raw_by_digest_gets_the_exact_manifest(reg):
    r = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{reg.host}/{REPO}@{reg.digest}")
    assert r.returncode == 0, r.stderr
    assert sha(r.stdout.encode()) == reg.digest


@needs_skopeo
def test_skopeo_copies_by_digest_byte_for_byte(reg, tmp_path):
    layout = tmp_path / "layout"
    r = skopeo("copy", "--preserve-digests", "--dest-oci-accept-uncompressed-layers", "--src-tls-verify=false",
               f"docker://{reg.host}/{REPO}@{reg.digest}", f"oci:{layout}:engine")
    assert r.returncode == 0, r.stderr
    got = check_layout(layout)
    assert got["digest"] == reg.digest and sha(got["bytes"]) == reg.digest
    [layer] = got["manifest"]["layers"]
    engine = unpack_layer(layout / "blobs" / "sha256" / layer["digest"].split(":")[1], tmp_path / "engine")
    assert tree(engine) == reg.engine_tree and "config.json" in reg.engine_tree


@needs_skopeo
def test_skopeo_copies_by_tag_recompressing_the_same_content(reg, tmp_path):
    layout = tmp_path / "layout"
    r = skopeo("copy", "--src-tls-verify=false", f"docker://{reg.host}/{REPO}:{TAG}", f"oci:{layout}:engine")
    assert r.returncode == 0, r.stderr
    got = check_layout(layout)  # skopeo gzips the layer for an OCI layout, so the manifest is its own
    [layer] = got["manifest"]["layers"]
    assert layer["mediaType"].endswith("tar+gzip")
    config = json.loads((layout / "blobs" / "sha256" / got["manifest"]["config"]["digest"].split(":")[1]).read_bytes())
    blob = layout / "blobs" / "sha256" / layer["digest"].split(":")[1]
    with gzip.open(blob, "rb") as f:
        assert sha(f.read()) == config["rootfs"]["diff_ids"][0] == manifest_of(reg)["layers"][0]["digest"]
    assert tree(unpack_layer(blob, tmp_path / "engine", gzipped=True)) == reg.engine_tree


@needs_skopeo
def test_skopeo_sees_tags_labels_and_refuses_a_rejected_engine(reg):
    r = skopeo("inspect", "--tls-verify=false", f"docker://{reg.host}/{REPO}:{TAG}")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["Digest"] == reg.digest and TAG in info["RepoTags"]
    assert info["Labels"]["dev.kiln.validation.passed"] == "true"
    tags = skopeo("list-tags", "--tls-verify=false", f"docker://{reg.host}/{REPO}")
    assert tags.returncode == 0 and json.loads(tags.stdout)["Tags"] == [TAG]
    no = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{reg.host}/{REPO}@{reg.rejected}")
    assert no.returncode != 0 and "rejected" in no.stderr


# -- the same API over raw HTTP ---------------------------------------------------------------------------------
def test_raw_http_pull_by_digest_and_tag(reg, tmp_path):
    base = f"{reg.url}/v2"
    root = httpx.get(f"{base}/")
    assert root.status_code == 200 and root.json() == {}
    assert root.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    m = httpx.get(f"{base}/{REPO}/manifests/{reg.digest}")
    assert m.status_code == 200 and sha(m.content) == reg.digest
    assert m.headers["Content-Type"] == "application/vnd.oci.image.manifest.v1+json"
    assert m.headers["Docker-Content-Digest"] == reg.digest and m.headers["Kiln-Engine-Status"] == "fresh"
    by_tag = httpx.get(f"{base}/{REPO}/manifests/{TAG}")
    assert by_tag.content == m.content
    head = httpx.head(f"{base}/{REPO}/manifests/{TAG}")
    assert head.status_code == 200 and head.headers["Content-Length"] == str(len(m.content)) and head.content == b""
    manifest = m.json()
    for desc in [manifest["config"], *manifest["layers"]]:
        b = httpx.get(f"{base}/{REPO}/blobs/{desc['digest']}")
        assert b.status_code == 200 and sha(b.content) == desc["digest"] and len(b.content) == desc["size"]
    layer = httpx.get(f"{base}/{REPO}/blobs/{manifest['layers'][0]['digest']}").content
    (tmp_path / "layer.tar").write_bytes(layer)
    with tarfile.open(tmp_path / "layer.tar") as tar:
        assert "config.json" in tar.getnames()
    assert tree(unpack_layer(tmp_path / "layer.tar", tmp_path / "engine")) == reg.engine_tree


def test_raw_http_ranges_and_head(reg):
    desc = manifest_of(reg)["layers"][0]
    url, size = f"{reg.url}/v2/{REPO}/blobs/{desc['digest']}", desc["size"]
    whole = httpx.get(url).content
    # a client resuming a download: three ranges put back together are the blob
    ranges = ("bytes=0-999", f"bytes=1000-{size // 2}", f"bytes={size // 2 + 1}-")
    parts = [httpx.get(url, headers={"Range": r}) for r in ranges]
    assert [p.status_code for p in parts] == [206, 206, 206]
    assert sha(b"".join(p.content for p in parts)) == desc["digest"]
    assert parts[0].headers["Content-Range"] == f"bytes 0-999/{size}" and parts[0].headers["Content-Length"] == "1000"
    assert httpx.get(url, headers={"Range": "bytes=-16"}).content == whole[-16:]
    unsat = httpx.get(url, headers={"Range": f"bytes={size}-"})
    assert unsat.status_code == 416 and unsat.headers["Content-Range"] == f"bytes */{size}"
    assert unsat.json()["errors"][0]["code"] == "UNSUPPORTED"  # a spec code (there is no RANGE_INVALID)
    huge = httpx.get(url, headers={"Range": "bytes=" + "1" * 5000 + "-"})  # no range this server serves: ignored
    assert huge.status_code == 200 and huge.content == whole
    head = httpx.head(url)
    assert head.status_code == 200 and head.headers["Content-Length"] == str(size) and head.content == b""
    assert head.headers["Accept-Ranges"] == "bytes" and head.headers["Docker-Content-Digest"] == desc["digest"]


def test_raw_http_referrers_tags_catalog(reg):
    base = f"{reg.url}/v2"
    idx = httpx.get(f"{base}/{REPO}/referrers/{reg.digest}")
    assert idx.status_code == 200 and idx.headers["Content-Type"] == "application/vnd.oci.image.index.v1+json"
    [ref] = [m for m in idx.json()["manifests"] if m["artifactType"] == "application/vnd.kiln.provenance.v1+json"]
    assert ref["artifactType"] == "application/vnd.kiln.provenance.v1+json"
    assert "dev.kiln.build-key" in ref["annotations"]
    body = httpx.get(f"{base}/{REPO}/manifests/{ref['digest']}")
    assert sha(body.content) == ref["digest"] and len(body.content) == ref["size"]
    assert body.json()["subject"]["digest"] == reg.digest
    payload = httpx.get(f"{base}/{REPO}/blobs/{body.json()['layers'][0]['digest']}").json()
    assert payload["validation"]["passed"] is True
    filtered = httpx.get(f"{base}/{REPO}/referrers/{reg.digest}", params={"artifactType": "application/x-none"})
    assert filtered.json()["manifests"] == [] and filtered.headers["OCI-Filters-Applied"] == "artifactType"
    assert httpx.get(f"{base}/{REPO}/tags/list").json() == {"name": REPO, "tags": [TAG]}
    assert httpx.get(f"{base}/_catalog").json() == {"repositories": [REPO]}


def test_raw_http_errors(reg):
    base = f"{reg.url}/v2"
    cases = [(f"{REPO}/manifests/sha256:{'0' * 64}", 404, "MANIFEST_UNKNOWN"),
             (f"{REPO}/manifests/no-such-tag", 404, "MANIFEST_UNKNOWN"),
             (f"{REPO}/manifests/sha256:bad", 400, "DIGEST_INVALID"),
             (f"{REPO}/blobs/sha256:{'0' * 64}", 404, "BLOB_UNKNOWN"),
             (f"Acme/Tiny/manifests/{TAG}", 400, "NAME_INVALID"),
             (f"acme/unknown/manifests/{TAG}", 404, "NAME_UNKNOWN"),
             (f"{REPO}/manifests/{reg.rejected}", 404, "MANIFEST_UNKNOWN"),
             # the distribution spec's error codes only (no TAG_INVALID, PAGINATION_NUMBER_INVALID)
             (f"{REPO}/manifests/-bad-tag", 404, "MANIFEST_UNKNOWN"),
             (f"{REPO}/tags/list?n=x", 400, "UNSUPPORTED"),
             (f"{REPO}/tags/list?n=%C2%B2", 400, "UNSUPPORTED")]
    for path, status, code in cases:
        r = httpx.get(f"{base}/{path}")
        assert r.status_code == status, (path, r.text)
        [err] = r.json()["errors"]
        assert err["code"] == code, (path, err)
    assert "rejected" in httpx.get(f"{base}/{REPO}/manifests/{reg.rejected}").json()["errors"][0]["message"]
    push = httpx.post(f"{base}/{REPO}/blobs/uploads/")
    assert push.status_code == 405 and push.json()["errors"][0]["code"] == "UNSUPPORTED"


# -- kiln pull --server ------------------------------------------------------------------------------------------
def test_oras_pull_writes_the_titled_layer_and_referrer_payloads(reg, tmp_path):
    """oras (oras-py, the `oras` package) writes each layer to the file its org.opencontainers.image.title names:
    the engine layer as engine.tar (a plain tar: oras unpacks only gzip "directory" layers), a referrer's payload
    under its own name."""
    oras_client = pytest.importorskip("oras.client", reason="oras-py is not installed (pip install oras)")
    client = oras_client.OrasClient(hostname=reg.host, insecure=True)
    [layer] = manifest_of(reg)["layers"]
    assert layer["annotations"] == {"org.opencontainers.image.title": "engine.tar"}
    files = client.pull(target=f"{reg.host}/{REPO}@{reg.digest}", outdir=str(tmp_path / "oras"))
    assert files == [str(tmp_path / "oras" / "engine.tar")]
    assert sha_file(tmp_path / "oras" / "engine.tar") == layer["digest"]
    engine = unpack_layer(tmp_path / "oras" / "engine.tar", tmp_path / "engine")
    assert tree(engine) == reg.engine_tree and ".complete" not in tree(engine)
    index = httpx.get(f"{reg.url}/v2/{REPO}/referrers/{reg.digest}").json()
    titles = {}
    for ref in index["manifests"]:
        out = tmp_path / ref["digest"].split(":")[1]
        [got] = client.pull(target=f"{reg.host}/{REPO}@{ref['digest']}", outdir=str(out))
        titles[ref["artifactType"]] = Path(got).name
    assert titles == {"application/vnd.kiln.provenance.v1+json": "provenance.json",
                      "application/vnd.kiln.validation-report.v1+json": "report.json",
                      "application/vnd.dev.sigstore.bundle.v0.3+json": "model.sig",
                      "application/vnd.in-toto+json": "provenance.dsse.json"}


def test_kiln_pull_from_a_server(reg, tmp_path):
    dest = tmp_path / "pulled"
    r = reg.kiln("pull", f"{REPO}@{reg.digest}", str(dest), "--server", reg.url)
    assert r.returncode == 0, r.stderr
    assert tree(dest) == reg.signed_tree and "warning" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pulled"]
    again = reg.kiln("pull", f"{REPO}@{reg.digest}", str(dest), "--server", reg.url)  # a rerun: the same engine
    assert again.returncode == 0 and "nothing rewritten" in again.stdout and tree(dest) == reg.signed_tree
    (dest / "extra.txt").write_text("not the engine's")
    other = reg.kiln("pull", f"{REPO}@{reg.digest}", str(dest), "--server", reg.url)
    assert other.returncode == 2 and "dest" in other.stderr
    rejected = reg.kiln("pull", f"{REPO}@{reg.rejected}", str(tmp_path / "rej"), "--server", reg.url)
    assert rejected.returncode == 2 and "rejected" in rejected.stderr and not (tmp_path / "rej").exists()


def test_the_same_build_for_another_repository_is_pulled_under_its_name(reg, tmp_path):
    """A build for a second repository whose BuildKey the first's engine has: the same bytes under the second
    name — its tag, by digest, to skopeo and ``kiln pull`` — and no second engine."""
    other = "other/tiny"
    r = reg.kiln(*[a if a != REPO else other for a in BUILD])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["digest"] == reg.digest and out["cache_hit"] is True
    by_tag = httpx.get(f"{reg.url}/v2/{other}/manifests/{TAG}", headers={"Accept": MEDIA_TYPE_IMAGE_MANIFEST})
    assert by_tag.status_code == 200 and by_tag.headers["Docker-Content-Digest"] == reg.digest
    assert TAG in httpx.get(f"{reg.url}/v2/{other}/tags/list").json()["tags"]
    dest = tmp_path / "pulled"
    pulled = reg.kiln("pull", f"{other}@{reg.digest}", str(dest), "--server", reg.url)
    assert pulled.returncode == 0, pulled.stderr
    assert tree(dest) == reg.signed_tree
    if SKOPEO:
        copied = skopeo("copy", "--preserve-digests", "--dest-oci-accept-uncompressed-layers", "--src-tls-verify=false",
                        f"docker://{reg.host}/{other}@{reg.digest}", f"oci:{tmp_path / 'layout'}:engine")
        assert copied.returncode == 0, copied.stderr
        assert check_layout(tmp_path / "layout")["digest"] == reg.digest


def test_a_revoked_engine_is_denied_to_every_client(reg, tmp_path):
    db = sqlite3.connect(reg.home / "kiln.db")
    try:
        db.execute("UPDATE artifacts SET status = 'revoked', status_reason = 'bad tokenizer' WHERE digest = ?",
                   (reg.digest,))
        db.commit()
        r = reg.kiln("pull", f"{REPO}@{reg.digest}", str(tmp_path / "e"), "--server", reg.url)
        assert r.returncode != 0 and "revoked" in r.stderr and "bad tokenizer" in r.stderr
        assert not (tmp_path / "e").exists()
        r = httpx.get(f"{reg.url}/v2/{REPO}/manifests/{reg.digest}", headers={"Accept": MEDIA_TYPE_IMAGE_MANIFEST})
        assert r.status_code == 403 and r.json()["errors"][0]["code"] == "DENIED"
    finally:
        db.execute("UPDATE artifacts SET status = 'fresh' WHERE digest = ?", (reg.digest,))
        db.commit()
        db.close()


def test_kiln_pull_refuses_a_corrupted_blob_and_writes_nothing(reg, tmp_path):
    layer = manifest_of(reg)["layers"][0]["digest"]
    path = reg.home / "store" / paths.blob_path(layer)
    original, mode = path.read_bytes(), path.stat().st_mode
    path.chmod(0o644)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    cache = tmp_path / "cache"  # a cache of its own: the module's pulls above keep the good layer in KILN_HOME's
    reg.env["KILN_PULL_CACHE_DIR"] = str(cache)
    try:
        out = tmp_path / "out"
        out.mkdir()
        r = reg.kiln("pull", f"{REPO}@{reg.digest}", str(out / "engine"), "--server", reg.url)
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert "corrupted" in r.stderr and list(out.iterdir()) == []
        assert list((cache / "blobs" / "sha256").iterdir()) == list((cache / "uploads").iterdir()) == []
    finally:
        reg.env.pop("KILN_PULL_CACHE_DIR")
        path.write_bytes(original)
        path.chmod(mode)
