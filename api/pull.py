"""``kiln pull model@sha256:… DIR --server URL``: pull an engine from a remote Kiln's ``/v2`` registry API,
trusting nothing the server sends.

The manifest must hash to the digest asked for; the config to its descriptor, and its ``rootfs.diff_ids`` must
name the layers; each layer is streamed to a temporary file next to ``DIR`` while it is hashed, checked against
its descriptor (digest and size), and only then unpacked — with :func:`artifacts.tarball.unpack_tar`, the same
rules as a local pull (regular files and directories only, nothing leaving the destination) — into a staging
directory that is renamed to ``DIR`` when every layer is in. Any failure leaves nothing at ``DIR``; a byte
that does not match its digest raises :class:`~kiln.errors.DigestMismatch` (exit code 3).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from artifacts.oci import MEDIA_TYPE_IMAGE_LAYER, MEDIA_TYPE_IMAGE_MANIFEST
from artifacts.tarball import unpack_tar
from kiln import errors as e
from kiln.digests import parse_digest, sha256_bytes

ACCEPT = ", ".join([MEDIA_TYPE_IMAGE_MANIFEST, "application/vnd.oci.image.index.v1+json"])
STATUS_HEADER = "Kiln-Engine-Status"
CHUNK = 1 << 20
MANIFEST_MAX = 4 << 20  # the distribution-spec lets registries refuse manifests over 4 MiB; so do we


class UnsafeLayer(e.KilnError):
    """A layer whose bytes are verified but whose archive breaks the unpack rules (links, ``..``, devices)."""

    code = "unsafe_layer"


@dataclass(frozen=True)
class Pulled:
    repository: str
    digest: str
    status: str | None  # the server's Kiln-Engine-Status (fresh, stale, revoked), None when it sent none
    dest: Path
    layers: int
    size: int  # bytes of the layers


def split_ref(ref: str) -> tuple[str | None, str]:
    """``model@sha256:…`` → (model, digest); a bare digest → (None, digest)."""
    name, sep, digest = ref.rpartition("@")
    return (name or None) if sep else None, parse_digest(digest, field="digest")


def _error(resp: httpx.Response, what: str) -> e.KilnError:
    """A KilnError for an OCI error response (``{"errors": [{code, message, detail}]}``)."""
    try:
        first = (resp.json().get("errors") or [{}])[0]
    except (ValueError, AttributeError):
        first = {}
    message = f"{what}: {first.get('message') or f'HTTP {resp.status_code}'}"
    code = first.get("code")
    if resp.status_code in (401, 403):
        return e.SpecError(message, field="KILN_TOKEN", fix="set KILN_TOKEN to a token with the artifacts:read scope")
    if code == "DIGEST_INVALID" or code == "NAME_INVALID":
        return e.InvalidDigest(message, field="ref", fix="write model@sha256:<64 hex>")
    if resp.status_code == 404:
        return e.ArtifactUnknown(message, field="ref", fix="list engines with GET /v1/artifacts on the server")
    if resp.status_code < 500:
        return e.KilnError(message)
    return e.StorageUnavailable(message, fix="retry; check the server's logs")


def _repository_of(client: httpx.Client, digest: str) -> str:
    """The repository of an engine known only by digest, asked of the server's /v1 API."""
    resp = client.get(f"/v1/artifacts/{digest}")
    if resp.status_code != 200:
        raise e.ArtifactUnknown(f"the server knows no engine {digest}", field="ref",
                                fix="write model@sha256:… (see GET /v1/artifacts on the server)")
    return resp.json()["repository"]


def _get_manifest(client: httpx.Client, name: str, digest: str) -> tuple[dict[str, Any], str | None]:
    resp = client.get(f"/v2/{name}/manifests/{digest}", headers={"Accept": ACCEPT})
    if resp.status_code != 200:
        raise _error(resp, f"manifest {name}@{digest}")
    data = resp.content
    if len(data) > MANIFEST_MAX:
        raise e.DigestMismatch(f"manifest {digest} from the server is {len(data)} bytes; refusing it")
    if (actual := sha256_bytes(data)) != digest:
        raise e.DigestMismatch(f"the server sent manifest {digest} as bytes hashing to {actual}")
    try:
        manifest = json.loads(data)
    except ValueError:
        raise e.KilnError(f"{digest} is not JSON, so not an engine image") from None
    if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2 or (
            manifest.get("mediaType", MEDIA_TYPE_IMAGE_MANIFEST) != MEDIA_TYPE_IMAGE_MANIFEST):
        raise e.KilnError(f"{digest} is not an OCI image manifest, so not an engine image")
    return manifest, resp.headers.get(STATUS_HEADER)


def _descriptor(desc: Any) -> tuple[str, int]:
    if not isinstance(desc, dict) or not isinstance(desc.get("size"), int) or desc["size"] < 0:
        raise e.KilnError(f"malformed descriptor in the manifest: {desc!r}")
    return parse_digest(desc.get("digest", ""), field="descriptor.digest"), desc["size"]


def _download(client: httpx.Client, name: str, desc: dict[str, Any], out) -> None:
    """Stream one blob into ``out`` while hashing it; DigestMismatch unless it matches its descriptor."""
    digest, size = _descriptor(desc)
    hasher, got = hashlib.sha256(), 0
    with client.stream("GET", f"/v2/{name}/blobs/{digest}") as resp:
        if resp.status_code != 200:
            resp.read()
            raise _error(resp, f"blob {digest}")
        for chunk in resp.iter_bytes(CHUNK):
            got += len(chunk)
            if got > size:  # never store more than the descriptor promised
                raise e.DigestMismatch(f"blob {digest} is longer than the {size} bytes its descriptor says")
            hasher.update(chunk)
            out.write(chunk)
    actual = "sha256:" + hasher.hexdigest()
    if actual != digest or got != size:
        raise e.DigestMismatch(f"blob {digest} is corrupted: received {got} bytes hashing to {actual}")


def _get_config(client: httpx.Client, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    _download(client, name, manifest.get("config"), buf)
    try:
        return json.loads(buf.getvalue())
    except ValueError:
        raise e.KilnError("the engine's image config is not JSON") from None


def pull_remote(server: str, ref: str, dest: Path, *, client: httpx.Client | None = None,
                timeout: float = 60) -> Pulled:
    """Pull engine ``ref`` (``model@sha256:…``, or a bare digest the server's /v1 API can place) from the Kiln at
    ``server`` into ``dest``, which must not exist. ``client`` replaces the HTTP client (tests)."""
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise e.SpecError(f"{dest} already exists", field="dest", fix="give a path that does not exist yet")
    name, digest = split_ref(ref)
    own = client is None
    if client is None:
        # KILN_TOKEN as for `kiln build --server`; httpx drops it when a blob redirects to another host (presigned)
        headers = {"Authorization": f"Bearer {os.environ['KILN_TOKEN']}"} if os.environ.get("KILN_TOKEN") else {}
        client = httpx.Client(base_url=server.rstrip("/"), timeout=httpx.Timeout(timeout, read=timeout),
                              headers=headers, follow_redirects=True)
    try:
        try:
            return _pull(client, name or _repository_of(client, digest), digest, dest)
        except httpx.HTTPError as exc:
            raise e.StorageUnavailable(f"cannot pull from {server}: {exc}",
                                       fix="check --server and that kiln api runs") from None
    finally:
        if own:
            client.close()


def _pull(client: httpx.Client, name: str, digest: str, dest: Path) -> Pulled:
    manifest, status = _get_manifest(client, name, digest)
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not layers:
        raise e.KilnError(f"{digest} has no layers, so it is not an engine image")
    if bad := [d.get("mediaType") if isinstance(d, dict) else d for d in layers
               if not isinstance(d, dict) or d.get("mediaType") != MEDIA_TYPE_IMAGE_LAYER]:
        raise e.KilnError(f"{digest} has layers this puller does not unpack: {bad}")
    described = [_descriptor(d) for d in layers]
    config = _get_config(client, name, manifest)
    if config.get("rootfs", {}).get("diff_ids") != [d for d, _ in described]:
        raise e.DigestMismatch(f"{digest}: config rootfs.diff_ids do not match the layers")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull-", dir=dest.parent))
    try:
        with tempfile.TemporaryDirectory(prefix=f".{dest.name}.layers-", dir=dest.parent) as downloads:
            for i, layer in enumerate(layers):
                path = Path(downloads) / f"layer{i}.tar"
                with open(path, "wb") as out:
                    _download(client, name, layer, out)
                try:
                    with open(path, "rb") as f:
                        unpack_tar(f, staging)
                except (tarfile.TarError, ValueError) as exc:
                    raise UnsafeLayer(f"layer {layer['digest']} is verified but not a safe engine archive: "
                                      f"{exc}") from None
                path.unlink()
        os.chmod(staging, 0o755)
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Pulled(name, digest, status, dest, len(layers), sum(size for _, size in described))
