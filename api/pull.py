"""``kiln pull model@sha256:… DIR --server URL``: pull an engine from a remote Kiln's ``/v2`` registry API, and
``kiln pull host[:port]/repository@sha256:… DIR``: from any OCI registry (the team's, where ``kiln push`` put it),
with that host's credentials only (:func:`pull_registry`) — trusting nothing either sends.

Signatures and provenance are the engine's referrers: the referrers API's index, or where a registry has none
(CNCF distribution 2.8) the referrers tag schema's index ``sha256-<hex>`` that ``kiln push`` writes
(:func:`referrers_of`); each referrer manifest is checked against its digest and its ``subject``.

A ``DIR`` that already holds the engine's files (same paths, same sha256 each, nothing else: a rerun over a kept
volume) is left as it is, once the engine has been pulled and verified beside it; a ``DIR`` holding anything else
is refused.

The manifest must hash to the digest asked for; the config to its descriptor, and its ``rootfs.diff_ids`` must
name the layers; each layer is streamed to a temporary file next to ``DIR`` while it is hashed, checked against
its descriptor (digest and size), and only then unpacked — with :func:`artifacts.tarball.unpack_tar`, the same
rules as a local pull (regular files and directories only, nothing leaving the destination) — into a staging
directory that is renamed to ``DIR`` when every layer is in. Any failure leaves nothing at ``DIR``; a byte
that does not match its digest raises :class:`~kiln.errors.DigestMismatch` (exit code 3).

No size the server states is trusted: manifests, configs, referrer indexes and error bodies are read bounded as
they arrive (chunked or not), a descriptor over the bound (``KILN_PULL_MAX_BYTES`` for layers) is refused before
its download, a blob is never read past its descriptor's size, a ``Content-Encoding`` is refused rather than
inflated, and a sparse tar member is refused rather than expanded. The engine's signature bundle (a referrer) is
written beside the files as ``model.sig``; with verify keys, nothing is written unless the files and the signed
provenance verify (:mod:`artifacts.verify`).

Layers go through a local content-addressed blob cache (:mod:`artifacts.blobcache`, ``KILN_PULL_CACHE_DIR``,
default ``<KILN_HOME>/cache/blobs``): a layer already there is re-hashed and used, only the others are downloaded
(into the cache, renamed into place once verified). Two fine-tunes built on one kernel share the kernel layer's
digest, so pulling the second downloads its weights and the small engine layer only. ``KILN_PULL_MAX_BYTES`` still
bounds every layer, cached or not; the cache itself is bounded by ``KILN_PULL_CACHE_MAX_BYTES``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from artifacts.blobcache import BlobCache
from artifacts.oci import MEDIA_TYPE_IMAGE_LAYER, MEDIA_TYPE_IMAGE_MANIFEST
from artifacts.signing import BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE, SIGNATURE_FILE
from artifacts.tarball import unpack_tar
from artifacts.verify import verify_engine
from kiln import errors as e
from kiln.digests import parse_digest, sha256_file
from kiln.errors import UnsafeLayer

MEDIA_TYPE_IMAGE_INDEX = "application/vnd.oci.image.index.v1+json"
ACCEPT = ", ".join([MEDIA_TYPE_IMAGE_MANIFEST, MEDIA_TYPE_IMAGE_INDEX])
STATUS_HEADER = "Kiln-Engine-Status"
CHUNK = 1 << 20
MANIFEST_MAX = 4 << 20  # the distribution-spec lets registries refuse manifests over 4 MiB; so do we
CONFIG_MAX = 4 << 20  # an image config is JSON parsed in memory: the same bound
ERROR_MAX = 64 << 10  # an error body is read only to quote its message
SIGNATURE_MAX = 16 << 20  # a signature bundle lists every file's digest; an envelope holds the provenance
SIGNATURES_MAX = 16  # signature referrers read per engine (rotation leaves a few)


@dataclass(frozen=True)
class Pulled:
    repository: str
    digest: str
    status: str | None  # the server's Kiln-Engine-Status (fresh, stale, revoked), None when it sent none
    dest: Path
    layers: int
    size: int  # bytes of the layers
    signed: bool = False  # a model.sig was written beside the files
    verified_key: str | None = None  # with verify keys: the fingerprint of the key that verified the engine
    cached: tuple[str, ...] = ()  # digests of the layers taken from the local blob cache, not downloaded
    transferred: int = 0  # bytes of the layers downloaded (size minus what the cache held)
    already: bool = False  # DEST already held exactly these files: left as it was, nothing rewritten


def split_ref(ref: str) -> tuple[str | None, str]:
    """``model@sha256:…`` → (model, digest); a bare digest → (None, digest)."""
    name, sep, digest = ref.rpartition("@")
    return (name or None) if sep else None, parse_digest(digest, field="digest")


def _read_bounded(resp: httpx.Response, limit: int, what: str) -> bytes:
    """The body of a streamed response, refused as soon as it passes ``limit`` bytes (whatever
    ``Content-Length`` says, and with no length at all: a chunked body is counted as it arrives)."""
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise e.DigestMismatch(f"{what} from the server is {declared} bytes, over the {limit} allowed; refusing it")
    parts, got = [], 0
    for chunk in _raw_chunks(resp, what):
        got += len(chunk)
        if got > limit:
            raise e.DigestMismatch(f"{what} from the server is over the {limit} bytes allowed; refusing it")
        parts.append(chunk)
    return b"".join(parts)


def _raw_chunks(resp: httpx.Response, what: str):
    """The body as sent: a content-encoded body is refused rather than decoded (a small gzip body can inflate
    to any size before a bound could see it, and digests name the bytes as stored)."""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise e.DigestMismatch(f"{what} came with Content-Encoding {encoding!r}; only identity is accepted")
    try:
        yield from resp.iter_raw(CHUNK)
    except httpx.StreamConsumed:  # a response built in memory (an in-process transport): its bytes are all here
        yield resp.content


def _error(resp: httpx.Response, what: str) -> e.KilnError:
    """A KilnError for an OCI error response (``{"errors": [{code, message, detail}]}``), read bounded."""
    try:
        first = (json.loads(_read_bounded(resp, ERROR_MAX, "an error body")).get("errors") or [{}])[0]
    except (ValueError, AttributeError, TypeError, IndexError, e.KilnError):
        first = {}
    if not isinstance(first, dict):
        first = {}
    message = f"{what}: {str(first.get('message') or f'HTTP {resp.status_code}')[:500]}"
    code = first.get("code")
    if resp.status_code == 403 and code == "DENIED":  # known bad (revoked): not a credentials problem
        detail = first.get("detail")
        why = f" ({str(detail)[:300]})" if detail else ""
        return e.SpecError(f"{message}{why}", field="ref",
                           fix="pull another engine (kiln resolve names the fresh one); an admin may fetch a revoked "
                               "engine explicitly with ?allow=revoked")
    if resp.status_code in (401, 403):
        return e.SpecError(message, field="KILN_TOKEN", fix="set KILN_TOKEN to a token with the artifacts:read scope")
    if code == "DIGEST_INVALID" or code == "NAME_INVALID":
        return e.InvalidDigest(message, field="ref", fix="write model@sha256:<64 hex>")
    if resp.status_code == 404:
        return e.ArtifactUnknown(message, field="ref", fix="list engines with GET /v1/artifacts on the server")
    if resp.status_code < 500:
        return e.KilnError(message)
    return e.StorageUnavailable(message, fix="retry; check the server's logs")


def _get_json(client: httpx.Client, path: str, limit: int, what: str,
              headers: dict[str, str] | None = None) -> tuple[int, bytes, httpx.Headers]:
    """GET ``path`` streamed, its body read bounded by ``limit``; (status, body, headers)."""
    with client.stream("GET", path, headers={"Accept-Encoding": "identity", **(headers or {})}) as resp:
        if resp.status_code != 200:
            raise _error(resp, what)
        return resp.status_code, _read_bounded(resp, limit, what), resp.headers


def _repository_of(client: httpx.Client, digest: str) -> str:
    """The repository of an engine known only by digest, asked of the server's /v1 API."""
    try:
        _, body, _ = _get_json(client, f"/v1/artifacts/{digest}", MANIFEST_MAX, f"engine {digest}")
        name = json.loads(body)["repository"]
    except (e.KilnError, ValueError, KeyError, TypeError):
        name = None
    if not isinstance(name, str) or not name:
        raise e.ArtifactUnknown(f"the server knows no engine {digest}", field="ref",
                                fix="write model@sha256:… (see GET /v1/artifacts on the server)")
    return name


def get_manifest(client: httpx.Client, name: str, digest: str) -> tuple[dict[str, Any], bytes, str | None]:
    """The manifest ``name@digest`` (read at most 4 MiB, verified against ``digest``), its bytes, and the
    server's engine status header."""
    _, data, headers = _get_json(client, f"/v2/{name}/manifests/{digest}", MANIFEST_MAX,
                                 f"manifest {name}@{digest}", {"Accept": ACCEPT})
    if (actual := "sha256:" + hashlib.sha256(data).hexdigest()) != digest:
        raise e.DigestMismatch(f"the server sent manifest {digest} as bytes hashing to {actual}")
    try:
        manifest = json.loads(data)
    except ValueError:
        raise e.KilnError(f"{digest} is not JSON, so not an OCI manifest") from None
    if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2 or (
            manifest.get("mediaType", MEDIA_TYPE_IMAGE_MANIFEST) != MEDIA_TYPE_IMAGE_MANIFEST):
        raise e.KilnError(f"{digest} is not an OCI image manifest, so not an engine image")
    return manifest, data, headers.get(STATUS_HEADER)


def _descriptor(desc: Any, limit: int, what: str) -> tuple[str, int]:
    """(digest, size) of a descriptor, refused when malformed or when it declares more than ``limit`` bytes
    (before anything is downloaded)."""
    if not isinstance(desc, dict) or type(desc.get("size")) is not int or desc["size"] < 0:
        raise e.KilnError(f"malformed descriptor in the manifest: {str(desc)[:200]}")
    digest = parse_digest(desc.get("digest", ""), field="descriptor.digest")
    if desc["size"] > limit:
        raise e.DigestMismatch(f"{what} {digest} declares {desc['size']} bytes, over the {limit} allowed; refusing it",
                               fix="raise KILN_PULL_MAX_BYTES if this engine really is that large")
    return digest, desc["size"]


def download(client: httpx.Client, name: str, digest: str, size: int, out: BinaryIO) -> None:
    """Stream blob ``digest`` into ``out`` while hashing it, never past ``size`` bytes (already bounded by
    :func:`_descriptor`); DigestMismatch unless it matches."""
    hasher, got = hashlib.sha256(), 0
    with client.stream("GET", f"/v2/{name}/blobs/{digest}", headers={"Accept-Encoding": "identity"}) as resp:
        if resp.status_code != 200:
            raise _error(resp, f"blob {digest}")
        for chunk in _raw_chunks(resp, f"blob {digest}"):
            got += len(chunk)
            if got > size:  # never store more than the descriptor promised
                raise e.DigestMismatch(f"blob {digest} is longer than the {size} bytes its descriptor says")
            hasher.update(chunk)
            out.write(chunk)
    actual = "sha256:" + hasher.hexdigest()
    if actual != digest or got != size:
        raise e.DigestMismatch(f"blob {digest} is corrupted: received {got} bytes hashing to {actual}")


def get_small_blob(client: httpx.Client, name: str, desc: Any, limit: int, what: str) -> bytes:
    """A blob parsed in memory (a config, a signature), bounded by its descriptor and ``limit``."""
    import io

    digest, size = _descriptor(desc, limit, what)
    buf = io.BytesIO()
    download(client, name, digest, size, buf)
    return buf.getvalue()


def _get_config(client: httpx.Client, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    data = get_small_blob(client, name, manifest.get("config"), CONFIG_MAX, "the image config")
    try:
        config = json.loads(data)
    except ValueError:
        raise e.KilnError("the engine's image config is not JSON") from None
    if not isinstance(config, dict):
        raise e.KilnError("the engine's image config is not a JSON object")
    return config


def _check_dest(dest: Path) -> Path:
    """``dest`` as a pull may take it: a path that does not exist, or a directory that may hold this very engine
    already (compared file by file, by digest, once the engine is pulled and verified beside it: :func:`_pull`).
    Anything else is refused before any download."""
    dest = Path(dest)
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or not any(dest.iterdir()))):
        raise e.SpecError(f"{dest} already exists", field="dest", fix="give a path that does not exist yet")
    return dest


def _pull_settings(max_bytes: int | None, cache: BlobCache | bool) -> tuple[int, BlobCache | None]:
    """``max_bytes`` (default ``KILN_PULL_MAX_BYTES``) and the blob cache (True: the settings' one, named before
    anything is downloaded if it cannot be written)."""
    if max_bytes is None or cache is True:
        from kiln.settings import get_settings

        settings = get_settings()
        max_bytes = settings.pull_max_bytes if max_bytes is None else max_bytes
        if cache is True:
            cache = BlobCache(settings.blob_cache_dir, settings.pull_cache_max_bytes)
    return max_bytes, cache if isinstance(cache, BlobCache) else None


def pull_remote(server: str, ref: str, dest: Path, *, client: httpx.Client | None = None,
                timeout: float = 60, max_bytes: int | None = None,
                verify_keys: dict[str, bytes] | None = None, cache: BlobCache | bool = True) -> Pulled:
    """Pull engine ``ref`` (``model@sha256:…``, or a bare digest the server's /v1 API can place) from the Kiln at
    ``server`` into ``dest``, which must not exist, or already hold this engine's files (then left as it is).
    ``max_bytes`` bounds the layers together (default ``KILN_PULL_MAX_BYTES``). With ``verify_keys``
    (fingerprint → public PEM) nothing is written unless the engine's files and provenance verify with one of them.
    ``cache``: True for the settings' blob cache, False for none (every layer downloaded, nothing kept), or a
    :class:`BlobCache`. ``client`` replaces the HTTP client (tests)."""
    if client is None:  # a wrong --server is named before anything else
        from api.remote import server_root

        server_root(server)
    dest = _check_dest(dest)
    name, digest = split_ref(ref)
    max_bytes, blob_cache = _pull_settings(max_bytes, cache)
    own = client is None
    if client is None:
        # KILN_TOKEN as for `kiln build --server`; httpx drops it when a blob redirects to another host (presigned)
        headers = {"Authorization": f"Bearer {os.environ['KILN_TOKEN']}"} if os.environ.get("KILN_TOKEN") else {}
        client = httpx.Client(base_url=server_root(server), timeout=httpx.Timeout(timeout, read=timeout),
                              headers=headers, follow_redirects=True)
    try:
        try:
            return _pull(client, name or _repository_of(client, digest), digest, dest, max_bytes, verify_keys,
                         blob_cache)
        except httpx.HTTPError as exc:
            raise e.StorageUnavailable(f"cannot pull from {server}: {exc}",
                                       fix="check --server and that kiln api runs") from None
    finally:
        if own:
            client.close()


def pull_registry(reference: str, dest: Path, *, insecure: bool = False, auths: str | None = None,
                  transport: httpx.BaseTransport | None = None, timeout: float = 60, max_bytes: int | None = None,
                  verify_keys: dict[str, bytes] | None = None, cache: BlobCache | bool = True) -> Pulled:
    """Pull engine ``reference`` (``host[:port]/repository@sha256:…``) from any OCI registry into ``dest`` (as
    :func:`pull_remote`: the same checks, cache and verification), with the registry host's own credentials
    (``auths``, default ``KILN_REGISTRY_AUTHS``, else the docker config: :func:`artifacts.push.open_registry`),
    sent to that host only. https, except for a loopback host or with ``insecure``, as for ``kiln push``.
    ``Pulled.repository`` is ``host/repository``. ``transport`` replaces the HTTP transport (tests)."""
    from artifacts.push import RegistryAuth, open_registry, parse_reference

    target, digest = parse_reference(reference)
    dest = _check_dest(dest)
    max_bytes, blob_cache = _pull_settings(max_bytes, cache)
    if auths is None:
        from kiln.settings import get_settings

        auths = get_settings().registry_auths
    where = f"{target.host}/{target.repository}"
    with open_registry(target.host, insecure=insecure, auths=auths,
                       client=httpx.Client(transport=transport) if transport else None) as registry, httpx.Client(
            base_url=registry.base, auth=RegistryAuth(registry, target.repository), transport=transport,
            timeout=httpx.Timeout(timeout, read=timeout), follow_redirects=True) as client:
        try:
            got = _pull(client, target.repository, digest, dest, max_bytes, verify_keys, blob_cache)
        except e.ArtifactUnknown as exc:
            raise e.ArtifactUnknown(f"{where}: {exc.message}", field="ref",
                                    fix=f"check the digest and repository ({REGISTRY_FIX})") from None
        except httpx.HTTPError as exc:
            https = registry.base.startswith("https://")
            raise e.RegistryUnavailable(
                f"cannot pull from {target.host} ({type(exc).__name__}: {exc})", field="ref",
                fix=("is it a plain-http registry? then pass --insecure" if https else
                     "check the host and port, and that the registry is running")) from None
    return dataclasses.replace(got, repository=where)


REGISTRY_FIX = "`kiln push` prints the reference: host[:port]/repository@sha256:…"


def _index_manifests(body: bytes) -> list[Any] | None:
    """The ``manifests`` of an image index, or None when ``body`` is not one."""
    try:
        index = json.loads(body)
    except ValueError:
        return None
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list) or (
            index.get("mediaType", MEDIA_TYPE_IMAGE_INDEX) != MEDIA_TYPE_IMAGE_INDEX):
        return None
    return index["manifests"]


def referrers_of(client: httpx.Client, name: str, digest: str) -> list[Any]:
    """The descriptors of ``digest``'s referrers: the referrers API's index (``GET /v2/<name>/referrers/<digest>``),
    or where a registry has none (``404``, or an answer that is not an index: CNCF distribution 2.8) the referrers
    tag schema's index ``kiln push`` writes there (``GET /v2/<name>/manifests/sha256-<hex>``); none if neither
    exists. A tag is not a digest: what it lists is trusted no further than :func:`get_signatures` checks it."""
    try:
        _, body, _ = _get_json(client, f"/v2/{name}/referrers/{digest}", MANIFEST_MAX, f"referrers of {digest}")
        listed = _index_manifests(body)
    except e.ArtifactUnknown:
        listed = None
    if listed is not None:
        return listed
    tag = digest.replace(":", "-")
    try:
        _, body, _ = _get_json(client, f"/v2/{name}/manifests/{tag}", MANIFEST_MAX, f"the referrers tag {tag}",
                               {"Accept": MEDIA_TYPE_IMAGE_INDEX})
    except e.ArtifactUnknown:
        return []
    listed = _index_manifests(body)
    if listed is None:
        raise e.KilnError(f"the referrers tag {tag} of {name} is not an image index")
    return listed


def get_signatures(client: httpx.Client, name: str, digest: str) -> tuple[list[bytes], list[bytes]]:
    """(engine-files bundles, provenance envelopes) listed as referrers of ``digest`` (:func:`referrers_of`),
    newest first; every index, manifest and payload read bounded, each manifest checked against its digest and
    kept only if its ``subject`` is ``digest``."""
    listed = referrers_of(client, name, digest)
    out: dict[str, list[bytes]] = {BUNDLE_TYPE: [], IN_TOTO_PAYLOAD_TYPE: []}
    wanted = [d for d in reversed(listed) if isinstance(d, dict) and d.get("artifactType") in out][:SIGNATURES_MAX]
    for d in wanted:
        ref_digest = parse_digest(str(d.get("digest", "")), field="referrer.digest")
        m, _, _ = get_manifest(client, name, ref_digest)
        layers = m.get("layers")
        if (m.get("subject") or {}).get("digest") != digest or not isinstance(layers, list) or len(layers) != 1:
            continue  # not about this engine, whatever the index says
        out[d["artifactType"]].append(get_small_blob(client, name, layers[0], SIGNATURE_MAX, "a signature"))
    return out[BUNDLE_TYPE], out[IN_TOTO_PAYLOAD_TYPE]


def same_files(a: Path, b: Path) -> bool:
    """Whether directories ``a`` and ``b`` hold the same directories and regular files (by relative path and the
    sha256 of their bytes) and nothing else (a link, a device: not the same)."""

    def listing(root: Path) -> tuple[dict[str, tuple[int, Path]], set[str]] | None:
        files: dict[str, tuple[int, Path]] = {}
        dirs: set[str] = set()
        for top, dirnames, filenames in os.walk(root):
            for entry in dirnames + filenames:
                path = Path(top, entry)
                st = path.lstat()
                rel = path.relative_to(root).as_posix()
                if stat.S_ISDIR(st.st_mode):
                    dirs.add(rel)
                elif stat.S_ISREG(st.st_mode):
                    files[rel] = (st.st_size, path)
                else:
                    return None
        return files, dirs

    left, right = listing(a), listing(b)
    if left is None or right is None or left[1] != right[1] or left[0].keys() != right[0].keys():
        return False
    if any(size != right[0][rel][0] for rel, (size, _) in left[0].items()):
        return False
    return all(sha256_file(path)[0] == sha256_file(right[0][rel][1])[0] for rel, (_, path) in left[0].items())


def _layer(client: httpx.Client, name: str, digest: str, size: int, cache: BlobCache | None,
           downloads: Path) -> tuple[BinaryIO, bool]:
    """Layer ``digest`` open for reading, verified: (the file, whether it came from the cache). A layer not in the
    cache is downloaded into it (or, with no cache or one too small for it, into ``downloads``)."""
    if cache is not None and (f := cache.open(digest, size)) is not None:
        return f, True
    if cache is not None and cache.fits(size):
        return cache.add(digest, lambda out: download(client, name, digest, size, out)), False
    f = tempfile.TemporaryFile(dir=downloads)
    try:
        download(client, name, digest, size, f)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f, False


def _pull(client: httpx.Client, name: str, digest: str, dest: Path, max_bytes: int,
          verify_keys: dict[str, bytes] | None = None, cache: BlobCache | None = None) -> Pulled:
    manifest, _, status = get_manifest(client, name, digest)
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not layers:
        raise e.KilnError(f"{digest} has no layers, so it is not an engine image")
    if bad := [d.get("mediaType") if isinstance(d, dict) else d for d in layers
               if not isinstance(d, dict) or d.get("mediaType") != MEDIA_TYPE_IMAGE_LAYER]:
        raise e.KilnError(f"{digest} has layers this puller does not unpack: {str(bad)[:200]}")
    described = [_descriptor(d, max_bytes, "layer") for d in layers]
    if (total := sum(size for _, size in described)) > max_bytes:
        raise e.DigestMismatch(f"{digest}'s layers declare {total} bytes, over the {max_bytes} allowed; refusing it",
                               fix="raise KILN_PULL_MAX_BYTES if this engine really is that large")
    config = _get_config(client, name, manifest)
    if (config.get("rootfs") or {}).get("diff_ids") != [d for d, _ in described]:
        raise e.DigestMismatch(f"{digest}: config rootfs.diff_ids do not match the layers")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull-", dir=dest.parent))
    cached: list[str] = []
    transferred = 0
    try:
        with tempfile.TemporaryDirectory(prefix=f".{dest.name}.layers-", dir=dest.parent) as downloads:
            for layer_digest, size in described:
                f, hit = _layer(client, name, layer_digest, size, cache, Path(downloads))
                if hit:
                    cached.append(layer_digest)
                else:
                    transferred += size
                try:
                    with f:
                        unpack_tar(f, staging)
                except (tarfile.TarError, ValueError) as exc:
                    if cache is not None:  # what no pull may unpack is not kept either
                        cache.path(layer_digest).unlink(missing_ok=True)
                    raise UnsafeLayer(f"layer {layer_digest} is verified but not a safe engine archive: "
                                      f"{exc}") from None
        bundle: bytes | None
        if verify_keys is not None:
            try:
                bundles, envelopes = get_signatures(client, name, digest)
            except e.ArtifactUnknown:  # a registry without referrers: nothing signed, so "unsigned" below
                bundles, envelopes = [], []
            verified = verify_engine(digest, manifest, staging, bundles=bundles, envelopes=envelopes, keys=verify_keys)
            bundle, key = verified.bundle, verified.key
        else:
            try:
                bundles, _ = get_signatures(client, name, digest)
            except e.KilnError:  # an unverified pull works against registries without referrers
                bundles = []
            bundle, key = (bundles[0] if bundles else None), None
        if bundle is not None:
            if (staging / SIGNATURE_FILE).exists():
                raise UnsafeLayer(f"the engine's layer holds a {SIGNATURE_FILE}, where its signature goes")
            (staging / SIGNATURE_FILE).write_bytes(bundle)
        already = dest.exists() or dest.is_symlink()
        if already:  # a rerun (an init container over a kept volume): the same files by digest, or refused
            if dest.is_symlink() or not dest.is_dir() or not same_files(staging, dest):
                raise e.SpecError(f"{dest} already exists and does not hold {name}@{digest}", field="dest",
                                  fix="give a path that does not exist yet (or remove it)")
            shutil.rmtree(staging)
        else:
            os.chmod(staging, 0o755)
            os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if cache is not None:
            cache.evict()
    return Pulled(name, digest, status, dest, len(layers), total, bundle is not None, key, tuple(cached), transferred,
                  already)
