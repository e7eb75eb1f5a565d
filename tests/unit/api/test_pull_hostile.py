"""``kiln pull --server`` against a hostile registry: a real HTTP server on 127.0.0.1 that serves crafted
manifests, configs and layers (valid digests, lying sizes, sparse tar members, endless bodies). Every case is
refused, nothing is left at the destination, and the client reads no more than its bounds allow."""

from __future__ import annotations

import io
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from api.pull import MANIFEST_MAX, UnsafeLayer, pull_remote
from artifacts.oci import MEDIA_TYPE_IMAGE_LAYER, MEDIA_TYPE_IMAGE_MANIFEST
from kiln.digests import canonical_json, sha256_bytes
from kiln.errors import DigestMismatch, SignatureInvalid


def socket_slack() -> int:
    """What a server can push past a client that has stopped reading: its socket's send buffer and the client's
    receive buffer (the kernel grows both up to these maxima, more so on a loaded machine) and the chunk being
    written."""
    limits = [Path(f"/proc/sys/net/ipv4/{name}") for name in ("tcp_wmem", "tcp_rmem")]
    if not all(p.exists() for p in limits):
        return 8 << 20
    return sum(int(p.read_text().split()[2]) for p in limits) + (1 << 20)


SOCKET_SLACK = socket_slack()
#: what an endless body offers: more than a client that reads it all could hide under the slack
ENDLESS_MIB = max(64, 2 * (MANIFEST_MAX + SOCKET_SLACK) >> 20)

REPO = "acme/tiny"


class Hostile:
    """Serves ``routes``: path → bytes, or a callable writing the body itself (an endless stream), with the
    status ``status`` gives (200 unless named). Counts the bytes it sent, the paths asked and the Authorization
    each request carried."""

    def __init__(self):
        self.routes: dict[str, object] = {}
        self.headers: dict[str, dict[str, str]] = {}
        self.status: dict[str, int] = {}
        self.sent = 0
        self.asked: list[str] = []
        self.authorization: dict[str, str | None] = {}
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                hostile.asked.append(self.path)
                hostile.authorization[self.path] = self.headers.get("Authorization")
                body = hostile.routes.get(self.path)
                if body is None:
                    data = b'{"errors": [{"code": "MANIFEST_UNKNOWN", "message": "unknown"}]}'
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(hostile.status.get(self.path, 200))
                for k, v in hostile.headers.get(self.path, {}).items():
                    self.send_header(k, v)
                if callable(body):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for chunk in body():
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            hostile.sent += len(chunk)
                        self.wfile.write(b"0\r\n\r\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                    hostile.sent += len(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def engine(self, layer: bytes, *, layer_size: int | None = None, config: bytes | None = None,
               config_size: int | None = None) -> str:
        """Serve an engine image around ``layer`` (digests right; sizes as given) and return its digest."""
        ld = sha256_bytes(layer)
        config = config if config is not None else canonical_json({"rootfs": {"type": "layers", "diff_ids": [ld]}})
        cd = sha256_bytes(config)
        m = canonical_json({"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
                            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd,
                                       "size": len(config) if config_size is None else config_size},
                            "layers": [{"mediaType": MEDIA_TYPE_IMAGE_LAYER, "digest": ld,
                                        "size": len(layer) if layer_size is None else layer_size}]})
        d = sha256_bytes(m)
        self.routes.update({f"/v2/{REPO}/manifests/{d}": m, f"/v2/{REPO}/blobs/{cd}": config,
                            f"/v2/{REPO}/blobs/{ld}": layer})
        return d

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    h = Hostile()
    yield h
    h.close()


def _checksum(header: bytearray) -> bytearray:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return header


def gnu_sparse_tar(name: str, realsize: int) -> bytes:
    """A GNU tar with one sparse member (type 'S'): 512 bytes of data at the end of a ``realsize`` file, the
    rest a hole. tarfile reads such members but cannot write them, so the header is patched by hand."""
    info = tarfile.TarInfo(name)
    info.size, info.type = 512, tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:398] = b"%011o\0" % (realsize - 512)  # sparse[0].offset
    header[398:410] = b"%011o\0" % 512  # sparse[0].numbytes
    header[482] = 0  # no extended sparse headers
    header[483:495] = b"%011o\0" % realsize
    return bytes(_checksum(header)) + b"x" * 512 + tarfile.NUL * 1024 * 9


def pax_sparse_tar(name: str, realsize: int) -> bytes:
    """A PAX tar with one sparse member, format 1.0 (GNU.sparse.* headers, the map at the start of the data)."""
    sparse_map = f"1\n{realsize - 512}\n512\n".encode().ljust(512, b"\0")
    info = tarfile.TarInfo("GNUSparseFile.0/" + name)
    info.size = len(sparse_map) + 512
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                        "GNU.sparse.realsize": str(realsize)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(sparse_map + b"y" * 512))
    return buf.getvalue()


def _nothing_at(dest: Path) -> bool:
    return not dest.exists() and [p.name for p in dest.parent.iterdir()] == []


@pytest.mark.parametrize("make", [gnu_sparse_tar, pax_sparse_tar], ids=["gnu", "pax"])
def test_a_sparse_member_is_refused(hostile, tmp_path, make):
    layer = make("rank0.engine", 64 << 20)  # 64 MiB file from a ~10 KiB verified layer
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:  # the crafted archive is what tarfile reads as sparse
        assert tar.getmembers()[0].issparse() and tar.getmembers()[0].size == 64 << 20
    d = hostile.engine(layer)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsafeLayer, match="sparse"):
        pull_remote(hostile.url, f"{REPO}@{d}", out / "engine")
    assert _nothing_at(out / "engine")


def _tar(*members: tuple[str, bytes | None]) -> bytes:
    """Members in order: (name, content) a regular file, (name, None) a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


LONG = "n" * 300  # over NAME_MAX (255) on every filesystem Kiln runs on


@pytest.mark.parametrize("members,named", [
    ([("config.json", b"{}"), ("a", b"x"), ("a", None)], "a"),  # a file, then a directory of that name
    ([("config.json", b"{}"), ("a", b"x"), ("a/b", b"y")], "a/b"),  # a file under a file
    ([("config.json", b"{}"), ("a", b"x"), ("a", b"y")], "a"),  # the same file twice
    ([("config.json", b"{}"), ("d", None), ("d", b"y")], "d"),  # a directory, then a file of that name
    ([("config.json", b"{}"), (LONG, b"x")], LONG),  # a name the filesystem cannot hold
], ids=["file-then-dir", "file-under-file", "duplicate-file", "dir-then-file", "name-too-long"])
def test_a_layer_whose_members_collide_or_cannot_be_named_is_refused_naming_the_member(hostile, tmp_path, members,
                                                                                        named):
    """These ended in `internal error: NotADirectoryError/FileExistsError/OSError` (exit 3)."""
    d = hostile.engine(_tar(*members))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsafeLayer, match=f"refusing {named!r}") as refused:
        pull_remote(hostile.url, f"{REPO}@{d}", out / "engine")
    assert "\n" not in refused.value.message
    assert _nothing_at(out / "engine")


def test_an_endless_manifest_is_cut_at_4_mib(hostile, tmp_path):
    digest = "sha256:" + "1" * 64

    def endless():
        for _ in range(ENDLESS_MIB):  # chunked: no Content-Length to check up front
            yield b" " * (1 << 20)

    hostile.routes[f"/v2/{REPO}/manifests/{digest}"] = endless
    with pytest.raises(DigestMismatch, match="over the"):
        pull_remote(hostile.url, f"{REPO}@{digest}", tmp_path / "engine")
    assert hostile.sent < MANIFEST_MAX + SOCKET_SLACK  # the client stopped reading; the server could not go on
    assert not (tmp_path / "engine").exists()


def test_a_declared_oversized_manifest_is_refused_unread(hostile, tmp_path):
    digest = "sha256:" + "2" * 64
    hostile.routes[f"/v2/{REPO}/manifests/{digest}"] = b"{" * (MANIFEST_MAX + 1)
    with pytest.raises(DigestMismatch, match="over the"):
        pull_remote(hostile.url, f"{REPO}@{digest}", tmp_path / "engine")


def test_a_config_declaring_a_huge_size_is_refused_before_download(hostile, tmp_path):
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    d = hostile.engine(layer.getvalue(), config_size=1 << 40)
    with pytest.raises(DigestMismatch, match="image config"):
        pull_remote(hostile.url, f"{REPO}@{d}", tmp_path / "engine")
    assert not [p for p in hostile.asked if "/blobs/" in p]  # nothing downloaded


def test_layers_over_the_configured_maximum_are_refused_before_download(hostile, tmp_path, monkeypatch):
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("rank0.engine")
        info.size = 300_000
        tar.addfile(info, io.BytesIO(b"z" * info.size))
    d = hostile.engine(layer.getvalue())
    monkeypatch.setenv("KILN_PULL_MAX_BYTES", "100000")
    with pytest.raises(DigestMismatch, match="KILN_PULL_MAX_BYTES"):
        pull_remote(hostile.url, f"{REPO}@{d}", tmp_path / "engine")
    assert not [p for p in hostile.asked if "/blobs/" in p]
    monkeypatch.setenv("KILN_PULL_MAX_BYTES", "1000000")  # within the bound it pulls
    assert pull_remote(hostile.url, f"{REPO}@{d}", tmp_path / "engine").size == len(layer.getvalue())
    assert (tmp_path / "engine" / "rank0.engine").stat().st_size == 300_000


def test_a_layer_longer_than_its_descriptor_stops_at_the_descriptor(hostile, tmp_path):
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("a")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"a"))
    d = hostile.engine(layer.getvalue())
    ld = sha256_bytes(layer.getvalue())

    def endless():
        for _ in range(ENDLESS_MIB):
            yield b"\0" * (1 << 20)

    hostile.routes[f"/v2/{REPO}/blobs/{ld}"] = endless
    with pytest.raises(DigestMismatch, match="longer than"):
        pull_remote(hostile.url, f"{REPO}@{d}", tmp_path / "engine")
    assert hostile.sent < SOCKET_SLACK  # the client stopped at the descriptor's size; the server could not go on
    assert not (tmp_path / "engine").exists()


def test_a_content_encoded_blob_is_refused_not_inflated(hostile, tmp_path):
    import gzip

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("a")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"a"))
    d = hostile.engine(layer.getvalue())
    ld = sha256_bytes(layer.getvalue())
    hostile.routes[f"/v2/{REPO}/blobs/{ld}"] = gzip.compress(layer.getvalue())
    hostile.headers[f"/v2/{REPO}/blobs/{ld}"] = {"Content-Encoding": "gzip"}
    with pytest.raises(DigestMismatch, match="Content-Encoding"):
        pull_remote(hostile.url, f"{REPO}@{d}", tmp_path / "engine")


def _small_layer() -> bytes:
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    return layer.getvalue()


def _referrer(subject: str, payload_desc: dict, artifact_type: str) -> tuple[str, bytes]:
    m = canonical_json({"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "artifactType": artifact_type,
                        "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                                   "digest": sha256_bytes(b"{}"), "size": 2},
                        "layers": [payload_desc],
                        "subject": {"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": subject, "size": 1}})
    return sha256_bytes(m), m


def test_verify_key_refuses_unsigned_foreign_and_oversized_signatures(hostile, tmp_path):
    from artifacts.signing import BUNDLE_TYPE

    keys = {"sha256:" + "e" * 64: b"unused"}
    d = hostile.engine(_small_layer())
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SignatureInvalid, match="unsigned"):  # no referrers API at all
        pull_remote(hostile.url, f"{REPO}@{d}", out / "engine", verify_keys=keys)
    assert _nothing_at(out / "engine")
    # a "signature" about another engine is not this engine's
    sig = b'{"not": "a bundle"}'
    other, other_m = _referrer("sha256:" + "3" * 64, {"mediaType": BUNDLE_TYPE, "digest": sha256_bytes(sig),
                                                      "size": len(sig)}, BUNDLE_TYPE)
    index = canonical_json({"schemaVersion": 2, "manifests": [
        {"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": other, "size": len(other_m), "artifactType": BUNDLE_TYPE}]})
    hostile.routes.update({f"/v2/{REPO}/referrers/{d}": index, f"/v2/{REPO}/manifests/{other}": other_m,
                           f"/v2/{REPO}/blobs/{sha256_bytes(sig)}": sig})
    with pytest.raises(SignatureInvalid, match="unsigned"):
        pull_remote(hostile.url, f"{REPO}@{d}", out / "engine", verify_keys=keys)
    assert _nothing_at(out / "engine")
    # one that declares a gigabyte is refused before it is downloaded
    huge, huge_m = _referrer(d, {"mediaType": BUNDLE_TYPE, "digest": "sha256:" + "4" * 64, "size": 1 << 30},
                             BUNDLE_TYPE)
    hostile.routes.update({f"/v2/{REPO}/referrers/{d}": canonical_json({"schemaVersion": 2, "manifests": [
        {"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": huge, "size": len(huge_m), "artifactType": BUNDLE_TYPE}]}),
        f"/v2/{REPO}/manifests/{huge}": huge_m})
    with pytest.raises(DigestMismatch, match="a signature"):
        pull_remote(hostile.url, f"{REPO}@{d}", out / "engine", verify_keys=keys)
    assert _nothing_at(out / "engine") and not [p for p in hostile.asked if "4444" in p]
    # without verify keys the pull works and writes no model.sig it cannot place
    hostile.routes[f"/v2/{REPO}/referrers/{d}"] = index
    got = pull_remote(hostile.url, f"{REPO}@{d}", out / "engine")
    assert not got.signed and not (out / "engine" / "model.sig").exists()


def test_a_denied_engine_is_reported_as_refused_not_as_a_missing_token():
    """403 DENIED (a revoked engine) names the engine and its reason; other 401/403s point at KILN_TOKEN."""
    import httpx

    from api.pull import _error

    body = {"errors": [{"code": "DENIED", "message": "engine sha256:ab was revoked: bad tokenizer"}]}
    denied = _error(httpx.Response(403, json=body), "manifest")
    assert denied.field == "ref" and "revoked: bad tokenizer" in denied.message and "allow=revoked" in denied.fix
    unauthorized = _error(httpx.Response(401, json={"errors": [{"code": "UNAUTHORIZED", "message": "no"}]}), "manifest")
    assert unauthorized.field == "KILN_TOKEN"


@pytest.mark.parametrize("other", ["port", "localhost"])
def test_a_redirect_to_another_origin_does_not_carry_the_token(hostile, tmp_path, monkeypatch, other):
    """KILN_TOKEN goes to the server named by --server only: a blob redirected to another origin (another port, or
    ``localhost`` for ``127.0.0.1``) is fetched there without it (httpx drops Authorization across origins), and
    the pull still verifies every byte. Kiln's pull client asks no token service (no realm is followed)."""
    layer = _small_layer()
    d = hostile.engine(layer)
    ld = sha256_bytes(layer)
    blob = f"/v2/{REPO}/blobs/{ld}"
    elsewhere = Hostile()
    try:
        if other == "port":
            target, where = elsewhere, f"{elsewhere.url}/presigned/{ld}"
        else:
            target, where = hostile, hostile.url.replace("127.0.0.1", "localhost") + f"/presigned/{ld}"
        target.routes[f"/presigned/{ld}"] = layer
        hostile.routes[blob], hostile.status[blob], hostile.headers[blob] = b"", 307, {"Location": where}
        monkeypatch.setenv("KILN_TOKEN", "kiln-secret-token")
        got = pull_remote(hostile.url, f"{REPO}@{d}", tmp_path / "engine")
        assert got.digest == d and (tmp_path / "engine" / "config.json").read_bytes() == b"{}"
        assert hostile.authorization[blob] == "Bearer kiln-secret-token"
        assert f"/presigned/{ld}" in target.authorization
        assert target.authorization[f"/presigned/{ld}"] is None
    finally:
        elsewhere.close()
