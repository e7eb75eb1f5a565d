"""An engine published into a KILN_HOME by the real publish stage, without a build: a few small files, signed
with that home's key (what `kiln keys public` reads). For tests of what happens after publish: resolve, report,
pull, verify, push."""

from __future__ import annotations

import hashlib
from pathlib import Path

from artifacts.factory import open_store
from artifacts.signing import configured_signer
from builder.publish import publish
from kiln import db
from kiln.settings import Settings
from kiln.spec import parse_spec


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def publish_tiny(home: Path, *, key: bytes, files: dict[str, bytes], gates: list[dict] | None = None):
    """(settings, store, the published Artifact row) of an FP8 ``balanced`` checkpoint-backend engine of
    acme/tiny for h100, made of ``files`` (relative path → bytes), its BuildKey the digest of ``key``."""
    settings = Settings(home=home)
    db.upgrade(settings.db_url)
    store, sessions = open_store(settings.store), db.session_factory(settings.db_url)
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "model_name": "acme/tiny", "precision": "fp8",
                       "profile": "balanced", "backend": "checkpoint", "target": "h100"}, [])
    engine = home.parent / "engine"
    for name, data in files.items():
        (engine / name).parent.mkdir(parents=True, exist_ok=True)
        (engine / name).write_bytes(data)
    row = publish(store, sessions, engine, spec=spec, build_key=sha(key),
                  provenance={"created": "2026-12-01T00:00:00Z", "toolchain": {"torch": "2.13"},
                              "checkpoint": {"ref": spec.checkpoint, "digest": sha(b"c"), "revision": "a" * 40}},
                  validation={"passed": True, "gates": gates or [], "metrics": {}}, signer=configured_signer(settings))
    return settings, store, row
