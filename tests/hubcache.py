"""A real local Hugging Face Hub cache, made by the tests (the Hub's network is the one thing that cannot exist
here): ``models--org--name/{blobs/<sha256>, snapshots/<commit>/<file → ../../blobs/…>, refs/<branch>}``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from tests.conftest import TINY


def repo_dir(hub: Path, repo: str) -> Path:
    return hub / ("models--" + repo.replace("/", "--"))


def add_snapshot(hub: Path, repo: str, commit: str, src: Path = TINY, *, config_note: str | None = None) -> None:
    """Snapshot ``src``'s files under ``commit``; ``config_note`` changes config.json so the content differs."""
    base = repo_dir(hub, repo)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (base / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        if f.name == "config.json" and config_note:
            cfg = json.loads(data)
            cfg["kiln_test_revision_note"] = config_note
            data = json.dumps(cfg, indent=2).encode()
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snap), link)


def set_ref(hub: Path, repo: str, branch: str, commit: str) -> None:
    refs = repo_dir(hub, repo) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / branch).write_text(commit)


def commit_sha(n: int) -> str:
    return hashlib.sha1(f"kiln-test-commit-{n}".encode()).hexdigest()


def remove(hub: Path) -> None:
    shutil.rmtree(hub, ignore_errors=True)
