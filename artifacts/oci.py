"""Engine images as valid OCI images (image-spec v1.1), stored in a :class:`BlobStore`.

An engine image is an ordinary OCI image manifest: uncompressed tar layers holding the engine directory (so a
layer's digest is also its ``diff_id``), each titled with the file name ``oras pull`` writes it to, and an image
config whose ``Labels`` carry provenance. An engine that is a kernel and its weights (its engine.json names both
files) has three layers — ``kernel.tar``, ``weights.tar``, then ``engine.tar`` with the rest — so engines on one
kernel (fine-tunes of one architecture) share the kernel layer's blob; any other engine is one ``engine.tar``. Reports and signatures attach as *referrers*: artifact manifests
whose ``subject`` names the engine manifest. Standard OCI clients can therefore pull, inspect
and discover them through the registry's ``/v2`` API.

Blobs are written children first (layers, then config, then manifest), so a manifest never names
a missing blob. Manifests and configs are canonical JSON (sorted keys, no whitespace), so equal
inputs give equal digests; :func:`~artifacts.tarball.tar_chunks` makes equal directories give equal layers.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, cast

from artifacts.interfaces import BlobInfo, BlobStore, Survey
from artifacts.tarball import INTERNAL_NAMES, ChunkReader, HashingReader, tar_chunks, unpack_tar
from kiln.digests import canonical_json, parse_digest, sha256_bytes
from kiln.errors import DigestMismatch, StorageUnavailable

PULL_ATTEMPTS = 3

MEDIA_TYPE_IMAGE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_IMAGE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_IMAGE_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPE_EMPTY = "application/vnd.oci.empty.v1+json"

ANNOTATION_TITLE = "org.opencontainers.image.title"
ENGINE_LAYER_TITLE = "engine.tar"
"""The engine layer's ``org.opencontainers.image.title``: the file name ``oras pull`` writes the layer to (it
skips a layer without one). The layer is an uncompressed tar of the engine's files with no folder above them, so
it is named as the file it is, and carries no ``io.deis.oras.content.unpack``: oras unpacks only gzip layers
whose entries sit under the title as a folder, and would fail on this one (docs/registry.md)."""

KERNEL_LAYER_TITLE, WEIGHTS_LAYER_TITLE = "kernel.tar", "weights.tar"


def engine_layers(engine_dir: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(title, the top-level names it holds) of each layer of ``engine_dir``'s image, in order: the kernel and the
    weights files its engine.json names (``kernel.file``, ``weights.file``) each alone, then the rest; or one layer
    of everything."""
    names = tuple(sorted(n for n in os.listdir(engine_dir) if n not in INTERNAL_NAMES))
    meta = engine_dir / "engine.json"
    try:
        engine = json.loads(meta.read_text()) if meta.is_file() else {}
        kernel, weights = engine["kernel"]["file"], engine["weights"]["file"]
    except (ValueError, KeyError, TypeError):
        return [(ENGINE_LAYER_TITLE, names)]
    if not isinstance(kernel, str) or not isinstance(weights, str) or kernel == weights or not {kernel, weights} <= set(names):
        return [(ENGINE_LAYER_TITLE, names)]
    rest = tuple(n for n in names if n not in (kernel, weights))
    return [(KERNEL_LAYER_TITLE, (kernel,)), (WEIGHTS_LAYER_TITLE, (weights,)), (ENGINE_LAYER_TITLE, rest)]


EMPTY_JSON = b"{}"
EMPTY_DESCRIPTOR: dict[str, Any] = {
    "mediaType": MEDIA_TYPE_EMPTY,
    "digest": sha256_bytes(EMPTY_JSON),
    "size": len(EMPTY_JSON),
    "data": base64.b64encode(EMPTY_JSON).decode(),
}
"""The image-spec's empty descriptor (the 2-byte ``{}`` blob), config of every referrer. Copy
it before changing it."""


@dataclass(frozen=True)
class EngineImage:
    """A pushed engine image: the manifest's digest and size, the manifest itself, the config
    blob's digest and the layer blobs."""

    digest: str
    size: int
    manifest: dict[str, Any]
    config_digest: str
    layers: list[BlobInfo]


def descriptor(media_type: str, digest: str, size: int, **extra: Any) -> dict[str, Any]:
    """An OCI content descriptor; ``extra`` adds fields such as ``annotations`` or ``artifactType``."""
    return {"mediaType": media_type, "digest": parse_digest(digest), "size": size, **extra}


def push_engine_image(
    store: BlobStore,
    engine_dir: Path,
    *,
    annotations: dict[str, str],
    labels: dict[str, str],
    created: str = "1970-01-01T00:00:00Z",
    layer_survey: Mapping[str, Survey] | None = None,
) -> EngineImage:
    """Store ``engine_dir`` as an OCI image: layers (:func:`engine_layers`), then config, then manifest.

    ``labels`` go into the image config (``config.Labels``, what ``docker inspect`` shows);
    ``annotations`` into the manifest. ``created`` defaults to the epoch so that the digest depends
    on content only. A layer tar is never written out: the store reads it twice as it is made from the
    engine files (:meth:`~artifacts.interfaces.BlobStore.put_source`), once to learn its digest (the key,
    needed before an upload can start) and once as the upload, checked against the first read.
    ``layer_survey`` is that first read made ahead, by layer title (:func:`survey_engine_layer`).
    """
    parts = engine_layers(engine_dir)
    for _, names in parts:
        tar_chunks(engine_dir, names)  # refuses a symlink or a special file before the store is touched
    surveys = layer_survey or {}
    layers = [store.put_source(_layer_source(engine_dir, names), surveys.get(title)) for title, names in parts]
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {"Labels": dict(labels)},
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},  # uncompressed: diff_id == digest
        "history": [{"created": created, "created_by": f"kiln: engine directory as {title}"} for title, _ in parts],
    }
    config_blob = store.put_bytes(canonical_json(config))
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
        "config": descriptor(MEDIA_TYPE_IMAGE_CONFIG, config_blob.digest, config_blob.size),
        "layers": [descriptor(MEDIA_TYPE_IMAGE_LAYER, layer.digest, layer.size, annotations={ANNOTATION_TITLE: title})
                   for layer, (title, _) in zip(layers, parts)],
    }
    if annotations:
        manifest["annotations"] = dict(annotations)
    blob = store.put_bytes(canonical_json(manifest))
    return EngineImage(blob.digest, blob.size, manifest, config_blob.digest, layers)


def survey_engine_layer(store: BlobStore, engine_dir: Path) -> dict[str, Survey]:
    """The first read of each of :func:`push_engine_image`'s layers, by title, on its own: a build makes it while
    validation runs, so that publishing is one read of the engine, the upload."""
    return {title: store.survey(_layer_source(engine_dir, names)) for title, names in engine_layers(engine_dir)}


def _layer_source(engine_dir: Path, names: tuple[str, ...]) -> Callable[[], BinaryIO]:
    """Opens the tar of ``names`` of ``engine_dir``, made as it is read (a binary file object)."""
    return lambda: cast(BinaryIO, ChunkReader(tar_chunks(engine_dir, names)))


def push_referrer(
    store: BlobStore,
    subject: dict[str, Any],
    *,
    artifact_type: str,
    payload: bytes,
    payload_media_type: str,
    annotations: dict[str, str],
    title: str | None = None,
) -> str:
    """Attach ``payload`` (a report, a signature) to the manifest ``subject`` describes, as an
    image-spec 1.1 artifact manifest: ``artifactType`` set, the empty config, one layer holding
    the payload (``title``: the file name ``oras pull`` writes it to). Returns the artifact manifest's
    digest. The subject must be stored already."""
    if not artifact_type:
        raise ValueError("an artifact with the empty config needs an artifactType")
    subject = descriptor(subject["mediaType"], subject["digest"], subject["size"])
    store.stat(subject["digest"])  # BlobUnknown: never point at nothing
    store.put_bytes(EMPTY_JSON)
    layer = store.put_bytes(payload)
    manifest: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
        "artifactType": artifact_type,
        "config": dict(EMPTY_DESCRIPTOR),
        "layers": [descriptor(payload_media_type, layer.digest, layer.size,
                              **({"annotations": {ANNOTATION_TITLE: title}} if title else {}))],
        "subject": subject,
    }
    if annotations:
        manifest["annotations"] = dict(annotations)
    return store.put_bytes(canonical_json(manifest)).digest


def read_manifest(store: BlobStore, digest: str) -> dict[str, Any]:
    """The image manifest stored under ``digest`` (verified). ``ValueError`` if it is not one."""
    data = store.get_bytes(digest)
    try:
        manifest = json.loads(data)
    except ValueError:
        raise ValueError(f"{digest} is not JSON, so not an image manifest") from None
    if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2 or (
        manifest.get("mediaType", MEDIA_TYPE_IMAGE_MANIFEST) != MEDIA_TYPE_IMAGE_MANIFEST
    ):
        raise ValueError(f"{digest} is not an OCI image manifest")
    return manifest


def read_config(store: BlobStore, manifest: dict[str, Any]) -> dict[str, Any]:
    """The config blob a manifest names, verified against its descriptor's digest and size."""
    return json.loads(_read_described(store, manifest["config"]))


def pull_image(store: BlobStore, manifest_digest: str, dest_dir: Path) -> dict[str, Any]:
    """Unpack the image ``manifest_digest`` into ``dest_dir``, which must not exist yet.

    Every layer is hashed while it is unpacked, into a staging directory next to ``dest_dir``
    that is renamed into place only when all layers are verified: a failed pull (a corrupted
    layer raises :class:`DigestMismatch` naming it; an unsafe archive ``ValueError``) leaves
    nothing at ``dest_dir``. Returns the manifest.
    """
    dest_dir = Path(dest_dir)
    if dest_dir.exists() or dest_dir.is_symlink():
        raise FileExistsError(f"{dest_dir} exists; pull into a new path")
    manifest = read_manifest(store, manifest_digest)
    layers = manifest.get("layers", [])
    if bad := [d["mediaType"] for d in layers if d.get("mediaType") != MEDIA_TYPE_IMAGE_LAYER]:
        raise ValueError(f"{manifest_digest} has layers this puller does not unpack: {bad}")
    diff_ids = read_config(store, manifest).get("rootfs", {}).get("diff_ids")
    if diff_ids != [d["digest"] for d in layers]:
        raise DigestMismatch(f"{manifest_digest}: config rootfs.diff_ids do not match the layers")
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(PULL_ATTEMPTS):  # a read cut short by the store is retried from a clean staging dir
        staging = Path(tempfile.mkdtemp(prefix=f".{dest_dir.name}.pull-", dir=dest_dir.parent))
        try:
            for layer in layers:
                _unpack_layer(store, layer, staging)
            os.chmod(staging, 0o755)
            os.rename(staging, dest_dir)
            return manifest
        except StorageUnavailable:
            shutil.rmtree(staging, ignore_errors=True)
            if attempt == PULL_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * 2**attempt)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return manifest


def _unpack_layer(store: BlobStore, layer: dict[str, Any], dest: Path) -> None:
    """Unpack one layer while hashing it. When unpacking fails, the rest of the layer is still
    hashed, so that a damaged layer is reported as damaged rather than as a bad archive."""
    reader = HashingReader(store.open_range(parse_digest(layer["digest"])))
    failure: Exception | None = None
    try:
        unpack_tar(reader, dest)  # type: ignore[arg-type]
    except (tarfile.TarError, ValueError, OSError) as e:
        failure = e
    reader.drain()
    if reader.digest != layer["digest"] or reader.size != layer["size"]:
        raise DigestMismatch(
            f"layer {layer['digest']} is corrupted: read {reader.size} bytes hashing to {reader.digest}"
        )
    if failure is not None:
        raise failure


def _read_described(store: BlobStore, desc: dict[str, Any]) -> bytes:
    data = store.get_bytes(parse_digest(desc["digest"]))
    if len(data) != desc["size"]:
        raise DigestMismatch(f"blob {desc['digest']} is {len(data)} bytes, its descriptor says {desc['size']}")
    return data
