"""resolve: a checkpoint reference becomes immutable content.

Local directories are hashed over their file manifest; ``hf://`` goes through huggingface_hub against a real
Hub cache laid out on disk here (the Hub's network cannot exist in a test); ``s3://`` goes to moto's S3 server
over real HTTP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from builder.resolve import (
    file_manifest, identify_checkpoint, materialize_checkpoint, read_model_config, resolve_checkpoint, stat_entries,
)
from kiln.digests import DIGEST_RE, sha256_json
from kiln.errors import CheckpointNotFound, SpecError

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    directory = tmp_path / "models" / "tiny"
    shutil.copytree(TINY, directory)
    return directory


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def resolve(ref, cache: Path, **kw):
    return resolve_checkpoint(str(ref), cache_root=cache, **kw)


# -- local directories -----------------------------------------------------------------------------
def test_local_digest_is_the_manifest_digest(ckpt, cache):
    resolved, cached = resolve(ckpt, cache)
    assert not cached
    assert DIGEST_RE.match(resolved.digest)
    assert resolved.kind == "local" and resolved.local_dir == ckpt.resolve() and resolved.revision is None
    assert resolved.digest == sha256_json({"files": file_manifest(ckpt)})
    assert [f["path"] for f in resolved.files] == sorted(p.name for p in TINY.iterdir())
    assert read_model_config(resolved)["model_type"] == "llama"
    assert resolved.provenance() == {"ref": str(ckpt), "kind": "local", "digest": resolved.digest, "revision": None,
                                     "files": len(resolved.files)}


def test_manifest_entries_carry_size_and_content_digest(ckpt):
    entry = next(e for e in file_manifest(ckpt) if e["path"] == "config.json")
    data = (ckpt / "config.json").read_bytes()
    assert entry == {"path": "config.json", "size": len(data), "sha256": "sha256:" + hashlib.sha256(data).hexdigest()}


def test_local_digest_is_stable(ckpt, tmp_path):
    first, _ = resolve(ckpt, tmp_path / "c1")
    second, _ = resolve(ckpt, tmp_path / "c2")
    assert first.digest == second.digest


def test_local_digest_changes_when_one_byte_changes(ckpt, cache):
    before, _ = resolve(ckpt, cache)
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    after, cached = resolve(ckpt, cache)
    assert not cached and after.digest != before.digest


def test_local_digest_changes_when_a_file_is_renamed_or_added(ckpt, cache):
    base, _ = resolve(ckpt, cache)
    (ckpt / "training.json").rename(ckpt / "training2.json")
    renamed, _ = resolve(ckpt, cache)
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "extra.txt").write_text("x")
    added, _ = resolve(ckpt, cache)
    assert len({base.digest, renamed.digest, added.digest}) == 3
    assert "sub/extra.txt" in [f["path"] for f in added.files]


def test_local_digest_is_independent_of_the_directory_path(ckpt, tmp_path, cache):
    elsewhere = tmp_path / "other" / "place" / "renamed"
    shutil.copytree(ckpt, elsewhere)
    a, _ = resolve(ckpt, cache)
    b, cached = resolve(f"file://{elsewhere}", cache)
    assert not cached  # a different directory is hashed, not taken from the other's memo
    assert a.digest == b.digest and a.local_dir != b.local_dir


def test_hidden_files_and_folders_are_ignored(ckpt, cache):
    base, _ = resolve(ckpt, cache)
    (ckpt / ".DS_Store").write_bytes(b"junk")
    (ckpt / ".cache" / "huggingface").mkdir(parents=True)
    (ckpt / ".cache" / "huggingface" / "lock").write_text("x")
    after, _ = resolve(ckpt, cache)
    assert after.digest == base.digest
    assert all(not f["path"].startswith(".") for f in after.files)


def test_missing_directory_is_checkpoint_not_found(tmp_path, cache):
    with pytest.raises(CheckpointNotFound) as info:
        resolve(tmp_path / "nope", cache)
    assert info.value.field == "checkpoint" and info.value.fix


def test_a_file_is_not_a_checkpoint_directory(ckpt, cache):
    with pytest.raises(CheckpointNotFound) as info:
        resolve(ckpt / "config.json", cache)
    assert info.value.field == "checkpoint"


def test_directory_without_config_json_is_checkpoint_not_found(ckpt, cache):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointNotFound) as info:
        resolve(ckpt, cache)
    assert info.value.field == "checkpoint"
    assert "config.json" in info.value.message


def test_unchanged_directory_is_answered_from_the_memo(ckpt, cache):
    first, cached1 = resolve(ckpt, cache)
    second, cached2 = resolve(ckpt, cache)
    assert (cached1, cached2) == (False, True)
    assert second.digest == first.digest and second.files == first.files


def test_touched_file_invalidates_the_memo(ckpt, cache):
    first, _ = resolve(ckpt, cache)
    st = (ckpt / "config.json").stat()
    os.utime(ckpt / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again, cached = resolve(ckpt, cache)
    assert not cached
    assert again.digest == first.digest  # same bytes, same digest
    assert resolve(ckpt, cache)[1] is True


def test_replaced_file_invalidates_the_memo(ckpt, cache):
    first, _ = resolve(ckpt, cache)
    path = ckpt / "config.json"
    data = path.read_bytes()
    st = path.stat()
    tmp = ckpt / "config.json.new"
    tmp.write_bytes(data.replace(b'"vocab_size": 2048', b'"vocab_size": 2049'))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime, new inode
    os.replace(tmp, path)
    again, cached = resolve(ckpt, cache)
    assert not cached and again.digest != first.digest
    assert (first.config["vocab_size"], again.config["vocab_size"]) == (2048, 2049)  # the config is read again


def test_a_memo_answer_carries_its_own_copy_of_the_config(ckpt, cache):
    first, _ = resolve(ckpt, cache)
    first.config["vocab_size"] = -1  # a caller changing its answer changes no later answer
    second, cached = resolve(ckpt, cache)
    third, _ = resolve(ckpt, cache)
    assert cached and second.config["vocab_size"] == 2048
    second.config["vocab_size"] = -2
    assert third.config["vocab_size"] == 2048 and third.config is not second.config


def test_same_size_in_place_rewrite_with_unchanged_mtime_is_detected(ckpt, cache):
    first, _ = resolve(ckpt, cache)
    path = ckpt / "config.json"
    st = path.stat()
    data = path.read_bytes()
    with open(path, "r+b") as f:  # same inode, same size
        f.write(data.replace(b'"vocab_size": 2048', b'"vocab_size": 2049'))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again, cached = resolve(ckpt, cache)
    assert again.digest != first.digest


def test_the_memo_fingerprint_walks_exactly_the_files_the_manifest_hashes(ckpt, tmp_path):
    (ckpt / "nested" / "deeper").mkdir(parents=True)
    (ckpt / "nested" / "deeper" / "w.bin").write_bytes(b"w")
    (ckpt / "nested" / ".cache").mkdir()
    (ckpt / "nested" / ".cache" / "x").write_bytes(b"x")
    (ckpt / ".hidden-file").write_bytes(b"h")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.bin").write_bytes(b"o")
    (ckpt / "linked-dir").symlink_to(outside)  # not entered, by either walk
    (ckpt / "linked-file").symlink_to(ckpt / "config.json")  # followed, by both
    paths = [e[0] for e in stat_entries(ckpt)]
    assert paths == sorted(f["path"] for f in file_manifest(ckpt))
    assert "nested/deeper/w.bin" in paths and "linked-file" in paths and "linked-dir/o.bin" not in paths


def test_a_change_in_a_nested_folder_invalidates_the_memo(ckpt, cache):
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "w.bin").write_bytes(b"1")
    first, _ = resolve(ckpt, cache)
    (ckpt / "sub" / "w.bin").write_bytes(b"2")
    again, cached = resolve(ckpt, cache)
    assert not cached and again.digest != first.digest


# -- hf:// against a real local Hub cache ----------------------------------------------------------
COMMIT_1 = "1" * 8 + "a" * 32
COMMIT_2 = "2" * 8 + "b" * 32


def _add_snapshot(repo_dir: Path, commit: str, files: dict[str, bytes]) -> None:
    """Lay out one snapshot as huggingface_hub does: content in blobs/<sha256>, symlinks in snapshots/<commit>."""
    for rel, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = repo_dir / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def _set_ref(repo_dir: Path, ref: str, commit: str) -> None:
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hub cache holding acme/tiny at two commits, with refs/main moved from the first to the second."""
    import huggingface_hub.constants as hf_constants

    home = tmp_path / "hf-home"
    hub = home / "hub"
    repo = hub / "models--acme--tiny"
    v1 = {p.name: p.read_bytes() for p in TINY.iterdir()}
    v2 = dict(v1)
    v2["generation_config.json"] = b'{"do_sample": false, "max_new_tokens": 7}'
    _add_snapshot(repo, COMMIT_1, v1)
    _set_ref(repo, "main", COMMIT_1)
    _add_snapshot(repo, COMMIT_2, v2)
    _set_ref(repo, "main", COMMIT_2)  # the branch moved
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_CACHE into a module constant at import time and resolve_checkpoint passes no
    # cache_dir, so the environment variable alone is not seen by an already-imported library: set the constant.
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return hub


def test_hf_branch_resolves_to_the_commit_it_points_at(hub_cache, cache):
    resolved, cached = resolve("hf://acme/tiny@main", cache)
    assert not cached
    assert resolved.kind == "hf" and resolved.revision == COMMIT_2
    assert resolved.local_dir.name == COMMIT_2
    assert json.loads((resolved.local_dir / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert DIGEST_RE.match(resolved.digest)
    assert resolved.digest == sha256_json({"hf": "acme/tiny", "commit": COMMIT_2})


def test_hf_default_revision_is_main(hub_cache, cache):
    assert resolve("hf://acme/tiny", cache)[0].revision == COMMIT_2


def test_hf_moved_branch_changes_the_digest(hub_cache, cache):
    old, _ = resolve(f"hf://acme/tiny@{COMMIT_1}", cache)
    new, _ = resolve("hf://acme/tiny@main", cache)
    assert old.revision == COMMIT_1 and old.local_dir.name == COMMIT_1
    assert old.digest != new.digest
    assert read_model_config(old)["model_type"] == "llama"


def test_hf_digest_never_depends_on_the_branch_name(hub_cache, cache):
    _set_ref(hub_cache / "models--acme--tiny", "release", COMMIT_2)
    by_branch, _ = resolve("hf://acme/tiny@main", cache)
    by_other, _ = resolve("hf://acme/tiny@release", cache)
    by_sha, _ = resolve(f"hf://acme/tiny@{COMMIT_2}", cache)
    assert by_branch.digest == by_other.digest == by_sha.digest


@pytest.mark.parametrize("ref", ["hf://acme/unknown@main", "hf://other/tiny", "hf://acme/tiny@no-such-branch",
                                 "hf://acme/tiny@" + "f" * 40])
def test_hf_unknown_repo_or_revision_is_checkpoint_not_found(hub_cache, cache, ref):
    with pytest.raises(CheckpointNotFound) as info:
        resolve(ref, cache)
    assert info.value.field == "checkpoint" and info.value.fix


def test_hf_snapshot_without_config_json_is_checkpoint_not_found(hub_cache, cache):
    repo = hub_cache / "models--acme--empty"
    _add_snapshot(repo, COMMIT_1, {"README.md": b"# nothing"})
    _set_ref(repo, "main", COMMIT_1)
    with pytest.raises(CheckpointNotFound, match="config.json"):
        resolve("hf://acme/empty", cache)


@pytest.mark.parametrize("revision", ["/etc", "../../x", "..", "a/../b", "/" + "1" * 40, "main/", ".hidden",
                                      "x.lock", "a b", "a:b", "a\\b", "@", "a@{1}", "x" * 256, ""])
def test_hf_revision_that_is_no_ref_name_is_refused_before_the_cache_is_read(hub_cache, cache, revision):
    with pytest.raises(SpecError) as info:
        resolve(f"hf://acme/tiny@{revision}", cache)
    assert info.value.field == "checkpoint" and "40-hex" in info.value.fix


@pytest.mark.parametrize("repo", ["../..", "acme/..", "acme/tiny/extra", "-acme/tiny", "acme/ti--ny", "acme"])
def test_hf_repo_that_is_no_hub_id_is_refused(hub_cache, cache, repo):
    with pytest.raises(SpecError) as info:
        resolve(f"hf://{repo}@main", cache)
    assert info.value.field == "checkpoint"


def test_hf_ref_file_pointing_outside_the_hub_cache_is_not_found(hub_cache, cache, tmp_path):
    outside = tmp_path / "outside" / ("3" * 40)
    shutil.copytree(TINY, outside)
    repo = hub_cache / "models--acme--tiny"
    _set_ref(repo, "evil", os.path.relpath(outside, repo / "snapshots"))
    with pytest.raises(CheckpointNotFound) as info:
        resolve("hf://acme/tiny@evil", cache)
    assert info.value.field == "checkpoint"
    _set_ref(repo, "dir", "")
    (repo / "refs" / "nested").mkdir()
    for ref in ("nested", "main/x", "dir"):  # a folder, below a file, empty: the same answer as a missing ref
        with pytest.raises(CheckpointNotFound) as again:
            resolve(f"hf://acme/tiny@{ref}", cache)
        assert again.value.message == f"acme/tiny@{ref}: no checkpoint (config.json) found"


def test_hf_identify_reads_config_json_only(hub_cache, cache):
    resolved, _ = identify_checkpoint("hf://acme/tiny@main", cache_root=cache)
    assert resolved.local_dir is None and resolved.revision == COMMIT_2
    assert resolved.config["model_type"] == "llama"


# -- s3:// against moto's server over HTTP ---------------------------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint():
    from tests.s3server import moto_s3

    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def s3_client(s3_endpoint):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="ckpts")
    for path in sorted(TINY.iterdir()):
        client.upload_file(str(path), "ckpts", f"models/tiny/{path.name}")
    client.put_object(Bucket="ckpts", Key="models/tiny-v2/config.json", Body=b"{}")  # shares the prefix's text
    return client


@pytest.fixture
def s3_calls():
    """Operations the code's boto3 clients send (observed through botocore's event hooks, not replaced)."""
    import boto3

    calls: list[str] = []

    def record(model, **_):
        calls.append(model.name)

    session = boto3._get_default_session()
    session.events.register("before-call.s3", record)
    yield calls
    session.events.unregister("before-call.s3", record)


def s3_listing(client, bucket: str, prefix: str) -> list[dict]:
    objs = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    return sorted(({"path": o["Key"][len(prefix):], "size": o["Size"], "etag": o["ETag"]} for o in objs),
                  key=lambda f: f["path"])


def test_s3_identify_reads_the_listing_and_config_json_only(s3_client, s3_endpoint, cache, s3_calls):
    resolved, cached = identify_checkpoint("s3://ckpts/models/tiny", cache_root=cache, s3_endpoint_url=s3_endpoint)
    assert not cached and resolved.kind == "s3" and resolved.local_dir is None
    # the digest: relative keys, sizes and ETags (immutable content identity), documented in builder/resolve.py
    assert resolved.digest == sha256_json({"s3": s3_listing(s3_client, "ckpts", "models/tiny/")})
    assert resolved.config == json.loads((TINY / "config.json").read_text())
    assert resolved.size == sum(p.stat().st_size for p in TINY.iterdir())
    assert s3_calls == ["ListObjectsV2", "GetObject"]  # no weights in the API process
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))


def test_s3_materialize_downloads_the_identified_bytes(s3_client, s3_endpoint, cache, s3_calls):
    resolved, _ = resolve("s3://ckpts/models/tiny", cache, s3_endpoint_url=s3_endpoint)
    assert resolved.local_dir.is_relative_to(cache)
    assert (resolved.local_dir / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()
    assert file_manifest(resolved.local_dir) == file_manifest(TINY)
    assert s3_calls.count("GetObject") == 1 + len(list(TINY.iterdir()))


def test_s3_trailing_slash_is_the_same_checkpoint(s3_client, s3_endpoint, cache):
    a, _ = resolve("s3://ckpts/models/tiny", cache, s3_endpoint_url=s3_endpoint)
    b, _ = resolve("s3://ckpts/models/tiny/", cache, s3_endpoint_url=s3_endpoint)
    assert a.digest == b.digest


def test_s3_second_resolve_reuses_the_download(s3_client, s3_endpoint, cache, s3_calls):
    first, _ = resolve("s3://ckpts/models/tiny", cache, s3_endpoint_url=s3_endpoint)
    s3_calls.clear()
    second, _ = resolve("s3://ckpts/models/tiny", cache, s3_endpoint_url=s3_endpoint)
    assert second.digest == first.digest and second.local_dir == first.local_dir
    assert s3_calls == ["ListObjectsV2", "GetObject"]  # listed and config.json read, not downloaded again
    assert not [p for p in (cache / "s3").iterdir() if p.name.startswith("staging-")]


def test_s3_changed_object_is_downloaded_again(s3_client, s3_endpoint, cache):
    first, _ = resolve("s3://ckpts/models/tiny", cache, s3_endpoint_url=s3_endpoint)
    s3_client.put_object(Bucket="ckpts", Key="models/changing/config.json", Body=b'{"v": 1}')
    a, _ = resolve("s3://ckpts/models/changing", cache, s3_endpoint_url=s3_endpoint)
    s3_client.put_object(Bucket="ckpts", Key="models/changing/config.json", Body=b'{"v": 2}')
    b, _ = resolve("s3://ckpts/models/changing", cache, s3_endpoint_url=s3_endpoint)
    assert a.digest != b.digest and first.digest not in (a.digest, b.digest)
    assert json.loads((b.local_dir / "config.json").read_text()) == {"v": 2} == b.config


def test_s3_object_rewritten_after_identify_is_not_materialized(s3_client, s3_endpoint, cache):
    s3_client.put_object(Bucket="ckpts", Key="models/moving/config.json", Body=b'{"v": 1}')
    s3_client.put_object(Bucket="ckpts", Key="models/moving/w.bin", Body=b"first")
    resolved, _ = identify_checkpoint("s3://ckpts/models/moving", cache_root=cache, s3_endpoint_url=s3_endpoint)
    s3_client.put_object(Bucket="ckpts", Key="models/moving/w.bin", Body=b"other")  # same size, new bytes
    with pytest.raises(CheckpointNotFound, match="changed"):
        materialize_checkpoint(resolved, cache_root=cache, s3_endpoint_url=s3_endpoint)
    assert not (cache / "s3" / resolved.digest.split(":")[1]).exists()


def test_s3_bucket_must_be_allowed(s3_client, s3_endpoint, cache, s3_calls):
    for buckets in ([], ["other"]):
        with pytest.raises(SpecError) as info:
            identify_checkpoint("s3://ckpts/models/tiny", cache_root=cache, s3_endpoint_url=s3_endpoint,
                                buckets=buckets)
        assert info.value.field == "checkpoint" and "KILN_CHECKPOINT_BUCKETS" in info.value.fix
    assert s3_calls == []  # refused before any request with the server's credentials
    assert identify_checkpoint("s3://ckpts/models/tiny", cache_root=cache, s3_endpoint_url=s3_endpoint,
                               buckets=["ckpts"])[0].kind == "s3"


def test_s3_checkpoint_over_the_size_limit_is_refused_from_its_listing(s3_client, s3_endpoint, cache, s3_calls):
    with pytest.raises(SpecError) as info:
        identify_checkpoint("s3://ckpts/models/tiny", cache_root=cache, s3_endpoint_url=s3_endpoint, max_bytes=1000)
    assert info.value.field == "checkpoint" and "KILN_CHECKPOINT_MAX_BYTES" in info.value.fix
    assert s3_calls == ["ListObjectsV2"]


def test_s3_missing_bucket_is_checkpoint_not_found(s3_client, s3_endpoint, cache):
    with pytest.raises(CheckpointNotFound) as info:
        resolve("s3://no-such-bucket/models/tiny", cache, s3_endpoint_url=s3_endpoint)
    assert info.value.field == "checkpoint" and info.value.fix


def test_s3_prefix_without_config_json_is_checkpoint_not_found(s3_client, s3_endpoint, cache):
    with pytest.raises(CheckpointNotFound, match="config.json"):
        resolve("s3://ckpts/models/nothing-here", cache, s3_endpoint_url=s3_endpoint)


def test_s3_object_key_cannot_write_outside_the_cache(s3_client, s3_endpoint, cache, tmp_path):
    target = tmp_path / "outside" / "escaped.txt"
    s3_client.put_object(Bucket="ckpts", Key="models/evil/config.json", Body=b"{}")
    s3_client.put_object(Bucket="ckpts", Key=f"models/evil/{target}", Body=b"pwned")  # models/evil//tmp/...
    assert s3_client.list_objects_v2(Bucket="ckpts", Prefix="models/evil//")["KeyCount"] == 1
    with pytest.raises(CheckpointNotFound) as info:  # refused, naming the key, before anything is written
        resolve("s3://ckpts/models/evil", cache, s3_endpoint_url=s3_endpoint)
    assert info.value.field == "checkpoint" and str(target) in info.value.message
    assert not target.exists()
