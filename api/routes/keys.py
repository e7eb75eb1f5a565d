"""/v1/keys: the public keys that verify this Kiln's engines (the signing key first, then KILN_TRUSTED_KEYS)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from artifacts.signing import configured_signer, trusted_keys

router = APIRouter(tags=["keys"])


def _keys(app) -> dict[str, bytes]:
    if getattr(app.state, "trusted_keys", None) is None:
        app.state.trusted_keys = trusted_keys(app.state.settings)
    return app.state.trusted_keys


def trusted_fingerprints(app) -> set[str]:
    return set(_keys(app))


@router.get("/v1/keys")
def list_keys(request: Request):
    """Public keys (PEM) and fingerprints: pass one to `model_signing verify key` or `kiln pull --verify-key`."""
    signing = configured_signer(request.app.state.settings).fingerprint
    return {"keys": [{"fingerprint": fp, "public_key": pem.decode(), "signing": fp == signing}
                     for fp, pem in _keys(request.app).items()]}
