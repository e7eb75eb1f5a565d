"""Signing: the key that signs engines, DSSE envelopes, and the OpenSSF model signature of engine files.

- :class:`Signer` is the whole contract a key holder meets (a KMS can implement it later): its public key as
  PEM, a fingerprint, ``sign(data)`` (ECDSA P-256 / SHA-256, DER), and ``sign_files(dir)`` (an OpenSSF
  ``model_signing`` bundle over the files of ``dir``). :class:`PemSigner` holds a PEM private key.
- The key comes from ``KILN_SIGNING_KEY`` (PEM text, or the path of a PEM file); with none configured a key is
  generated under ``KILN_HOME/keys`` on first use (mode 0600), so the embedded defaults sign too.
- Trusted keys: the signing key's public key plus ``KILN_TRUSTED_KEYS`` (PEM text, or PEM files separated by
  the path separator; a file may hold several keys) — earlier keys keep verifying after a rotation.
- A key's **fingerprint** is ``sha256:`` + the SHA-256 of its SubjectPublicKeyInfo PEM, which is also the key
  hint ``model_signing`` writes into a bundle, so a ``model.sig`` names the key that made it.
- The engine-files signature is what ``model_signing verify key --signature DIR/model.sig --public_key K DIR``
  checks: every file of the engine layer, no others (``model.sig`` itself is left out of what is hashed).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from artifacts.tarball import INTERNAL_NAMES
from kiln.errors import SignatureInvalid, SpecError

SIGNATURE_FILE = "model.sig"  # where `kiln pull` writes the engine-files bundle, beside the files
BUNDLE_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"  # the model_signing bundle, as a referrer
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"  # DSSE payloadType of an in-toto Statement
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"  # an in-toto Statement's _type
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"  # the predicateType of Kiln's provenance
DSSE_TYPE = "application/vnd.dsse.envelope.v1+json"  # media type of a DSSE envelope layer
KEY_FILE = "signing-key.pem"


class Signer(Protocol):
    public_pem: bytes
    fingerprint: str

    def sign(self, data: bytes) -> bytes:
        """ECDSA P-256 / SHA-256 signature of ``data``, DER encoded."""

    def sign_files(self, directory: Path) -> bytes:
        """The ``model_signing`` bundle (JSON bytes) over every file under ``directory`` but ``model.sig`` and
        Kiln's own records (``artifacts.tarball.INTERNAL_NAMES``, which the engine layer leaves out too)."""


def fingerprint(public_pem: bytes) -> str:
    return "sha256:" + hashlib.sha256(public_pem).hexdigest()


def _public_pem(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


class PemSigner:
    """A signer holding an ECDSA P-256 private key read from PEM (``path`` when it came from a file)."""

    def __init__(self, pem: bytes, *, path: Path | None = None, field: str = "KILN_SIGNING_KEY"):
        try:
            key = serialization.load_pem_private_key(pem, None)
        except (ValueError, TypeError):
            raise SpecError("is not a PEM private key without a password", field=field,
                            fix="generate one: openssl ecparam -name prime256v1 -genkey -noout -out kiln.pem") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
            raise SpecError("must be an ECDSA P-256 key", field=field,
                            fix="generate one: openssl ecparam -name prime256v1 -genkey -noout -out kiln.pem")
        self._key, self._pem, self._path = key, pem, path
        self.public_pem = _public_pem(key.public_key())
        self.fingerprint = fingerprint(self.public_pem)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data, ec.ECDSA(hashes.SHA256()))

    def sign_files(self, directory: Path) -> bytes:
        from model_signing import hashing, signing

        directory = Path(directory)
        if (directory / SIGNATURE_FILE).exists():
            raise ValueError(f"{directory} already holds a {SIGNATURE_FILE}; an engine may not ship one")
        with self._key_path() as key_path, tempfile.TemporaryDirectory(prefix="kiln-sig-") as tmp:
            out = Path(tmp) / SIGNATURE_FILE
            (signing.Config().use_elliptic_key_signer(private_key=key_path)
             .set_hashing_config(hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE, *sorted(INTERNAL_NAMES)]))
             .sign(directory, out))
            return out.read_bytes()

    @contextlib.contextmanager
    def _key_path(self) -> Iterator[Path]:
        """model_signing reads its key from a file: the configured one, or a private temporary copy."""
        if self._path is not None:
            yield self._path
            return
        with tempfile.TemporaryDirectory(prefix="kiln-key-") as tmp:  # 0700
            path = Path(tmp) / KEY_FILE
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self._pem)
            yield path


def _generated_key(home: Path) -> Path:
    """``KILN_HOME/keys/signing-key.pem``, made once (0600), atomically: concurrent first uses agree on one key."""
    keys = home / "keys"
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = keys / KEY_FILE
    if path.exists():
        return path
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd, tmp = tempfile.mkstemp(prefix=".key-", dir=keys)  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs is the key
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return path


def _pem_or_file(value: str, field: str) -> tuple[bytes, Path | None]:
    if value.lstrip().startswith("-----BEGIN"):
        return value.strip().encode() + b"\n", None
    path = Path(value).expanduser()
    try:
        return path.read_bytes(), path
    except OSError as exc:
        raise SpecError(f"cannot read the key file: {exc.strerror}", field=field,
                        fix="give PEM text or the path of a readable PEM file") from None


@lru_cache(maxsize=8)
def _signer(signing_key: str | None, home: str) -> PemSigner:
    if signing_key:
        pem, path = _pem_or_file(signing_key, "KILN_SIGNING_KEY")
        return PemSigner(pem, path=path)
    path = _generated_key(Path(home))
    return PemSigner(path.read_bytes(), path=path)


def configured_signer(settings: Any = None) -> Signer:
    """The signer the settings configure (``KILN_SIGNING_KEY``, else the key generated under ``KILN_HOME``)."""
    if settings is None:
        from kiln.settings import get_settings

        settings = get_settings()
    return _signer(settings.signing_key, str(settings.home_dir))


def existing_signer(settings: Any = None) -> Signer | None:
    """The configured signer when its key exists already (``KILN_SIGNING_KEY``, or a key generated under
    ``KILN_HOME`` earlier), else None: for readers of the key that must not make one (``kiln keys public``)."""
    if settings is None:
        from kiln.settings import get_settings

        settings = get_settings()
    if not settings.signing_key and not (Path(settings.home_dir) / "keys" / KEY_FILE).exists():
        return None
    return configured_signer(settings)


def load_public_keys(value: str, field: str) -> list[bytes]:
    """Public keys (SubjectPublicKeyInfo PEM) from PEM text or a file; a private key gives its public key."""
    pem, _ = _pem_or_file(value, field)
    blocks = [b"-----BEGIN" + part for part in pem.split(b"-----BEGIN")[1:]]
    out = []
    for block in blocks:
        try:
            if b"PRIVATE KEY" in block.split(b"\n", 1)[0]:
                key = serialization.load_pem_private_key(block, None).public_key()
            else:
                key = serialization.load_pem_public_key(block)
        except (ValueError, TypeError):
            raise SpecError("holds a PEM block that is not a key", field=field,
                            fix="give ECDSA P-256 public keys in PEM (kiln keys public)") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            raise SpecError("holds a key that is not ECDSA P-256", field=field, fix="give ECDSA P-256 public keys")
        out.append(_public_pem(key))
    if not out:
        raise SpecError("holds no PEM key", field=field, fix="give ECDSA P-256 public keys in PEM (kiln keys public)")
    return out


def trusted_keys(settings: Any = None, *, create: bool = True) -> dict[str, bytes]:
    """fingerprint → public PEM: the signing key's and every key in ``KILN_TRUSTED_KEYS``. ``create=False``: a
    signing key not made yet is left out, not generated."""
    if settings is None:
        from kiln.settings import get_settings

        settings = get_settings()
    signer = configured_signer(settings) if create else existing_signer(settings)
    keys = {signer.fingerprint: signer.public_pem} if signer is not None else {}
    for item in (settings.trusted_keys or "").split(os.pathsep) if settings.trusted_keys else []:
        if item.strip():
            keys.update({fingerprint(p): p for p in load_public_keys(item, "KILN_TRUSTED_KEYS")})
    return keys


# -- DSSE ------------------------------------------------------------------------------------------
def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what is signed."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def dsse_sign(signer: Signer, payload_type: str, payload: bytes) -> dict[str, Any]:
    sig = signer.sign(pae(payload_type, payload))
    return {"payloadType": payload_type, "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": signer.fingerprint, "sig": base64.b64encode(sig).decode()}]}


def dsse_verify(envelope: Any, keys: dict[str, bytes]) -> tuple[bytes, str]:
    """(payload, fingerprint of the key that signed it); :class:`SignatureInvalid` unless one of ``keys``
    signed the envelope's PAE."""
    try:
        payload_type, payload = envelope["payloadType"], base64.b64decode(envelope["payload"], validate=True)
        signatures = list(envelope["signatures"])
    except (KeyError, TypeError, ValueError):
        raise SignatureInvalid("the provenance envelope is not a DSSE envelope") from None
    message = pae(str(payload_type), payload)
    for sig in signatures:
        for fp, pem in keys.items():
            key = serialization.load_pem_public_key(pem)
            if not isinstance(key, ec.EllipticCurvePublicKey):  # Kiln signs with ECDSA P-256 only
                continue
            try:
                key.verify(base64.b64decode(sig["sig"]), message, ec.ECDSA(hashes.SHA256()))
            except (InvalidSignature, KeyError, TypeError, ValueError):
                continue
            return payload, fp
    raise SignatureInvalid("the provenance envelope is not signed by a trusted key (wrong key)")


# -- the engine files' signature -------------------------------------------------------------------
def bundle_key_hint(bundle: bytes) -> str | None:
    """The fingerprint a model_signing bundle names as its key (``verificationMaterial.publicKey.hint``)."""
    try:
        hint = json.loads(bundle)["verificationMaterial"]["publicKey"]["hint"]
    except (ValueError, KeyError, TypeError):
        return None
    return f"sha256:{hint}" if isinstance(hint, str) and hint else None


def verify_files(directory: Path, bundle: bytes, keys: dict[str, bytes]) -> str:
    """Check the model_signing ``bundle`` against the files under ``directory`` (a ``model.sig`` there is not
    one of them) with the trusted key it names; the key's fingerprint, or :class:`SignatureInvalid` saying why
    (wrong key, tampered file, a file added or missing)."""
    from model_signing import hashing, verifying

    hint = bundle_key_hint(bundle)
    if hint is None:
        raise SignatureInvalid("the engine-files signature is not a key-signed model_signing bundle")
    if hint not in keys:
        raise SignatureInvalid(f"the engine files are signed by key {hint}, which is not trusted (wrong key)")
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        key_path, sig_path = Path(tmp) / "key.pub", Path(tmp) / SIGNATURE_FILE
        key_path.write_bytes(keys[hint])
        sig_path.write_bytes(bundle)
        try:
            (verifying.Config().use_elliptic_key_verifier(public_key=key_path)
             .set_hashing_config(hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE]))
             .verify(Path(directory), sig_path))
        except Exception as exc:  # model_signing raises ValueError and others for any mismatch
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            kind = "tampered file" if "mismatch" in text.lower() or "files" in text.lower() else "bad signature"
            raise SignatureInvalid(f"the engine files do not match their signature ({kind}): {text[:400]}") from None
    return hint
