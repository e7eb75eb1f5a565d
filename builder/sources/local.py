"""A local directory or ``file://`` URL: its identity is sha256 over its file manifest (relative path, size,
sha256 of bytes); it needs no download."""

from __future__ import annotations

import copy
import json
import os
import uuid
from pathlib import Path

from builder.sources.base import Access, ResolvedCheckpoint, SourceIO, read_config_file
from kiln.digests import sha256_file, sha256_json
from kiln.errors import CheckpointNotFound
from kiln.sources import local_path


def file_manifest(directory: Path) -> list[dict]:
    """Every regular file under ``directory`` (hidden files and folders skipped), sorted by path."""
    entries = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        digest, size = sha256_file(path)
        entries.append({"path": rel.as_posix(), "size": size, "sha256": digest})
    return entries


def _fingerprint(directory: Path) -> str:
    """Cheap identity of a directory's current content: paths, sizes, mtimes, ctimes and inodes (as git's index
    does) of the files :func:`file_manifest` would hash."""
    return sha256_json({"dir": str(directory), "entries": stat_entries(directory)})


def stat_entries(directory: Path) -> list[list]:
    """``[path, size, mtime_ns, ctime_ns, inode]`` of the files :func:`file_manifest` hashes — the same walk
    (symlinked folders are not entered, symlinked files are followed, hidden names skipped), sorted by path,
    done with ``os.scandir`` because the service runs it on every request for the folder."""
    entries: list[list] = []

    def walk(folder: str, prefix: str) -> None:
        with os.scandir(folder) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, f"{prefix}{entry.name}/")
                elif entry.is_file():
                    st = entry.stat()
                    # ctime changes on every write and cannot be set back by utime(), unlike mtime
                    entries.append([prefix + entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])

    walk(str(directory), "")
    entries.sort()
    return entries


#: fingerprint → (digest, manifest, config), in front of the memo files: the service resolves the same folder on
#: every request for it, and re-reading and re-hashing its manifest would cost more than the fingerprint. The
#: fingerprint covers config.json's stat too, so a changed config is read again.
_MEMO: dict[str, tuple[str, list[dict], dict]] = {}


def identify(ref: str, access: Access) -> tuple[ResolvedCheckpoint, bool]:
    path = local_path(ref)
    if not path.is_dir():
        raise CheckpointNotFound(f"{path.name or path} is not a directory", field="checkpoint",
                                 fix="give a directory holding config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise CheckpointNotFound(f"{path.name} has no config.json", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint directory")
    fingerprint = _fingerprint(path).split(":")[1]
    if (known := _MEMO.get(fingerprint)) is not None:
        return ResolvedCheckpoint(ref, "local", known[0], path, None, known[1], copy.deepcopy(known[2]),
                                  sum(f["size"] for f in known[1])), True
    config = read_config_file(path / "config.json", path.name)
    memo = access.cache_root / "local" / (fingerprint + ".json")
    was_cached = memo.is_file()
    if was_cached:
        files = json.loads(memo.read_text())
    else:
        files = file_manifest(path)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(files))
        os.replace(tmp, memo)
    digest = sha256_json({"files": files})
    if len(_MEMO) >= 256:
        _MEMO.clear()
    _MEMO[fingerprint] = (digest, files, copy.deepcopy(config))
    return ResolvedCheckpoint(ref, "local", digest, path, None, files, config, sum(f["size"] for f in files)), was_cached


IO = SourceIO(identify, None)
