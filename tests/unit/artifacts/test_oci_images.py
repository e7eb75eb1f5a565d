"""Engine images as OCI images: deterministic layers and digests, spec-shaped JSON, referrers,
and pulls that verify every byte and leave nothing behind when they fail."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from artifacts import (
    EMPTY_DESCRIPTOR,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_LAYER,
    MEDIA_TYPE_IMAGE_MANIFEST,
    LocalBlobStore,
    descriptor,
    pull_image,
    push_engine_image,
    push_referrer,
    read_config,
    read_manifest,
    write_tar,
)
from kiln.digests import canonical_json, sha256_bytes, sha256_file
from kiln.errors import BlobUnknown, DigestMismatch

LABELS = {"dev.kiln.build-key": "sha256:" + "1" * 64, "dev.kiln.precision": "fp8"}
ANNOTATIONS = {"org.opencontainers.image.title": "tiny-llama fp8 sm90"}


def make_engine(root: Path, *, mtime: int = 1_700_000_000, mode: int = 0o600) -> Path:
    """A small engine directory; ``mtime`` and ``mode`` vary what must not change the digest."""
    files = {"config.json": b'{"version": "1.2.1"}', "rank0.engine": b"\x01" * 70_000,
             "tokenizer/vocab.json": b"{}", "tokenizer/merges.txt": b"a b\n"}  # fmt: skip
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
        os.utime(path, (mtime, mtime))
    return root


@pytest.fixture
def local(tmp_path: Path) -> LocalBlobStore:
    return LocalBlobStore(tmp_path / "store")


def push(store, engine: Path):
    return push_engine_image(store, engine, annotations=ANNOTATIONS, labels=LABELS)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- layers ---------------------------------------------------------------------------------------
def test_write_tar_is_deterministic_and_normalised(tmp_path):
    a = make_engine(tmp_path / "a", mtime=1, mode=0o600)
    b = make_engine(tmp_path / "b", mtime=2_000_000_000, mode=0o640)
    write_tar(a, tmp_path / "a.tar")
    write_tar(b, tmp_path / "b.tar")
    assert sha256_file(tmp_path / "a.tar") == sha256_file(tmp_path / "b.tar")
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "config.json", "rank0.engine", "tokenizer", "tokenizer/merges.txt", "tokenizer/vocab.json"
    ]  # fmt: skip
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert m.mode == (0o755 if m.isdir() else 0o644)


def test_an_engine_packed_in_two_homes_is_one_layer_without_kilns_records(tmp_path):
    """Two workers' copies of one engine: other absolute paths, other mtimes and modes, each with its own stage
    record (``.complete``, which names its own paths and times): the same bytes, and no record in them."""
    from artifacts.tarball import tar_chunks

    homes = []
    for i, (mtime, mode) in enumerate([(1, 0o600), (2_000_000_000, 0o664)]):
        engine = make_engine(tmp_path / f"home{i}" / "cache" / "compile" / ("ab"[i] * 8), mtime=mtime, mode=mode)
        (engine / ".complete").write_text(json.dumps({"dir": str(engine), "seconds": 1.5 * (i + 1)}))
        (engine / "tokenizer" / ".complete").write_bytes(b"content: only the top-level record is Kiln's")
        homes.append(engine)
    a, b = (b"".join(tar_chunks(h)) for h in homes)
    assert a == b and str(tmp_path).encode() not in a
    with tarfile.open(fileobj=io.BytesIO(a)) as tar:
        names = tar.getnames()
    assert ".complete" not in names and "tokenizer/.complete" in names
    digests = {write_tar(h, tmp_path / f"{i}.tar") for i, h in enumerate(homes)}
    images = [push(LocalBlobStore(h.parent / "store"), h) for h in homes]
    assert len(digests) == 1 and images[0].layers == images[1].layers and images[0].digest == images[1].digest
    assert images[0].layers[0].digest == digests.pop()


def _tarfile_reference(src: Path) -> bytes:
    """The same entries written by ``tarfile`` itself: the oracle for the streamed tar."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*"), key=lambda p: [c for c in p.relative_to(src).parts]):
            info = tarfile.TarInfo(path.relative_to(src).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode, info.size = 0o755 if path.stat().st_mode & 0o100 else 0o644, path.stat().st_size
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    return out.getvalue()


def test_the_streamed_tar_is_byte_for_byte_what_tarfile_writes(tmp_path):
    from artifacts.tarball import tar_chunks

    src = make_engine(tmp_path / "engine")
    (src / "empty").write_bytes(b"")
    (src / "block").write_bytes(b"b" * 512)  # exactly one block: no padding
    (src / "run.sh").write_bytes(b"#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "empty-dir").mkdir()
    deep = src / ("d" * 60) / ("e" * 60)  # a path over 100 characters needs a PAX header
    deep.mkdir(parents=True)
    (deep / ("f" * 90 + ".bin")).write_bytes(os.urandom(3000))
    (src / "naïve-ünïcode.json").write_bytes(b"{}")
    (src / "big.bin").write_bytes(os.urandom((1 << 20) + 777))  # more than one read chunk
    streamed = b"".join(tar_chunks(src))
    assert streamed == _tarfile_reference(src)
    assert len(streamed) % tarfile.RECORDSIZE == 0
    write_tar(src, tmp_path / "out.tar")
    assert (tmp_path / "out.tar").read_bytes() == streamed


def test_a_file_that_changes_size_while_packed_is_an_error(tmp_path):
    from artifacts.tarball import tar_chunks

    src = make_engine(tmp_path / "engine")
    chunks = tar_chunks(src)  # walked (sizes taken) now, read later
    (src / "config.json").write_bytes(b"{}")
    with pytest.raises(OSError, match="shrank"):
        b"".join(chunks)


def test_write_tar_refuses_symlinks(tmp_path):
    engine = make_engine(tmp_path / "engine")
    (engine / "link").symlink_to(engine / "config.json")
    with pytest.raises(ValueError, match="symlink"):
        write_tar(engine, tmp_path / "out.tar")


# -- pushing --------------------------------------------------------------------------------------
def test_equal_engines_give_equal_image_digests(tmp_path, local):
    first = push(local, make_engine(tmp_path / "a", mtime=1))
    other_store = LocalBlobStore(tmp_path / "other-store")
    second = push(other_store, make_engine(tmp_path / "b", mtime=999_999_999, mode=0o644))
    assert (first.digest, first.config_digest, first.layers) == (second.digest, second.config_digest, second.layers)
    assert push(local, tmp_path / "a").digest == first.digest  # re-push: same digest, nothing new
    relabelled = push_engine_image(local, tmp_path / "a", annotations=ANNOTATIONS, labels={"x": "y"})
    assert relabelled.digest != first.digest and relabelled.layers == first.layers


def test_manifest_and_config_follow_the_image_spec(tmp_path, local):
    image = push(local, make_engine(tmp_path / "engine"))
    raw = local.get_bytes(image.digest)
    assert raw == canonical_json(image.manifest) and sha256_bytes(raw) == image.digest
    assert (image.size, read_manifest(local, image.digest)) == (len(raw), image.manifest)
    layer = image.layers[0]
    assert image.manifest == {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
        "config": descriptor(MEDIA_TYPE_IMAGE_CONFIG, image.config_digest, local.stat(image.config_digest).size),
        "layers": [{"mediaType": MEDIA_TYPE_IMAGE_LAYER, "digest": layer.digest, "size": layer.size,
                    "annotations": {"org.opencontainers.image.title": "engine.tar"}}],  # what `oras pull` writes
        "annotations": ANNOTATIONS,
    }
    config = read_config(local, image.manifest)
    assert (config["architecture"], config["os"], config["config"]["Labels"]) == ("amd64", "linux", LABELS)
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer.digest]}  # uncompressed: diff_id == digest
    assert config["history"] and config["created"] == "1970-01-01T00:00:00Z"


def test_blobs_are_written_children_first(tmp_path, local):
    order: list[str] = []
    real = local.put_stream

    def recording_put_stream(stream, **kwargs):
        info = real(stream, **kwargs)
        order.append(info.digest)
        return info

    local.put_stream = recording_put_stream  # type: ignore[method-assign]
    image = push(local, make_engine(tmp_path / "engine"))
    assert order == [image.layers[0].digest, image.config_digest, image.digest]


def make_refit_engine(root: Path, weights: bytes, kernel: bytes = b"\x7fELF" * 9_000) -> Path:
    """An engine that is a kernel and its weights (aot-inductor's: engine.json names both files)."""
    root.mkdir(parents=True)
    meta = {"kernel": {"file": "model.pt2"}, "weights": {"file": "weights.safetensors", "digest": sha256_bytes(weights)}}
    for name, data in {"model.pt2": kernel, "weights.safetensors": weights, "engine.json": canonical_json(meta),
                       "tokenizer.json": b"{}"}.items():
        (root / name).write_bytes(data)
    (root / ".complete").write_text("{}")  # a stage record: in no layer
    return root


def test_two_engines_on_one_kernel_share_the_kernel_layer(tmp_path, local):
    """Kernel, weights, then the rest, each a titled layer: a fine-tune's image shares its base's kernel blob and
    differs in the weights; a pull puts the directory back together."""
    base = push(local, make_refit_engine(tmp_path / "base", b"\x01" * 50_000))
    tuned = push(local, make_refit_engine(tmp_path / "tuned", b"\x02" * 50_000))
    titles = [[d["annotations"]["org.opencontainers.image.title"] for d in i.manifest["layers"]] for i in (base, tuned)]
    assert titles == [["kernel.tar", "weights.tar", "engine.tar"]] * 2
    assert base.layers[0].digest == tuned.layers[0].digest  # the kernel, stored once
    assert base.layers[1].digest != tuned.layers[1].digest and base.layers[2].digest != tuned.layers[2].digest
    assert read_config(local, tuned.manifest)["rootfs"]["diff_ids"] == [layer.digest for layer in tuned.layers]
    with tarfile.open(fileobj=io.BytesIO(local.get_bytes(tuned.layers[0].digest))) as t:
        assert t.getnames() == ["model.pt2"]
    pull_image(local, tuned.digest, tmp_path / "pulled")
    assert tree(tmp_path / "pulled") == {k: v for k, v in tree(tmp_path / "tuned").items() if k != ".complete"}


@pytest.mark.parametrize("meta", [None, {"kernel": {"file": "model.pt2"}}, {"kernel": {"file": "gone.pt2"},
                                                                            "weights": {"file": "weights.safetensors"}}])
def test_an_engine_that_is_not_a_kernel_and_its_weights_is_one_layer(tmp_path, local, meta):
    engine = make_refit_engine(tmp_path / "e", b"\x01" * 100)
    if meta is None:
        (engine / "engine.json").unlink()
    else:
        (engine / "engine.json").write_bytes(canonical_json(meta))
    image = push(local, engine)
    assert [d["annotations"]["org.opencontainers.image.title"] for d in image.manifest["layers"]] == ["engine.tar"]


def test_referrer_is_an_artifact_manifest_about_its_subject(tmp_path, local):
    image = push(local, make_engine(tmp_path / "engine"))
    subject = descriptor(MEDIA_TYPE_IMAGE_MANIFEST, image.digest, image.size)
    report = b'{"perplexity": 41.0}'
    digest = push_referrer(local, subject, artifact_type="application/vnd.kiln.validation.v1+json",
                           payload=report, payload_media_type="application/json", annotations={"k": "v"})  # fmt: skip
    manifest = read_manifest(local, digest)
    assert manifest["artifactType"] == "application/vnd.kiln.validation.v1+json"
    assert manifest["subject"] == subject and manifest["annotations"] == {"k": "v"}
    assert manifest["config"] == EMPTY_DESCRIPTOR and local.get_bytes(EMPTY_DESCRIPTOR["digest"]) == b"{}"
    assert manifest["layers"] == [descriptor("application/json", sha256_bytes(report), len(report))]
    assert local.get_bytes(manifest["layers"][0]["digest"]) == report
    titled = read_manifest(local, push_referrer(local, subject, artifact_type="a/b", payload=report,
                                                payload_media_type="a/b", annotations={}, title="report.json"))
    assert titled["layers"][0]["annotations"] == {"org.opencontainers.image.title": "report.json"}


def test_referrer_needs_a_stored_subject(local):
    subject = descriptor(MEDIA_TYPE_IMAGE_MANIFEST, "sha256:" + "0" * 64, 10)
    with pytest.raises(BlobUnknown):
        push_referrer(local, subject, artifact_type="a/b", payload=b"x", payload_media_type="a/b", annotations={})


# -- pulling --------------------------------------------------------------------------------------
def test_pull_reproduces_the_engine_directory(tmp_path, store):  # on every backend
    engine = make_engine(tmp_path / "engine")
    image = push(store, engine)
    assert pull_image(store, image.digest, tmp_path / "pulled" / "engine") == image.manifest
    assert tree(tmp_path / "pulled" / "engine") == tree(engine)
    assert os.listdir(tmp_path / "pulled") == ["engine"]  # no staging left next to it


def test_pull_refuses_a_corrupted_layer_and_leaves_nothing(tmp_path, backend):
    image = push(backend.store, make_engine(tmp_path / "engine"))
    layer = image.layers[0].digest
    backend.corrupt(layer, backend.store.get_bytes(layer).replace(b"\x01" * 100, b"\x02" * 100, 1))
    with pytest.raises(DigestMismatch, match=layer):
        pull_image(backend.store, image.digest, tmp_path / "out" / "engine")
    assert os.listdir(tmp_path / "out") == []


def test_pull_refuses_an_existing_destination(tmp_path, local):
    image = push(local, make_engine(tmp_path / "engine"))
    (tmp_path / "dest").mkdir()
    with pytest.raises(FileExistsError):
        pull_image(local, image.digest, tmp_path / "dest")


def _hostile_layer(kind: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo({"dotdot": "../escaped", "absolute": "/tmp/escaped"}.get(kind, "entry"))
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "../../etc/passwd"
        elif kind == "device":
            info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
        info.size = 4 if info.type == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(b"evil") if info.size else None)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device"])
def test_pull_refuses_unsafe_archives(tmp_path, local, kind):
    layer = local.put_bytes(_hostile_layer(kind))
    config = local.put_bytes(canonical_json({"rootfs": {"type": "layers", "diff_ids": [layer.digest]}}))
    manifest = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
                "config": descriptor(MEDIA_TYPE_IMAGE_CONFIG, config.digest, config.size),
                "layers": [descriptor(MEDIA_TYPE_IMAGE_LAYER, layer.digest, layer.size)]}  # fmt: skip
    digest = local.put_bytes(canonical_json(manifest)).digest
    out = tmp_path / "deep" / "out"
    with pytest.raises(ValueError, match="refusing"):
        pull_image(local, digest, out / "engine")
    assert os.listdir(out) == []
    assert not (tmp_path / "deep" / "escaped").exists()


def test_read_manifest_refuses_other_json(local):
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}
    digest = local.put_bytes(json.dumps(index).encode()).digest
    with pytest.raises(ValueError, match="not an OCI image manifest"):
        read_manifest(local, digest)
