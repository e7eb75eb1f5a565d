"""`kiln push` against a real CNCF distribution registry (Debian's ``docker-registry``, started here as a plain
process on a free port with its own storage), then pulled back by digest by clients written by others (skopeo,
oras-py): the same manifest digest, the same bytes, the same referrers as Kiln's own /v2.

distribution 2.8 has no referrers API (``GET /v2/<name>/referrers/<digest>`` is a 404), so what runs here is the
referrers *tag schema* (an index tagged ``sha256-<hex>``); the referrers API path is tested against a scripted
registry in tests/unit/artifacts/test_push.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from artifacts.oci import MEDIA_TYPE_IMAGE_INDEX
from kiln import db
from kiln.settings import Settings
from tests.engines import publish_tiny
from tests.processes import wait_answering

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
REGISTRY = shutil.which("docker-registry") or ("/usr/bin/docker-registry"
                                               if Path("/usr/bin/docker-registry").exists() else None)
SKOPEO = shutil.which("skopeo")
needs_registry = pytest.mark.skipif(REGISTRY is None, reason="docker-registry (CNCF distribution) is not installed: "
                                                             "scripts/install-test-tools.sh (apt-get install "
                                                             "docker-registry)")
needs_skopeo = pytest.mark.skipif(SKOPEO is None, reason="skopeo is not installed (apt-get install -y skopeo)")
INDEX = {"Accept": MEDIA_TYPE_IMAGE_INDEX}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln(home: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "KILN_HOME": str(home), "DOCKER_CONFIG": str(home / "no-docker"),
                               **(env or {})}, timeout=120)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    if REGISTRY is None:
        pytest.skip("docker-registry is not installed")
    root = tmp_path_factory.mktemp("distribution")
    port = free_port()
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: " + str(root / "data")
        + f"\nhttp:\n  addr: 127.0.0.1:{port}\n")
    log = open(root / "log", "wb")
    proc = subprocess.Popen([REGISTRY, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(proc, url, "/v2/", log=root / "log", what="docker-registry", timeout=10)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """An engine published into a KILN_HOME by the real publish stage (no build), signed with that home's key."""
    home = tmp_path_factory.mktemp("push") / "kiln"
    settings, store, row = publish_tiny(home, key=b"push", files={
        "config.json": b'{"hidden_size": 8}', "weights.bin": os.urandom(3 << 20),  # over a store chunk: read in parts
        "serving/vllm.yaml": b"max-num-seqs: 8\n"})
    kiln_v2 = TestClient(create_app(settings, enqueue=lambda *a: None))
    return home, row.digest, store, kiln_v2


@needs_registry
def test_push_then_pull_back_by_digest(registry, home, tmp_path):
    path, digest, store, kiln_v2 = home
    host = registry.removeprefix("http://")
    dest = f"{host}/team/engines/tiny"
    proc = kiln(path, "push", digest[:20], f"{dest}:fp8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"pushed {dest}@{digest} with 4 referrers (listed under the referrers tag schema), "
                           "tagged fp8\n")

    # the manifest: the same bytes, so the same digest, by digest and by tag
    ours = kiln_v2.get(f"/v2/acme/tiny/manifests/{digest}")
    assert ours.status_code == 200
    theirs = httpx.get(f"{registry}/v2/team/engines/tiny/manifests/{digest}",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert theirs.status_code == 200 and theirs.content == ours.content
    assert theirs.headers["Docker-Content-Digest"] == digest
    tagged = httpx.get(f"{registry}/v2/team/engines/tiny/manifests/fp8",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert tagged.headers["Docker-Content-Digest"] == digest

    # referrers: distribution 2.8 has no referrers API, so they are listed under the tag schema's index
    assert httpx.get(f"{registry}/v2/team/engines/tiny/referrers/{digest}").status_code == 404
    kiln_index = kiln_v2.get(f"/v2/acme/tiny/referrers/{digest}").json()["manifests"]
    fallback = httpx.get(f"{registry}/v2/team/engines/tiny/manifests/sha256-{digest[7:]}", headers=INDEX)
    assert fallback.status_code == 200
    index = fallback.json()
    assert index["mediaType"] == MEDIA_TYPE_IMAGE_INDEX
    assert ({(m["digest"], m["artifactType"], m["size"]) for m in index["manifests"]}
            == {(m["digest"], m["artifactType"], m["size"]) for m in kiln_index})
    assert len(kiln_index) == 4
    for ref in kiln_index:  # each referrer manifest byte for byte, naming the engine as its subject
        got = httpx.get(f"{registry}/v2/team/engines/tiny/manifests/{ref['digest']}",
                        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        assert got.content == kiln_v2.get(f"/v2/acme/tiny/manifests/{ref['digest']}").content
        assert json.loads(got.content)["subject"]["digest"] == digest

    # oras-py pulls the engine layer and each referrer's payload by digest, byte-identical to Kiln's blobs
    oras_client = pytest.importorskip("oras.client", reason="oras-py is not installed (pip install oras)")
    client = oras_client.OrasClient(hostname=host, insecure=True)
    [layer] = json.loads(theirs.content)["layers"]
    [engine_tar] = client.pull(target=f"{dest}@{digest}", outdir=str(tmp_path / "oras"))
    assert Path(engine_tar).name == "engine.tar"
    assert Path(engine_tar).read_bytes() == store.get_bytes(layer["digest"])
    for ref in kiln_index:
        [payload] = client.pull(target=f"{dest}@{ref['digest']}", outdir=str(tmp_path / ref["digest"][7:]))
        [ref_layer] = json.loads(store.get_bytes(ref["digest"]))["layers"]
        assert Path(payload).read_bytes() == store.get_bytes(ref_layer["digest"])

    # a second push sends nothing new and leaves one index entry per referrer
    again = kiln(path, "push", digest, dest, "--json")
    assert again.returncode == 0, again.stderr
    body = json.loads(again.stdout)
    assert body["blobs_sent"] == 0 and body["referrers_api"] is False
    assert body["referrers_tag"] == f"sha256-{digest[7:]}" and body["reference"] == f"{dest}@{digest}"
    index = httpx.get(f"{registry}/v2/team/engines/tiny/manifests/sha256-{digest[7:]}", headers=INDEX).json()
    assert len(index["manifests"]) == 4


@needs_registry
@needs_skopeo
def test_skopeo_inspects_and_copies_the_pushed_engine_by_digest(registry, home, tmp_path):
    path, digest, store, _ = home
    host = registry.removeprefix("http://")
    assert kiln(path, "push", digest, f"{host}/skopeo/tiny").returncode == 0
    ref = f"docker://{host}/skopeo/tiny@{digest}"
    raw = subprocess.run([SKOPEO, "inspect", "--raw", "--tls-verify=false", ref], capture_output=True, timeout=120)
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout == store.get_bytes(digest)
    info = subprocess.run([SKOPEO, "inspect", "--tls-verify=false", ref], capture_output=True, text=True,
                          timeout=120)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["Digest"] == digest
    layout = tmp_path / "layout"
    copied = subprocess.run([SKOPEO, "--insecure-policy", "copy", "--preserve-digests",
                             "--dest-oci-accept-uncompressed-layers", "--src-tls-verify=false", ref,
                             f"oci:{layout}:engine"], capture_output=True, text=True, timeout=120)
    assert copied.returncode == 0, copied.stderr
    [entry] = json.loads((layout / "index.json").read_text())["manifests"]
    assert entry["digest"] == digest
    for blob in (layout / "blobs" / "sha256").iterdir():
        assert store.get_bytes(f"sha256:{blob.name}") == blob.read_bytes()


@needs_registry
def test_push_refusals_are_one_line_with_their_exit_codes(registry, home, tmp_path):
    path, digest, _, _ = home
    host = registry.removeprefix("http://")
    bad = kiln(path, "push", digest, "no-host-here")
    assert bad.returncode == 2 and "dest" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    url = kiln(path, "push", digest, f"http://{host}/x")
    assert url.returncode == 2 and "--insecure" in url.stderr
    down = kiln(path, "push", digest, f"127.0.0.1:{free_port()}/x", "--json")
    assert down.returncode == 3 and "cannot reach" in down.stderr
    assert json.loads(down.stdout)["error"]["code"] == "registry_unavailable"
    # a remote host is https unless --insecure: the plain-http registry's port, named by a non-loopback name
    tls = kiln(path, "push", digest, f"localhost.localdomain.invalid:{host.rsplit(':', 1)[1]}/x")
    assert tls.returncode == 3


@needs_registry
def test_replication_pushes_after_a_build_and_records_a_failure_without_raising(registry, home):
    """KILN_REPLICATE_TO (workers/replication.py, called by the worker before it marks a build succeeded): the
    engine lands at <prefix>/<repository>:<tag> with its referrers; a registry that is down is recorded as the
    build's replication_failed event, and nothing is raised."""
    from sqlalchemy import select

    from kiln.tables import Artifact, Build, BuildEvent
    from workers.replication import replicate

    path, digest, store, _ = home
    host = registry.removeprefix("http://")
    sessions = db.session_factory(Settings(home=path).db_url)
    with sessions() as s:
        s.add(Build(id="b-replicate", request_key=digest, spec={}, queue="q", status="running"))
        tag = s.get(Artifact, digest).tag
        s.commit()
    ok = replicate(Settings(home=path, replicate_to=f"{host}/mirror/"), store, sessions, "b-replicate", digest)
    assert ok["reference"] == f"{host}/mirror/acme/tiny@{digest}" and ok["referrers"] == 4
    assert ok["dest"] == f"{host}/mirror/acme/tiny:{tag}" and ok["referrers_api"] is False
    got = httpx.get(f"{registry}/v2/mirror/acme/tiny/manifests/{tag}",
                    headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert got.status_code == 200 and got.headers["Docker-Content-Digest"] == digest
    down = replicate(Settings(home=path, replicate_to=f"127.0.0.1:{free_port()}"), store, sessions, "b-replicate",
                     digest)
    assert down["error"]["code"] == "registry_unavailable"
    assert replicate(Settings(home=path), store, sessions, "b-replicate", digest) is None  # off: nothing recorded
    with sessions() as s:
        events = [(e.kind, e.data) for e in s.scalars(select(BuildEvent).where(BuildEvent.build_id == "b-replicate")
                                                      .order_by(BuildEvent.id))]
    assert [k for k, _ in events] == ["replicated", "replication_failed"]
    assert events[1][1]["dest"].endswith(f"/acme/tiny:{tag}")


@contextlib.contextmanager
def kiln_api(home: Path):
    """``kiln api`` on ``home``'s index, on a free port: its URL while it runs."""
    port, log = free_port(), home.parent / "kiln-api.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli", "api", "--port", str(port)], cwd=REPO_ROOT,
                                env={**os.environ, "KILN_HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(proc, url, "/readyz", log=log, what="kiln api", timeout=30)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def admission_review(image: str) -> dict:
    """An AdmissionReview of a Pod CREATE whose engine container is ``image``, on an H100 node (the engine's GPU)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tiny-0", "namespace": "serving"},
           "spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "containers": [{"name": "server", "image": "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3"},
                                   {"name": "engine", "image": image}]}}
    return {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                        "namespace": "serving", "object": pod}}


@needs_registry
def test_admission_and_resolve_accept_the_pushed_reference(registry, home):
    """After `kiln push` (and KILN_REPLICATE_TO), the webhook admits the engine by its digest in the registry it
    was pushed to, and refuses there a digest Kiln never published, a tag, and the engine in a repository Kiln did
    not push it to; `kiln resolve --registry` prints the pushed reference, which the registry serves."""
    from kiln.tables import Build
    from workers.replication import replicate

    path, digest, store, _ = home
    host = registry.removeprefix("http://")
    dest = f"{host}/deploy/tiny"
    assert kiln(path, "push", digest, f"{dest}:fp8").returncode == 0
    webhook = TestClient(create_app(Settings(home=path, registry_hosts="kiln.internal:8000"),
                                    enqueue=lambda *a: None))

    def admit(image: str) -> dict:
        r = webhook.post("/v1/admission/validate", json=admission_review(image))
        assert r.status_code == 200, r.text
        return r.json()["response"]

    assert admit(f"{dest}@{digest}") == {"uid": "u-1", "allowed": True}
    unknown = "sha256:" + hashlib.sha256(b"not an engine").hexdigest()
    r = admit(f"{dest}@{unknown}")
    assert r["allowed"] is False and f"{dest}@{unknown}: no Kiln engine has this digest" in r["status"]["message"]
    r = admit(f"{dest}:fp8")
    assert r["allowed"] is False and f"{dest}:fp8 names a Kiln engine in another registry by tag" in \
        r["status"]["message"] and f"use {dest}@sha256:…" in r["status"]["message"]
    r = admit(f"{host}/elsewhere/tiny@{digest}")  # the same bytes, in a repository Kiln did not push to
    assert r["allowed"] is False and f"run kiln push {digest} {host}/elsewhere/tiny" in r["status"]["message"]

    # resolve prints the reference a pod spec names, and the registry serves the engine there
    variant = ["acme/tiny", "--precision", "fp8", "--target", "h100", "--profile", "balanced", "--backend",
               "checkpoint"]
    printed = kiln(path, "resolve", *variant, "--registry", dest)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == f"{dest}@{digest}\n"
    repo, _, ref = printed.stdout.strip().partition("/")[2].partition("@")
    got = httpx.get(f"{registry}/v2/{repo}/manifests/{ref}",
                    headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert got.status_code == 200 and got.content == store.get_bytes(digest)
    missing = kiln(path, "resolve", *variant, "--registry", f"{host}/never")
    assert missing.returncode == 2 and "has not been pushed to" in missing.stderr and "kiln push" in missing.stderr
    with kiln_api(path) as server:  # the same answers from a remote Kiln (GET /v1/resolve?…&registry=…)
        remote = kiln(path, "resolve", *variant, "--registry", dest, "--server", server)
        assert remote.returncode == 0 and remote.stdout == f"{dest}@{digest}\n", remote.stderr
        remote = kiln(path, "resolve", *variant, "--registry", f"{host}/never", "--server", server)
        assert remote.returncode == 2 and "has not been pushed to" in remote.stderr, remote.stderr

    # KILN_REPLICATE_TO records the same way: <prefix>/<repository>, found under the prefix
    sessions = db.session_factory(Settings(home=path).db_url)
    with sessions() as s:
        s.add(Build(id="b-resolve-replica", request_key=digest, spec={}, queue="q", status="running"))
        s.commit()
    done = replicate(Settings(home=path, replicate_to=f"{host}/replicas"), store, sessions, "b-resolve-replica", digest)
    assert done["reference"] == f"{host}/replicas/acme/tiny@{digest}"
    printed = kiln(path, "resolve", *variant, "--registry", f"{host}/replicas")
    assert printed.returncode == 0 and printed.stdout == f"{host}/replicas/acme/tiny@{digest}\n", printed.stderr
    assert admit(done["reference"])["allowed"] is True


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@needs_registry
def test_a_deployer_with_only_the_public_key_pulls_and_verifies_from_the_registry(registry, home, tmp_path):
    """The round trip through the team's registry (distribution 2.8: no referrers API, so the signature and the
    provenance are found under the referrers tag schema `kiln push` wrote): a fresh KILN_HOME with only
    `kiln keys public`'s PEM pulls host/repository@digest and verifies it offline; a wrong key is refused; a rerun
    into the same DEST is a no-op; a DEST with other content (even under the same names) is refused."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path, digest, _, _ = home
    host = registry.removeprefix("http://")
    ref = f"{host}/team/engines/deploy@{digest}"
    assert kiln(path, "push", digest, f"{host}/team/engines/deploy").returncode == 0
    public = kiln(path, "keys", "public")
    assert public.returncode == 0, public.stderr
    deployer = tmp_path / "deployer"
    deployer.mkdir()
    (deployer / "kiln.pub").write_text(public.stdout)
    fresh = deployer / "kiln"  # no index, no store, no keys: only the PEM above
    dest = deployer / "engine"

    got = kiln(fresh, "pull", ref, str(dest), "--verify-key", str(deployer / "kiln.pub"))
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"pulled {host}/team/engines/deploy@{digest} into {dest}; verified, signed by ")
    signer = got.stdout.split("signed by ", 1)[1].split(";", 1)[0]
    engine = files_of(path.parent / "engine")
    pulled = files_of(dest)
    assert pulled.pop("model.sig") and pulled == engine
    assert not (fresh / "keys").exists()

    # again into the same DEST: checked by digest, left as it is
    before = {p: p.stat().st_mtime_ns for p in [dest, *dest.rglob("*")]}
    again = kiln(fresh, "pull", ref, str(dest), "--verify-key", str(deployer / "kiln.pub"))
    assert again.returncode == 0, again.stderr
    assert again.stdout == (f"{dest} already holds {host}/team/engines/deploy@{digest}; verified, signed by "
                            f"{signer}; nothing rewritten\n")
    assert {p: p.stat().st_mtime_ns for p in [dest, *dest.rglob("*")]} == before

    # a key that did not sign it: refused, nothing written
    other_key = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (deployer / "other.pub").write_bytes(other_key)
    wrong = kiln(fresh, "pull", ref, str(deployer / "wrong"), "--verify-key", str(deployer / "other.pub"))
    assert wrong.returncode == 1 and "not trusted" in wrong.stderr, wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1 and not (deployer / "wrong").exists()

    # a DEST holding anything else is refused, left as it was: other files, or the same names with other bytes
    elsewhere = deployer / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_bytes(b"{}")
    tampered = deployer / "tampered"
    shutil.copytree(dest, tampered)
    (tampered / "weights.bin").write_bytes(b"\0" * len(engine["weights.bin"]))
    for taken in (elsewhere, tampered):
        kept = files_of(taken)
        refused = kiln(fresh, "pull", ref, str(taken))
        assert refused.returncode == 2 and f"{taken} already exists" in refused.stderr, refused.stderr
        assert files_of(taken) == kept
        assert [p.name for p in deployer.iterdir() if p.name.startswith(f".{taken.name}")] == []  # no staging left

    # the reference is checked before anything is sent
    bare = kiln(fresh, "pull", f"{host}/team/engines/deploy", str(deployer / "x"))
    assert bare.returncode == 2 and "names no digest" in bare.stderr
    both = kiln(fresh, "pull", ref, str(deployer / "x"), "--server", "http://127.0.0.1:1")
    assert both.returncode == 2 and "names a registry host, and --server a Kiln" in both.stderr, both.stderr
    down = kiln(fresh, "pull", f"127.0.0.1:{free_port()}/team/engines/deploy@{digest}", str(deployer / "x"))
    assert down.returncode == 3 and "cannot pull from" in down.stderr, down.stderr
