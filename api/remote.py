"""``kiln build --server URL``: drive a remote Kiln over HTTP with the same output and exit codes as a local
build (stage lines while it runs, the verdict and digest at the end, one JSON object with ``--json``)."""

from __future__ import annotations

import json

import click
import httpx

from api.errors import TABLE
from kiln import errors as e

TERMINAL = ("succeeded", "failed", "cancelled")


def _fail(resp: httpx.Response) -> e.KilnError:
    try:
        err = resp.json().get("error", {})
    except ValueError:
        err = {"message": resp.text[:200]}
    by_status = {422: e.SpecError, 400: e.InvalidDigest, 404: e.ArtifactUnknown, 409: e.BuildCancelled}
    cls = by_status.get(resp.status_code, e.StorageUnavailable if resp.status_code >= 500 else e.KilnError)
    return cls(err.get("message", f"HTTP {resp.status_code}"), field=err.get("field"), fix=err.get("fix"))


def _follow(client: httpx.Client, build_id: str, progress) -> None:
    """Print stage events until the server says the build ended."""
    with client.stream("GET", f"/v1/builds/{build_id}/events", timeout=httpx.Timeout(10, read=None)) as resp:
        if resp.status_code != 200:
            raise _fail(resp)
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if kind == "stage":
                    progress("stage", data)
                elif kind == "end":
                    return


def remote_build(server: str, spec: dict, *, wait: bool, as_json: bool, progress, summary) -> dict:
    import os

    headers = {"Authorization": f"Bearer {os.environ['KILN_TOKEN']}"} if os.environ.get("KILN_TOKEN") else {}
    with httpx.Client(base_url=server.rstrip("/"), timeout=60, headers=headers) as client:
        try:
            resp = client.post("/v1/builds", json=spec)
        except httpx.HTTPError as exc:
            raise e.StorageUnavailable(f"cannot reach {server}: {exc}", fix="check --server and that kiln api runs") from None
        if resp.status_code not in (200, 202):
            raise _fail(resp)
        build = resp.json()
        if not wait or build.get("id") is None and build["status"] in TERMINAL:
            out = _outcome(client, build)
        else:
            click.echo(f"build {build['id']} {build['status']} on {server}", err=True)
            if build["status"] not in TERMINAL:
                _follow(client, build["id"], progress)
            final = client.get(f"/v1/builds/{build['id']}")
            if final.status_code != 200:
                raise _fail(final)
            out = _outcome(client, {**final.json(), "cache_hit": build.get("cache_hit", False)})
    click.echo(json.dumps(out, sort_keys=True)) if as_json else summary(out)
    return out


def _outcome(client: httpx.Client, build: dict) -> dict:
    validation, artifact = {}, None
    if build.get("digest"):
        r = client.get(f"/v1/artifacts/{build['digest']}")
        if r.status_code == 200:
            body = r.json()
            validation = body.get("validation") or {}
            artifact = {k: v for k, v in body.items() if k not in ("provenance", "validation")}
    return {"id": build.get("id"), "build_key": build.get("build_key"), "digest": build.get("digest"),
            "status": build["status"], "cache_hit": bool(build.get("cache_hit")), "stages": build.get("stages", []),
            "validation": {"passed": validation.get("passed"), "metrics": validation.get("metrics", {}),
                           "gates": validation.get("gates", [])},
            "artifact": artifact, "error": build.get("error"), "reason": build.get("reason")}


def exit_for(out: dict) -> e.KilnError | None:
    """The error whose exit code a finished remote build maps to (None for success)."""
    if out["status"] == "succeeded":
        return None
    if out["status"] == "failed" and out.get("reason") == "validation":
        return e.ValidationFailed("the engine failed validation; it is stored as rejected and will not be served")
    err = out.get("error") or {}
    for cls in TABLE:
        if getattr(cls, "code", None) == err.get("code"):
            return cls(err.get("message", out["status"]), field=err.get("field"), fix=err.get("fix"))
    return e.StageFailed(f"the build {out['status']}: {err.get('message', out.get('reason'))}")


def _auth_headers() -> dict[str, str]:
    import os

    return {"Authorization": f"Bearer {os.environ['KILN_TOKEN']}"} if os.environ.get("KILN_TOKEN") else {}


def fetch_report_document(server: str, digest: str) -> tuple[dict, str | None]:
    """The validation report document and status of engine ``digest`` on a remote Kiln (the same document
    ``kiln report`` renders from a local index), from ``GET /v1/artifacts/{digest}``."""
    from validation.report import report_document

    with httpx.Client(base_url=server.rstrip("/"), timeout=60, headers=_auth_headers()) as client:
        try:
            resp = client.get(f"/v1/artifacts/{digest}")
        except httpx.HTTPError as exc:
            raise e.StorageUnavailable(f"cannot reach {server}: {exc}", fix="check --server and that kiln api runs") from None
    if resp.status_code != 200:
        raise _fail(resp)
    a = resp.json()
    doc = report_document(a["digest"], repository=a.get("repository"), tag=a.get("tag"),
                          provenance=a.get("provenance") or {}, validation=a.get("validation") or {})
    return doc, a.get("status")


def remote_resolve(server: str, query: dict[str, str]) -> dict:
    """``GET /v1/resolve`` on a remote Kiln: the one servable engine's body, or the domain error for why none is
    (404: nothing servable yet, 409: only stale engines or none for the asked runtime; both ArtifactUnknown)."""
    with httpx.Client(base_url=server.rstrip("/"), timeout=60, headers=_auth_headers()) as client:
        try:
            resp = client.get("/v1/resolve", params={k: v for k, v in query.items() if v is not None})
        except httpx.HTTPError as exc:
            raise e.StorageUnavailable(f"cannot reach {server}: {exc}", fix="check --server and that kiln api runs") from None
    if resp.status_code == 200:
        return resp.json()
    if resp.status_code in (404, 409):
        err = resp.json().get("error", {})
        raise e.ArtifactUnknown(err.get("message", f"HTTP {resp.status_code}"), field=err.get("field"),
                                fix=err.get("fix"))
    raise _fail(resp)
