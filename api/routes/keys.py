"""/v1/keys: the public keys that verify this Kiln's engines (the signing key first, then KILN_TRUSTED_KEYS).

An API given public keys only (``KILN_TRUSTED_KEYS`` and no ``KILN_SIGNING_KEY``: the distributed deployments, where
only workers sign) has no signing key and makes none: it lists the trusted keys in their order, none marked
``signing``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from artifacts.signing import existing_signer, trusted_keys

router = APIRouter(tags=["keys"])


def _keys(app) -> dict[str, bytes]:
    if getattr(app.state, "trusted_keys", None) is None:
        settings = app.state.settings
        app.state.trusted_keys = trusted_keys(settings, create=bool(settings.signing_key) or not settings.trusted_keys)
    return app.state.trusted_keys


def trusted_fingerprints(app) -> set[str]:
    return set(_keys(app))


#: the media type of PEM files; asked for in ``Accept``, the keys are answered as PEM
PEM_TYPE = "application/x-pem-file"


@router.get("/v1/keys", responses={200: {"content": {PEM_TYPE: {}}}})
def list_keys(request: Request):
    """Public keys (PEM) and fingerprints: pass one to `model_signing verify key` or `kiln pull --verify-key`. With
    ``Accept: application/x-pem-file``: the keys as one PEM file, the signing key first (kiln keys public
    --server)."""
    known = _keys(request.app)
    signer = existing_signer(request.app.state.settings)
    signing = signer.fingerprint if signer is not None else None
    keys = sorted(known.items(), key=lambda kv: kv[0] != signing)  # stable: the signing key first
    if PEM_TYPE in request.headers.get("accept", ""):
        return Response(b"".join(pem for _, pem in keys), media_type=PEM_TYPE)
    return {"keys": [{"fingerprint": fp, "public_key": pem.decode(), "signing": fp == signing} for fp, pem in keys]}
