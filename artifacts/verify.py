"""Verifying an engine: its files against their OpenSSF signature bundle, and its signed provenance (DSSE,
in-toto) against the manifest it must name — with trusted keys only. One verdict, or
:class:`~kiln.errors.SignatureInvalid` with the reason: unsigned, wrong key, tampered file, subject mismatch.

The inputs are plain: the manifest (already checked against its digest), the unpacked engine directory, and the
signature referrers' payloads, newest first — so a local store and a remote registry are verified alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artifacts.signing import (IN_TOTO_PAYLOAD_TYPE, SLSA_PROVENANCE, STATEMENT_TYPE, bundle_key_hint,
                               dsse_verify, load_public_keys, fingerprint, verify_files)
from kiln.errors import SignatureInvalid


@dataclass(frozen=True)
class Verified:
    digest: str
    key: str  # fingerprint of the key that signed both the files and the provenance
    bundle: bytes  # the engine-files signature that verified (what `kiln pull` writes as model.sig)
    statement: dict[str, Any]


def keys_from(pem_file: str) -> dict[str, bytes]:
    """fingerprint → public PEM for ``--key`` / ``--verify-key`` (a file, or PEM text)."""
    return {fingerprint(p): p for p in load_public_keys(pem_file, "key")}


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


def verify_engine(digest: str, manifest: dict[str, Any], engine_dir: Path, *, bundles: list[bytes],
                  envelopes: list[bytes], keys: dict[str, bytes]) -> Verified:
    """Verify engine ``digest`` (``manifest``, its files unpacked at ``engine_dir``) with ``keys``."""
    if not bundles and not envelopes:
        raise SignatureInvalid(f"{digest} is unsigned: it has no signature referrers")
    if not bundles:
        raise SignatureInvalid(f"{digest} is unsigned: it has signed provenance but no engine-files signature")
    if not envelopes:
        raise SignatureInvalid(f"{digest} is unsigned: it has an engine-files signature but no signed provenance")
    trusted = [b for b in bundles if bundle_key_hint(b) in keys] or bundles[:1]  # none trusted: say whose it is
    bundle, files_key = None, None
    for candidate in trusted:
        try:
            files_key = verify_files(engine_dir, candidate, keys)
            bundle = candidate
            break
        except SignatureInvalid:
            if candidate is trusted[-1]:
                raise
    failure: SignatureInvalid | None = None
    for raw in envelopes:
        try:
            envelope = json.loads(raw)
            payload, key = dsse_verify(envelope, keys)
            if envelope.get("payloadType") != IN_TOTO_PAYLOAD_TYPE:
                raise SignatureInvalid(f"the provenance envelope carries {envelope.get('payloadType')!r}, "
                                       "not an in-toto Statement")
            statement = json.loads(payload)
            _check_statement(digest, manifest, statement)
        except SignatureInvalid as exc:
            failure = failure or exc
            continue
        except ValueError:
            failure = failure or SignatureInvalid("the provenance envelope is not JSON")
            continue
        assert bundle is not None and files_key is not None
        return Verified(digest, key if key == files_key else files_key, bundle, statement)
    assert failure is not None
    raise failure


def _check_statement(digest: str, manifest: dict[str, Any], statement: Any) -> None:
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE or (
            statement.get("predicateType") != SLSA_PROVENANCE):
        raise SignatureInvalid("the signed provenance is not an in-toto Statement v1 with SLSA Provenance v1")
    named = {(s.get("digest") or {}).get("sha256") for s in statement.get("subject") or [] if isinstance(s, dict)}
    needed = [digest] + [d["digest"] for d in manifest.get("layers") or []]
    if missing := [d for d in needed if _hex(d) not in named]:
        raise SignatureInvalid(f"subject mismatch: the signed provenance does not name {', '.join(missing)}")


def stored_signatures(store, session, digest: str) -> tuple[list[bytes], list[bytes]]:
    """(engine-files bundles, provenance envelopes) attached to ``digest`` in a local store, newest first; each
    read through its artifact manifest, verified against its digest by the store."""
    from sqlalchemy import select

    from artifacts.oci import read_manifest
    from artifacts.signing import BUNDLE_TYPE
    from kiln.tables import Referrer

    out: dict[str, list[bytes]] = {BUNDLE_TYPE: [], IN_TOTO_PAYLOAD_TYPE: []}
    rows = session.scalars(select(Referrer).where(Referrer.subject == digest,
                                                  Referrer.artifact_type.in_(tuple(out)))
                           .order_by(Referrer.created_at.desc(), Referrer.digest))
    for row in rows:
        m = read_manifest(store, row.digest)
        layers = m.get("layers") or []
        if (m.get("subject") or {}).get("digest") == digest and len(layers) == 1:
            out[row.artifact_type].append(store.get_bytes(layers[0]["digest"]))
    return out[BUNDLE_TYPE], out[IN_TOTO_PAYLOAD_TYPE]


def pull_local(store, sessions, digest: str, dest: Path, *, keys: dict[str, bytes] | None = None
               ) -> tuple[bool, Verified | None]:
    """Pull engine ``digest`` from a local store into ``dest`` (which must not exist) with its signature as
    ``model.sig`` beside the files; with ``keys``, nothing is left at ``dest`` unless it verifies.
    (signature written, the verdict when ``keys`` were given)."""
    import os
    import shutil
    import uuid

    from artifacts.oci import pull_image
    from artifacts.signing import SIGNATURE_FILE

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.verify-{uuid.uuid4().hex[:8]}"
    manifest = pull_image(store, digest, staging)
    try:
        with sessions() as session:
            bundles, envelopes = stored_signatures(store, session, digest)
        verified = None
        if keys is not None:
            verified = verify_engine(digest, manifest, staging, bundles=bundles, envelopes=envelopes, keys=keys)
        bundle = verified.bundle if verified else (bundles[0] if bundles else None)
        if bundle is not None:
            if (staging / SIGNATURE_FILE).exists():
                raise ValueError(f"the engine's layer holds a {SIGNATURE_FILE}, where its signature goes")
            (staging / SIGNATURE_FILE).write_bytes(bundle)
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return bundle is not None, verified
