"""The /v2 registry API (OCI distribution-spec v1.1, read side) over a real app, a temp KILN_HOME and engines
published by ``builder.publish.publish`` from small hand-made engine directories; and ``kiln pull --server``'s
client (``api.pull``) against it, through the same in-process HTTP client."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.pull import UnsafeLayer, pull_remote, split_ref
from api.routes import oci
from artifacts import paths
from artifacts.oci import MEDIA_TYPE_IMAGE_INDEX, MEDIA_TYPE_IMAGE_MANIFEST, read_manifest
from builder.publish import PROVENANCE_TYPE, publish
from kiln import db
from kiln.digests import canonical_json, sha256_bytes
from kiln.errors import ArtifactUnknown, DigestMismatch, InvalidDigest, KilnError, SpecError
from kiln.tables import Artifact, Referrer
from kiln.settings import Settings
from kiln.spec import parse_spec

REPO = "acme/tiny"
TAG = "fp8-cpu-latency-checkpoint"
ZERO = "sha256:" + "0" * 64


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_engine(root: Path, seed: str) -> Path:
    files = {"config.json": json.dumps({"engine": seed}).encode(), "rank0.safetensors": seed.encode() * 3000,
             "tokenizer/tokenizer.json": b"{}"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


class Registry:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.settings = Settings(home=tmp / "home")
        db.upgrade(self.settings.db_url)
        self.app = create_app(self.settings, enqueue=lambda *a, **k: None)
        self.store, self.sessions = self.app.state.store, self.app.state.sessions
        self.client = TestClient(self.app)
        self.n = 0

    def publish(self, *, name: str = REPO, passed: bool = True, profile: str = "latency", seed: str | None = None,
                backend: str = "checkpoint") -> Artifact:
        self.n += 1
        seed = seed or f"engine-{self.n}"
        spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "model_name": name, "precision": "fp8",
                           "profile": profile, "backend": backend}, [])
        provenance = {"created": "2026-01-01T00:00:00Z", "toolchain": {"torch": "2.13"},
                      "checkpoint": {"ref": spec.checkpoint, "digest": sha(b"ckpt"), "revision": "a" * 40}}
        return publish(self.store, self.sessions, make_engine(self.tmp / seed, seed), spec=spec,
                       build_key=sha(seed.encode()), provenance=provenance, validation={"passed": passed})

    def set_status(self, digest: str, status: str) -> None:
        with self.sessions() as s:
            s.get(Artifact, digest).status = status
            s.commit()

    def referrer_of(self, digest: str) -> Referrer:
        with self.sessions() as s:
            from builder.publish import PROVENANCE_TYPE

            return s.query(Referrer).filter_by(subject=digest, artifact_type=PROVENANCE_TYPE).one()

    def corrupt(self, digest: str, data: bytes) -> None:
        path = self.store.root / paths.blob_path(digest)
        path.chmod(0o644)
        path.write_bytes(data)


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    oci.MANIFESTS.clear()
    return Registry(tmp_path)


@pytest.fixture
def engine(reg: Registry) -> Artifact:
    return reg.publish()


def errors(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"errors"} and len(body["errors"]) == 1, body
    return body["errors"][0]


def layer_of(reg: Registry, digest: str) -> dict:
    return read_manifest(reg.store, digest)["layers"][0]


# -- base, manifests ---------------------------------------------------------------------------------------------
def test_base_endpoint(reg):
    r = reg.client.get("/v2/")
    assert r.status_code == 200 and r.json() == {}
    assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    assert reg.client.head("/v2/").status_code == 200


def test_manifest_by_digest_is_the_stored_bytes(reg, engine):
    r = reg.client.get(f"/v2/{REPO}/manifests/{engine.digest}")
    assert r.status_code == 200
    assert r.content == reg.store.get_bytes(engine.digest) and sha(r.content) == engine.digest
    assert r.headers["Content-Type"] == MEDIA_TYPE_IMAGE_MANIFEST
    assert r.headers["Docker-Content-Digest"] == engine.digest
    assert r.headers["Content-Length"] == str(len(r.content))
    assert r.headers["Kiln-Engine-Status"] == "fresh"
    assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    head = reg.client.head(f"/v2/{REPO}/manifests/{engine.digest}")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["Content-Length"] == str(len(r.content))
    assert head.headers["Docker-Content-Digest"] == engine.digest


def test_manifest_by_tag(reg, engine):
    assert engine.tag == TAG
    r = reg.client.get(f"/v2/{REPO}/manifests/{TAG}")
    assert r.status_code == 200 and sha(r.content) == engine.digest
    assert r.headers["Docker-Content-Digest"] == engine.digest


def test_referrer_manifest_is_served_by_digest(reg, engine):
    ref = reg.referrer_of(engine.digest)
    r = reg.client.get(f"/v2/{REPO}/manifests/{ref.digest}")
    assert r.status_code == 200 and sha(r.content) == ref.digest
    body = r.json()
    assert body["artifactType"] == PROVENANCE_TYPE and body["subject"]["digest"] == engine.digest
    assert "Kiln-Engine-Status" not in r.headers


def test_stale_engines_stay_pullable_by_digest_and_say_so_but_never_by_tag(reg, engine):
    reg.set_status(engine.digest, "stale")
    r = reg.client.get(f"/v2/{REPO}/manifests/{engine.digest}")
    assert r.status_code == 200 and r.headers["Kiln-Engine-Status"] == "stale"
    layer = layer_of(reg, engine.digest)
    assert reg.client.get(f"/v2/{REPO}/blobs/{layer['digest']}").status_code == 200
    assert errors(reg.client.get(f"/v2/{REPO}/manifests/{TAG}"))["code"] == "MANIFEST_UNKNOWN"  # a tag left behind


def test_a_revoked_engine_is_denied_with_its_reason_unless_an_admin_asks(reg, engine):
    with reg.sessions() as s:
        row = s.get(Artifact, engine.digest)
        row.status, row.status_reason = "revoked", "wrong tokenizer"
        s.commit()
    for url in (f"/v2/{REPO}/manifests/{engine.digest}", f"/v2/{REPO}/manifests/{TAG}"):
        r = reg.client.get(url)
        assert r.status_code == 403 and errors(r)["code"] == "DENIED" and "wrong tokenizer" in errors(r)["message"]
        assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    assert reg.client.head(f"/v2/{REPO}/manifests/{engine.digest}").status_code == 403
    # auth is off here: the caller holds every scope; asked for explicitly, the admin gets it (and its status)
    r = reg.client.get(f"/v2/{REPO}/manifests/{engine.digest}?allow=revoked")
    assert r.status_code == 200 and r.headers["Kiln-Engine-Status"] == "revoked"


def test_a_revoked_engines_blobs_are_denied_like_its_manifest(reg, engine):
    """GET /v2/<name>/blobs/<revoked manifest digest> answered the manifest, then its layers: the revoke was
    sidestepped by pulling through /blobs."""
    manifest = read_manifest(reg.store, engine.digest)
    with reg.sessions() as s:
        row = s.get(Artifact, engine.digest)
        row.status, row.status_reason = "revoked", "wrong tokenizer"
        s.commit()
    for digest in (engine.digest, manifest["config"]["digest"], *(d["digest"] for d in manifest["layers"])):
        url = f"/v2/{REPO}/blobs/{digest}"
        r = reg.client.get(url)
        assert r.status_code == 403 and errors(r)["code"] == "DENIED" and "wrong tokenizer" in errors(r)["message"]
        assert reg.client.head(url).status_code == 403
        assert reg.client.get(url, headers={"Range": "bytes=0-1"}).status_code == 403
        assert reg.client.get(f"{url}?allow=revoked").status_code == 200  # an admin who asks for it
    # its referrers (provenance, signatures) stay readable: they say why and by whom
    ref = json.loads(reg.store.get_bytes(reg.referrer_of(engine.digest).digest))
    assert reg.client.get(f"/v2/{REPO}/blobs/{ref['layers'][0]['digest']}").status_code == 200


def test_a_rejected_engine_is_never_served(reg, engine):
    bad = reg.publish(passed=False, profile="balanced")
    assert bad.status == "rejected"
    r = reg.client.get(f"/v2/{REPO}/manifests/{bad.digest}")
    assert r.status_code == 404
    err = errors(r)
    assert err["code"] == "MANIFEST_UNKNOWN" and "rejected" in err["message"] and err["detail"]["status"] == "rejected"
    assert reg.client.head(f"/v2/{REPO}/manifests/{bad.digest}").status_code == 404
    layer = layer_of(reg, bad.digest)
    assert errors(reg.client.get(f"/v2/{REPO}/blobs/{layer['digest']}"))["code"] == "BLOB_UNKNOWN"
    ref = reg.referrer_of(bad.digest)
    assert errors(reg.client.get(f"/v2/{REPO}/manifests/{ref.digest}"))["detail"]["status"] == "rejected"
    assert reg.client.get(f"/v2/{REPO}/referrers/{bad.digest}").json()["manifests"] == []
    assert bad.tag not in reg.client.get(f"/v2/{REPO}/tags/list").json()["tags"]
    # a repository holding only rejected engines does not exist for /v2
    only_bad = reg.publish(name="acme/bad", passed=False)
    assert errors(reg.client.get(f"/v2/acme/bad/manifests/{only_bad.digest}"))["code"] == "MANIFEST_UNKNOWN"
    assert errors(reg.client.get("/v2/acme/bad/tags/list"))["code"] == "NAME_UNKNOWN"
    assert "acme/bad" not in reg.client.get("/v2/_catalog").json()["repositories"]


def test_a_manifest_of_another_repository_is_unknown_here(reg, engine):
    other = reg.publish(name="acme/other")
    err = errors(reg.client.get(f"/v2/{REPO}/manifests/{other.digest}"))
    assert err["code"] == "MANIFEST_UNKNOWN"
    assert errors(reg.client.get(f"/v2/{REPO}/manifests/{ZERO}"))["code"] == "MANIFEST_UNKNOWN"
    assert errors(reg.client.get(f"/v2/{REPO}/manifests/no-such-tag"))["code"] == "MANIFEST_UNKNOWN"
    r = reg.client.get(f"/v2/{REPO}/manifests/-bad-tag")  # spec error codes only: no TAG_INVALID
    assert r.status_code == 404 and errors(r)["code"] == "MANIFEST_UNKNOWN"
    r = reg.client.get(f"/v2/acme/nothing/manifests/{engine.digest}")
    assert r.status_code == 404 and errors(r)["code"] == "NAME_UNKNOWN"


@pytest.mark.parametrize("path,code", [
    (f"/v2/{REPO}/manifests/sha256:abc", "DIGEST_INVALID"),
    (f"/v2/{REPO}/manifests/md5:{'0' * 32}", "DIGEST_INVALID"),
    (f"/v2/{REPO}/manifests/sha256:{'A' * 64}", "DIGEST_INVALID"),
    (f"/v2/{REPO}/blobs/sha256:xyz", "DIGEST_INVALID"),
    (f"/v2/{REPO}/referrers/notadigest", "DIGEST_INVALID"),
    (f"/v2/Acme/Tiny/manifests/{TAG}", "NAME_INVALID"),
    (f"/v2/acme//tiny/manifests/{TAG}", "NAME_INVALID"),
    ("/v2/acme/-tiny/tags/list", "NAME_INVALID"),
    (f"/v2/{'a' * 256}/tags/list", "NAME_INVALID"),
    (f"/v2/{REPO}/tags/list?n=-1", "UNSUPPORTED"),
    (f"/v2/{REPO}/tags/list?n=x", "UNSUPPORTED"),
    (f"/v2/{REPO}/tags/list?n=²", "UNSUPPORTED"),
    (f"/v2/{REPO}/tags/list?n={'9' * 5000}", "UNSUPPORTED"),
])
def test_bad_requests_are_400_in_the_spec_format(reg, engine, path, code):
    r = reg.client.get(path)
    assert r.status_code == 400, r.text
    assert errors(r)["code"] == code
    assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"


def test_head_errors_have_no_body(reg, engine):
    r = reg.client.head(f"/v2/{REPO}/manifests/{ZERO}")
    assert r.status_code == 404 and r.content == b""


def test_the_rest_of_the_api_keeps_its_own_error_format(reg):
    r = reg.client.get("/v1/artifacts/sha256:abc")
    assert r.status_code == 400 and "error" in r.json() and "errors" not in r.json()


def test_pushes_and_unknown_paths_are_unsupported(reg, engine):
    for method, path in [("POST", f"/v2/{REPO}/blobs/uploads/"), ("PUT", f"/v2/{REPO}/manifests/{TAG}"),
                         ("DELETE", f"/v2/{REPO}/manifests/{engine.digest}"), ("PATCH", f"/v2/{REPO}/blobs/uploads/x")]:
        r = reg.client.request(method, path)
        assert r.status_code == 405 and errors(r)["code"] == "UNSUPPORTED", (method, path, r.text)
    r = reg.client.get(f"/v2/{REPO}/whatever")
    assert r.status_code == 404 and errors(r)["code"] == "UNSUPPORTED"


# -- blobs -------------------------------------------------------------------------------------------------------
def test_blobs_stream_whole_and_named_by_the_manifest_only(reg, engine):
    manifest = read_manifest(reg.store, engine.digest)
    for desc in [manifest["config"], *manifest["layers"]]:
        r = reg.client.get(f"/v2/{REPO}/blobs/{desc['digest']}")
        assert r.status_code == 200
        assert sha(r.content) == desc["digest"] and len(r.content) == desc["size"]
        assert r.headers["Docker-Content-Digest"] == desc["digest"]
        assert r.headers["Content-Length"] == str(desc["size"])
        assert r.headers["Accept-Ranges"] == "bytes"
        assert r.headers["Content-Type"] == "application/octet-stream"
    # the layer is an engine tar
    layer = reg.client.get(f"/v2/{REPO}/blobs/{manifest['layers'][0]['digest']}").content
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        assert {"config.json", "rank0.safetensors", "tokenizer/tokenizer.json"} <= set(tar.getnames())
    # a referrer's payload is reachable through the referrer's manifest
    ref = json.loads(reg.store.get_bytes(reg.referrer_of(engine.digest).digest))
    payload = reg.client.get(f"/v2/{REPO}/blobs/{ref['layers'][0]['digest']}")
    assert payload.status_code == 200 and json.loads(payload.content)["validation"] == {"passed": True}
    # stored, but named by no manifest of this repository
    stray = reg.store.put_bytes(b"not part of any engine").digest
    r = reg.client.get(f"/v2/{REPO}/blobs/{stray}")
    assert r.status_code == 404 and errors(r)["code"] == "BLOB_UNKNOWN"
    other = reg.publish(name="acme/other")
    other_layer = layer_of(reg, other.digest)["digest"]
    assert errors(reg.client.get(f"/v2/{REPO}/blobs/{other_layer}"))["code"] == "BLOB_UNKNOWN"
    assert reg.client.get(f"/v2/acme/other/blobs/{other_layer}").status_code == 200
    assert errors(reg.client.get(f"/v2/acme/none/blobs/{other_layer}"))["code"] == "NAME_UNKNOWN"


def test_blob_head(reg, engine):
    layer = layer_of(reg, engine.digest)
    r = reg.client.head(f"/v2/{REPO}/blobs/{layer['digest']}")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["Content-Length"] == str(layer["size"]) and r.headers["Docker-Content-Digest"] == layer["digest"]
    assert reg.client.head(f"/v2/{REPO}/blobs/{ZERO}").status_code == 404


def test_blob_ranges(reg, engine):
    layer = layer_of(reg, engine.digest)
    url, size = f"/v2/{REPO}/blobs/{layer['digest']}", layer["size"]
    whole = reg.client.get(url).content
    for header, first, last in [("bytes=0-99", 0, 99), ("bytes=100-", 100, size - 1),
                                ("bytes=-10", size - 10, size - 1), (f"bytes=10-{size + 500}", 10, size - 1),
                                (f"bytes={size - 1}-{size - 1}", size - 1, size - 1),
                                (f"bytes=-{size * 2}", 0, size - 1)]:
        r = reg.client.get(url, headers={"Range": header})
        assert r.status_code == 206, (header, r.text)
        assert r.content == whole[first:last + 1], header
        assert r.headers["Content-Range"] == f"bytes {first}-{last}/{size}"
        assert r.headers["Content-Length"] == str(last - first + 1)
        assert r.headers["Docker-Content-Digest"] == layer["digest"]
    for header in [f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0", "bytes=50-10"]:
        r = reg.client.get(url, headers={"Range": header})
        assert r.status_code == 416, header
        assert r.headers["Content-Range"] == f"bytes */{size}"
        assert errors(r)["code"] == "UNSUPPORTED"
    for ignored in ["items=0-5", "bytes=0-5,10-20", "bytes=-", "bytes=" + "1" * 5000 + "-", "bytes=-" + "9" * 5000]:  # another unit, several ranges: the whole blob
        r = reg.client.get(url, headers={"Range": ignored})
        assert r.status_code == 200 and r.content == whole
    head = reg.client.head(url, headers={"Range": "bytes=0-9"})
    assert head.status_code == 206 and head.headers["Content-Length"] == "10" and head.content == b""


def test_redirect_to_a_presigned_url_when_enabled(reg, engine, monkeypatch):
    layer = layer_of(reg, engine.digest)["digest"]
    monkeypatch.setattr(type(reg.store), "presigned_url", lambda self, d, expires_s=300: f"https://s3.example/{d}")
    assert reg.client.get(f"/v2/{REPO}/blobs/{layer}", follow_redirects=False).status_code == 200  # off by default
    monkeypatch.setattr(oci, "REDIRECT_BLOBS", True)
    r = reg.client.get(f"/v2/{REPO}/blobs/{layer}", follow_redirects=False)
    assert r.status_code == 307 and r.headers["Location"] == f"https://s3.example/{layer}"
    assert r.headers["Docker-Content-Digest"] == layer
    monkeypatch.setattr(type(reg.store), "presigned_url", lambda self, d, expires_s=300: None)
    assert reg.client.get(f"/v2/{REPO}/blobs/{layer}", follow_redirects=False).status_code == 200


def test_manifests_are_cached_per_digest(reg, engine, monkeypatch):
    layer = layer_of(reg, engine.digest)["digest"]
    assert reg.client.get(f"/v2/{REPO}/blobs/{layer}").status_code == 200
    calls = []
    real = type(reg.store).get_bytes
    monkeypatch.setattr(type(reg.store), "get_bytes", lambda self, d: calls.append(d) or real(self, d))
    for _ in range(3):
        assert reg.client.get(f"/v2/{REPO}/blobs/{layer}").status_code == 200
        assert reg.client.get(f"/v2/{REPO}/manifests/{engine.digest}").status_code == 200
    assert calls == []


# -- tags, catalog, referrers ------------------------------------------------------------------------------------
def test_tags_list_and_pagination(reg, engine):
    reg.publish(profile="balanced")
    reg.publish(profile="throughput")
    r = reg.client.get(f"/v2/{REPO}/tags/list")
    tags = sorted(["fp8-cpu-latency-checkpoint", "fp8-cpu-balanced-checkpoint", "fp8-cpu-throughput-checkpoint"])
    assert r.status_code == 200 and r.json() == {"name": REPO, "tags": tags} and "Link" not in r.headers
    page = reg.client.get(f"/v2/{REPO}/tags/list?n=2")
    assert page.json()["tags"] == tags[:2]
    assert page.headers["Link"] == f'</v2/{REPO}/tags/list?n=2&last={tags[1]}>; rel="next"'
    nxt = reg.client.get(page.headers["Link"].split(">")[0][1:])
    assert nxt.json()["tags"] == tags[2:] and "Link" not in nxt.headers
    assert reg.client.get(f"/v2/{REPO}/tags/list?last={tags[0]}").json()["tags"] == tags[1:]
    assert reg.client.get(f"/v2/{REPO}/tags/list?n=0").json()["tags"] == []
    assert errors(reg.client.get("/v2/acme/none/tags/list"))["code"] == "NAME_UNKNOWN"


def test_catalog(reg, engine):
    for name in ("acme/b", "zeta/model", "acme/a"):
        reg.publish(name=name)
    assert reg.client.get("/v2/_catalog").json() == {"repositories": ["acme/a", "acme/b", REPO, "zeta/model"]}
    first = reg.client.get("/v2/_catalog?n=3")
    assert first.json()["repositories"] == ["acme/a", "acme/b", REPO]
    assert first.headers["Link"] == '</v2/_catalog?n=3&last=acme%2Ftiny>; rel="next"'
    assert reg.client.get(first.headers["Link"].split(">")[0][1:]).json()["repositories"] == ["zeta/model"]


def test_referrers_index_and_artifact_type_filter(reg, engine):
    ref = reg.referrer_of(engine.digest)
    r = reg.client.get(f"/v2/{REPO}/referrers/{engine.digest}")
    assert r.status_code == 200 and r.headers["Content-Type"] == MEDIA_TYPE_IMAGE_INDEX
    assert "OCI-Filters-Applied" not in r.headers
    index = r.json()
    assert index["schemaVersion"] == 2 and index["mediaType"] == MEDIA_TYPE_IMAGE_INDEX
    # provenance, the validation report and the two signatures (files, signed provenance) refer to the engine
    assert {m["artifactType"] for m in index["manifests"]} == {
        PROVENANCE_TYPE, "application/vnd.kiln.validation-report.v1+json",
        "application/vnd.dev.sigstore.bundle.v0.3+json", "application/vnd.in-toto+json"}
    prov = [m for m in index["manifests"] if m["artifactType"] == PROVENANCE_TYPE]
    assert prov == [{"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": ref.digest, "size": ref.size,
                     "artifactType": PROVENANCE_TYPE, "annotations": {"dev.kiln.build-key": engine.build_key}}]
    # the descriptor is true: size and digest of the stored referrer manifest, whose annotations it copies
    stored = reg.store.get_bytes(ref.digest)
    assert len(stored) == ref.size and json.loads(stored)["annotations"] == prov[0]["annotations"]
    hit = reg.client.get(f"/v2/{REPO}/referrers/{engine.digest}", params={"artifactType": PROVENANCE_TYPE})
    assert hit.headers["OCI-Filters-Applied"] == "artifactType" and len(hit.json()["manifests"]) == 1
    miss = reg.client.get(f"/v2/{REPO}/referrers/{engine.digest}", params={"artifactType": "application/x-other"})
    assert miss.status_code == 200 and miss.json()["manifests"] == []
    assert miss.headers["OCI-Filters-Applied"] == "artifactType"
    # never 404: an unknown subject, or another repository, has no referrers
    assert reg.client.get(f"/v2/{REPO}/referrers/{ZERO}").json()["manifests"] == []
    assert reg.client.get(f"/v2/acme/other/referrers/{engine.digest}").json()["manifests"] == []


def test_openapi_lists_the_v2_routes(reg):
    paths_ = reg.client.get("/openapi.json").json()["paths"]
    assert {"/v2/", "/v2/_catalog", "/v2/{name}/manifests/{reference}", "/v2/{name}/blobs/{digest}",
            "/v2/{name}/tags/list", "/v2/{name}/referrers/{digest}"} <= set(paths_)


# -- kiln pull --server's client -----------------------------------------------------------------------------------
def test_split_ref():
    assert split_ref(f"acme/tiny@{ZERO}") == ("acme/tiny", ZERO)
    assert split_ref(ZERO) == (None, ZERO)
    with pytest.raises(InvalidDigest):
        split_ref("acme/tiny@sha256:nope")


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pull_remote_verifies_and_unpacks(reg, engine, tmp_path):
    dest = tmp_path / "out" / "engine"
    got = pull_remote("http://testserver", f"{REPO}@{engine.digest}", dest, client=reg.client)
    assert got.digest == engine.digest and got.status == "fresh" and got.layers == 1
    pulled = tree(dest)
    assert pulled.pop("model.sig") and got.signed  # the engine files' signature, beside them
    assert pulled == tree(tmp_path / "engine-1")
    assert sorted(p.name for p in dest.parent.iterdir()) == ["engine"]  # no staging left
    # a bare digest is placed through /v1/artifacts
    assert pull_remote("http://testserver", engine.digest, tmp_path / "bare", client=reg.client).repository == REPO
    # the same engine again into its DEST: checked by digest and left as it is; other content there is refused
    mtimes = {p: p.stat().st_mtime_ns for p in [dest, *dest.rglob("*")]}
    again = pull_remote("http://testserver", f"{REPO}@{engine.digest}", dest, client=reg.client)
    assert again.already and {p: p.stat().st_mtime_ns for p in [dest, *dest.rglob("*")]} == mtimes
    (dest / "extra.txt").write_bytes(b"not the engine's")
    with pytest.raises(SpecError, match="does not hold"):
        pull_remote("http://testserver", f"{REPO}@{engine.digest}", dest, client=reg.client)
    assert (dest / "extra.txt").exists() and sorted(p.name for p in dest.parent.iterdir()) == ["engine"]


def test_pull_remote_refuses_a_revoked_engine(reg, engine, tmp_path):
    reg.set_status(engine.digest, "revoked")
    with pytest.raises(KilnError, match="revoked"):
        pull_remote("http://testserver", f"{REPO}@{engine.digest}", tmp_path / "e", client=reg.client)
    assert not (tmp_path / "e").exists()


def test_pull_remote_refuses_a_corrupted_layer_and_leaves_nothing(reg, engine, tmp_path):
    layer = layer_of(reg, engine.digest)
    data = reg.store.get_bytes(layer["digest"])
    reg.corrupt(layer["digest"], data[:-1] + bytes([data[-1] ^ 1]))
    out = tmp_path / "out"
    with pytest.raises(DigestMismatch, match="corrupted"):
        pull_remote("http://testserver", f"{REPO}@{engine.digest}", out / "engine", client=reg.client)
    assert list(out.iterdir()) == []
    reg.corrupt(layer["digest"], data + b"extra")  # longer than its descriptor
    with pytest.raises(DigestMismatch):
        pull_remote("http://testserver", f"{REPO}@{engine.digest}", out / "engine", client=reg.client)
    assert list(out.iterdir()) == []


def test_pull_remote_refuses_rejected_and_unknown(reg, engine, tmp_path):
    bad = reg.publish(passed=False, profile="balanced")
    with pytest.raises(ArtifactUnknown, match="never served"):
        pull_remote("http://testserver", f"{REPO}@{bad.digest}", tmp_path / "x", client=reg.client)
    with pytest.raises(ArtifactUnknown):
        pull_remote("http://testserver", f"{REPO}@{ZERO}", tmp_path / "x", client=reg.client)
    assert not (tmp_path / "x").exists()


def _fake_server(routes: dict[str, bytes]) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        body = routes.get(request.url.path)
        return httpx.Response(200, content=body) if body is not None else httpx.Response(404, json={"errors": []})
    return httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handler))


def test_pull_remote_refuses_a_lying_manifest_and_an_unsafe_layer(tmp_path):
    manifest = canonical_json({"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "layers": []})
    with pytest.raises(DigestMismatch, match="hashing to"):
        pull_remote("http://fake", f"{REPO}@{ZERO}", tmp_path / "a",
                    client=_fake_server({f"/v2/{REPO}/manifests/{ZERO}": manifest}))
    # a verified layer that tries to leave the destination
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    layer = buf.getvalue()
    config = canonical_json({"rootfs": {"type": "layers", "diff_ids": [sha256_bytes(layer)]}})
    m = canonical_json({"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
                        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                   "digest": sha256_bytes(config), "size": len(config)},
                        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                    "digest": sha256_bytes(layer), "size": len(layer)}]})
    d = sha256_bytes(m)
    client = _fake_server({f"/v2/{REPO}/manifests/{d}": m, f"/v2/{REPO}/blobs/{sha256_bytes(config)}": config,
                           f"/v2/{REPO}/blobs/{sha256_bytes(layer)}": layer})
    out = tmp_path / "b"
    out.mkdir()
    with pytest.raises(UnsafeLayer):
        pull_remote("http://fake", f"{REPO}@{d}", out / "engine", client=client)
    assert list(out.iterdir()) == [] and not (tmp_path / "escape").exists()


def test_pull_remote_sends_kiln_token_and_explains_a_refusal(tmp_path, monkeypatch):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(401, json={"errors": [{"code": "UNAUTHORIZED", "message": "a token is required"}]})

    monkeypatch.setenv("KILN_TOKEN", "kiln_secret")
    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    with pytest.raises(SpecError) as err:
        pull_remote("http://fake", f"{REPO}@{ZERO}", tmp_path / "x")
    assert err.value.field == "KILN_TOKEN" and seen == ["Bearer kiln_secret"]
    assert not (tmp_path / "x").exists()
