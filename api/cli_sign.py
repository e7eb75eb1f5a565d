"""``kiln verify`` (is this engine signed by a trusted key, files and provenance?) and ``kiln keys`` (the public
key; re-signing after a key rotation)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from api.cli_base import _context, _find_artifact, main
from kiln.errors import DigestMismatch, EngineRevoked, SignatureInvalid, SpecError, UnsafeLayer


@main.command()
@click.argument("ref")
@click.option("--key", help="public key (PEM file) to verify with; default: this Kiln's trusted keys "
                            "(KILN_SIGNING_KEY's and KILN_TRUSTED_KEYS)")
@click.option("--server", help="verify an engine of a remote Kiln (http://host:8000); needs --key")
def verify(ref: str, key: str | None, server: str | None) -> None:
    """Verify engine REF ([model@]sha256:..., a unique digest prefix, or repository:tag; with --server a
    [model@]digest): manifest digest, files against their signature, signed provenance
    and its subject. Exit 0 verified, 1 not verified (the reason on stderr), 2 bad input or a revoked engine."""
    from artifacts.verify import keys_from

    if server and not key:
        raise SpecError("a remote engine is verified against a key you hold, not one the server sends",
                        field="key", fix="pass --key kiln.pub (from `kiln keys public` on the signing Kiln)")
    try:
        if server:
            from api.pull import pull_remote

            with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
                try:
                    assert key is not None  # refused above without one
                    got = pull_remote(server, ref, Path(tmp) / "engine", verify_keys=keys_from(key))
                except (DigestMismatch, UnsafeLayer) as exc:
                    raise SignatureInvalid(f"tampered: {exc.message}") from None
            name, digest, signer = got.repository, got.digest, got.verified_key
        else:
            from artifacts.oci import pull_image
            from artifacts.signing import trusted_keys
            from artifacts.verify import stored_signatures, verify_engine

            keys = keys_from(key) if key else trusted_keys()
            _, store, sessions = _context()
            row = _find_artifact(sessions, ref)
            if row.status == "revoked":  # as a remote Kiln refuses it (/v2: 403)
                raise EngineRevoked(f"engine {row.digest} is revoked ({row.status_reason or 'no reason given'}); "
                                    "it is not verified", field="ref", fix="verify a fresh engine of this model")
            with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
                try:
                    manifest = pull_image(store, row.digest, Path(tmp) / "engine")
                except (DigestMismatch, ValueError) as exc:
                    raise SignatureInvalid(f"tampered: {exc}") from None
                with sessions() as s:
                    bundles, envelopes = stored_signatures(store, s, row.digest)
                verified = verify_engine(row.digest, manifest, Path(tmp) / "engine", bundles=bundles,
                                         envelopes=envelopes, keys=keys)
            name, digest, signer = row.repository, row.digest, verified.key
    except SignatureInvalid as exc:
        click.echo(f"not verified: {ref}: {exc.message}", err=True)
        sys.exit(1)
    click.echo(f"verified {name}@{digest}: engine files and signed provenance, key {signer}")


@main.group()
def keys() -> None:
    """The signing key: its public half, and re-signing engines after a rotation."""


@keys.command("public")
@click.option("--trusted", is_flag=True, help="every trusted key (the signing key's first), not only the signing key")
@click.option("--server", help="the public key of a remote Kiln (http://host:8000; its GET /v1/keys) instead of "
                               "this machine's")
def keys_public(trusted: bool, server: str | None) -> None:
    """Print the signing key's public key as PEM (what deployers pass to model_signing or --verify-key): this
    machine's (KILN_SIGNING_KEY, or the key its builds generated under KILN_HOME/keys), or with --server a
    remote Kiln's. Never makes a key: with none here it says so and exits 2."""
    if server:
        from api.remote import fetch_public_keys

        pems = fetch_public_keys(server)
        click.echo("".join(pems if trusted else pems[:1]), nl=False)
        return
    from artifacts.signing import existing_signer, trusted_keys
    from kiln.settings import get_settings

    settings = get_settings()
    found = trusted_keys(settings, create=False) if trusted else (
        {s.fingerprint: s.public_pem} if (s := existing_signer(settings)) is not None else {})
    if not found:
        raise SpecError(f"no signing key on this machine: it is unset and {settings.home_dir}/keys holds none "
                        "(keys are made by the Kiln that signs engines)", field="KILN_SIGNING_KEY",
                        fix="print the signing Kiln's key: kiln keys public --server http://host:8000")
    click.echo(b"".join(found.values()).decode(), nl=False)


@keys.command("resign")
@click.argument("digests", nargs=-1)
@click.option("--all", "every", is_flag=True, help="every engine not yet signed by the current signing key")
def keys_resign(digests: tuple[str, ...], every: bool) -> None:
    """Sign existing engines with the current signing key (admin; after a rotation, or for engines published
    before signing): new signature and provenance referrers beside the old ones."""
    from sqlalchemy import select

    from artifacts.oci import pull_image, read_manifest
    from artifacts.signing import configured_signer
    from builder.attest import SIGNATURE_KEY_ANNOTATION, SIGNED_TYPES, sign_engine
    from kiln.tables import Artifact, Referrer

    if not digests and not every:
        raise SpecError("name the engines to re-sign", field="digests", fix="give DIGEST… or --all")
    settings, store, sessions = _context()
    signer = configured_signer(settings)
    with sessions() as s:
        rows = [_find_artifact(sessions, d) for d in digests] if digests else list(s.scalars(select(Artifact)))
        done = {r.subject for r in s.scalars(select(Referrer).where(Referrer.artifact_type == SIGNED_TYPES[0]))
                if (r.annotations or {}).get(SIGNATURE_KEY_ANNOTATION) == signer.fingerprint}
    count = 0
    for row in rows:
        if every and row.digest in done:
            continue
        manifest = read_manifest(store, row.digest)
        with tempfile.TemporaryDirectory(prefix="kiln-resign-") as tmp:
            pull_image(store, row.digest, Path(tmp) / "engine")
            signed = sign_engine(store, signer, manifest_digest=row.digest, manifest_size=store.stat(row.digest).size,
                                 layer_digests=[d["digest"] for d in manifest.get("layers", [])],
                                 engine_dir=Path(tmp) / "engine", repository=row.repository,
                                 provenance=row.provenance or {}, validation=row.validation or {},
                                 annotations={"dev.kiln.build-key": row.build_key})
        with sessions() as s:
            for ref in signed:
                s.add(Referrer(subject=row.digest, repository=row.repository, **ref))
            s.commit()
        count += 1
        click.echo(f"signed {row.repository}@{row.digest} with {signer.fingerprint}")
    click.echo(f"{count} engine(s) signed with key {signer.fingerprint}")
