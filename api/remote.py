"""``kiln build --server URL``: drive a remote Kiln over HTTP with the same output and exit codes as a local
build (stage lines while it runs, the verdict and digest at the end, one JSON object with ``--json``)."""

from __future__ import annotations

import threading
import time

import click
import httpx
from httpx_sse import SSEError, connect_sse

from api.errors import TABLE
from api.output import gate_table, json_line
from kiln import errors as e

TERMINAL = ("succeeded", "failed", "cancelled")


def server_root(server: str) -> str:
    """``--server`` checked before any request: an http(s) URL of the service root (``http://host:8000``), not a
    path below it. A URL without its scheme would be retried as if the network failed; one ending in ``/v1``
    would ask for ``/v1/v1/…``. SpecError naming ``--server`` and the fix (exit 2)."""
    from urllib.parse import urlsplit

    text = server.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        fix = (f"add the scheme: --server http://{text}" if not parts.netloc and not text.lower().startswith("http")
               else "give --server http://host:8000 (http:// or https://)")
        raise e.SpecError(f"--server {server!r} is not an http:// or https:// URL", field="server", fix=fix)
    path = parts.path.rstrip("/")
    if path.rsplit("/", 1)[-1] in ("v1", "v2"):
        root = f"{parts.scheme}://{parts.netloc}{path.rsplit('/', 1)[0]}"
        raise e.SpecError(f"--server {server} ends in /{path.rsplit('/', 1)[-1]}: --server is the service root, "
                          "without /v1", field="server", fix=f"give the root: --server {root}")
    return text.rstrip("/")


def _fail(resp: httpx.Response) -> e.KilnError:
    try:
        err = resp.json().get("error", {})
    except ValueError:
        err = {"message": resp.text[:200]}
    if not isinstance(err, dict):
        err = {}
    code, message = err.get("code"), err.get("message", f"HTTP {resp.status_code}")
    if resp.status_code == 401:  # the token the CLI sent (KILN_TOKEN), or none: the caller's to fix, exit 2
        import os

        if os.environ.get("KILN_TOKEN"):
            return e.Unauthorized(f"the server refused the token in KILN_TOKEN ({message})", field="KILN_TOKEN",
                                  fix="set KILN_TOKEN to a valid token (an admin mints one with POST /v1/tokens)")
        return e.Unauthorized(f"the server requires a token ({message})", field="KILN_TOKEN",
                              fix="set KILN_TOKEN to a token (an admin mints one with POST /v1/tokens)")
    if resp.status_code == 403 and code == "forbidden":
        return e.Forbidden(f"the token in KILN_TOKEN may not do this ({message})", field="KILN_TOKEN",
                           fix=f"set KILN_TOKEN to a token that may: {err.get('fix') or 'ask an admin'}")
    if resp.status_code == 404 and code == "endpoint_unknown":
        try:
            what = resp.request.url.path
        except RuntimeError:  # a response made without its request
            what = "such path"
        return e.EndpointUnknown(f"the server has no {what}", field="server",
                                 fix="--server is the Kiln service root (http://host:8000), without /v1 or a path "
                                     "the service does not have")
    by_status = {422: e.SpecError, 400: e.InvalidDigest, 404: e.ArtifactUnknown, 409: e.BuildCancelled}
    cls = by_status.get(resp.status_code, e.StorageUnavailable if resp.status_code >= 500 else e.KilnError)
    return cls(message, field=err.get("field"), fix=err.get("fix"))


#: the stream is read with this timeout: the server sends a keep-alive comment every 5 s, so a read that waits
#: longer means the connection is dead (a proxy that dropped it without closing)
READ_TIMEOUT_S = 30.0
#: reconnect after 0.5 s, doubling up to 8 s; after this many failed tries in a row, poll the build instead
FIRST_BACKOFF_S, MAX_BACKOFF_S, RECONNECT_TRIES = 0.5, 8.0, 6
#: how often the polling fallback reads the build
POLL_S = 3.0
#: a request whose connection was cut after it reached the server is asked again this many times (backing off as
#: the stream does); see :func:`_send`
RESEND_TRIES = 5


def _send(client: httpx.Client, method: str, url: str, *, what: str, reached: bool,
          say=lambda line: click.echo(line, err=True), **kw) -> httpx.Response:
    """``method url``, asked again when the network cuts it (a proxy's lifetime or idle limit, an ingress that
    restarts): the answer was lost, not refused. Safe for every request this module sends: the GETs only read,
    and ``POST /v1/builds`` is idempotent (an identical request joins the build the first one made,
    workers/submit.py), so a submission whose answer was cut is answered again with the same build. ``reached``:
    the server has answered this client before; until it has, a connection that cannot be made at all is a wrong
    ``--server`` or a server that is down, and fails at once."""
    cuts, delay = 0, FIRST_BACKOFF_S
    while True:
        try:
            return client.request(method, url, **kw)
        except httpx.TransportError as exc:
            cuts += 1
            if cuts > RESEND_TRIES or isinstance(exc, httpx.ConnectError) and not reached:
                raise
            say(f"  {what} was cut ({type(exc).__name__}); asking again")
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


def _first(client: httpx.Client, server: str, method: str, url: str, *, what: str, **kw) -> httpx.Response:
    """A command's first request to ``server`` (:func:`_send`, not yet reached): a server that cannot be had is
    ``StorageUnavailable`` naming it (exit 3)."""
    try:
        return _send(client, method, url, what=what, reached=False, **kw)
    except httpx.HTTPError as exc:
        raise e.StorageUnavailable(f"cannot reach {server}: {exc}", fix="check --server and that kiln api runs") from None


def _follow(client: httpx.Client, build_id: str, progress, say=lambda line: click.echo(line, err=True)) -> None:
    """Print stage events until the server says the build ended, through a network that cuts streams: a stream
    that ends or fails is reopened with ``Last-Event-ID`` (no event twice, none lost) after a backoff; when it
    cannot be reopened ``RECONNECT_TRIES`` times in a row, the build is polled until it ends."""
    last, failures, delay = None, 0, FIRST_BACKOFF_S
    while True:
        try:
            headers: dict[str, str] = {"Last-Event-ID": last} if last else {}
            with connect_sse(client, "GET", f"/v1/builds/{build_id}/events", headers=headers,
                             timeout=httpx.Timeout(10, read=READ_TIMEOUT_S)) as source:
                status = source.response.status_code
                if 400 <= status < 500:  # the server's answer (unknown build, no access): not the network's
                    source.response.read()
                    raise _fail(source.response)
                if status == 200:
                    failures, delay = 0, FIRST_BACKOFF_S
                    for event in source.iter_sse():
                        last = event.id or last
                        if event.event in ("stage", "progress"):
                            progress(event.event, event.json())
                        elif event.event == "end":
                            return
            why = "the event stream ended before the build" if status == 200 else f"the event stream got HTTP {status}"
        except (httpx.TransportError, SSEError) as exc:  # cut, refused, timed out, or a proxy's error page
            why = f"the event stream failed ({type(exc).__name__})"
        failures += 1
        if failures > RECONNECT_TRIES:
            say(f"  {why} {failures - 1} times in a row; polling the build every {POLL_S:g}s instead")
            return _poll(client, build_id, say)
        if failures == 1 or failures == RECONNECT_TRIES:
            say(f"  {why}; reconnecting")
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


def _poll(client: httpx.Client, build_id: str, say) -> None:
    """Read the build until it ends (the fallback when no event stream can be had); says its stage as it changes."""
    seen = None
    while True:
        try:
            r = client.get(f"/v1/builds/{build_id}")
        except httpx.TransportError:
            time.sleep(POLL_S)
            continue
        if r.status_code != 200:
            raise _fail(r)
        body = r.json()
        if body["status"] in TERMINAL:
            return
        now = (body["status"], body.get("stage"), body.get("reason"))
        if now != seen:
            seen = now
            say(f"  {body['status']}" + (f" {body['stage']}" if body.get("stage") else "")
                + (f": {body['reason']}" if body.get("reason") else ""))
        time.sleep(POLL_S)


def _wait(client: httpx.Client, build: dict, server: str, progress, timeout: float | None) -> None:
    """Follow the build until it ends or ``timeout`` seconds pass (then ``WaitTimedOut``: exit 4; the build goes on).
    The follow runs in a thread so the deadline holds even while a stream is quiet but alive."""
    build_id = build["id"]
    if build["status"] == "queued":
        r = _send(client, "GET", f"/v1/builds/{build_id}", what="reading the build", reached=True)
        reason = r.json().get("reason") if r.status_code == 200 else None
        if reason:
            click.echo(f"  queued: {reason}", err=True)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            _follow(client, build_id, progress)
        except BaseException as exc:  # handed to the waiting thread, raised there
            outcome.append(exc)

    follower = threading.Thread(target=run, name=f"kiln-follow-{build_id}", daemon=True)
    t0 = time.monotonic()
    follower.start()
    while follower.is_alive():
        left = None if timeout is None else timeout - (time.monotonic() - t0)
        if left is not None and left <= 0:
            state = _state(client, build_id)
            raise e.WaitTimedOut(f"build {build_id} had not finished after {timeout:g}s ({state}); it goes on "
                                 f"on {server}", field="timeout",
                                 fix=f"wait longer (--timeout), follow it with GET /v1/builds/{build_id}, or cancel it "
                                     f"with POST /v1/builds/{build_id}/cancel")
        follower.join(0.5 if left is None else min(0.5, left))
    if outcome:
        raise outcome[0]


def _state(client: httpx.Client, build_id: str) -> str:
    """The build's status (and why it waits, when queued), for a timeout message; never raises."""
    try:
        body = client.get(f"/v1/builds/{build_id}", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return "state unknown: the server did not answer"
    return body.get("status", "?") + (f": {body['reason']}" if body.get("reason") else "")


def _post(client: httpx.Client, server: str, body: dict) -> dict:
    resp = _first(client, server, "POST", "/v1/builds", json=body, what="the answer to the submission")
    if resp.status_code not in (200, 202):
        raise _fail(resp)
    return resp.json()


def _finish(client: httpx.Client, server: str, build: dict, *, wait: bool, progress, timeout: float | None) -> dict:
    """One answered build's outcome: followed to its end with ``wait`` (``timeout``: WaitTimedOut), else as answered."""
    if not wait or build.get("id") is None and build["status"] in TERMINAL:
        return _outcome(client, build)
    click.echo(f"build {build['id']} {build['status']} on {server}", err=True)
    if build["status"] not in TERMINAL:
        _wait(client, build, server, progress, timeout)
    final = _send(client, "GET", f"/v1/builds/{build['id']}", what="reading the finished build", reached=True)
    if final.status_code != 200:
        raise _fail(final)
    return _outcome(client, {**final.json(), "cache_hit": build.get("cache_hit", False)})


def remote_build(server: str, spec: dict, *, wait: bool, as_json: bool, progress, summary,
                 timeout: float | None = None) -> dict:
    with _client(server) as client:
        out = _finish(client, server, _post(client, server, spec), wait=wait, progress=progress, timeout=timeout)
    if as_json:
        json_line(out)
        gate_table(out)
        return out
    if not wait and out.get("id"):
        click.echo(follow_line(server, out))
    summary(out)
    return out


def follow_line(server: str, out: dict) -> str:
    """``--no-wait``'s line: the build's id, its status and where to follow it."""
    root, build_id = server.rstrip("/"), out["id"]
    if out["status"] in TERMINAL:
        return f"build {build_id} {out['status']} on {root}: GET {root}/v1/builds/{build_id}"
    return (f"build {build_id} {out['status']} on {root}; follow it: GET {root}/v1/builds/{build_id} "
            f"(its events: GET {root}/v1/builds/{build_id}/events)")


def remote_plan(server: str, document: dict) -> dict:
    """``kiln build --server URL --dry-run``: the server's plan of ``document`` (``POST /v1/builds/plan``: each
    spec's keys, cache state and what its submission would do); nothing is submitted."""
    with _client(server) as client:
        resp = _first(client, server, "POST", "/v1/builds/plan", json=document, what="the plan")
    if resp.status_code in (404, 405):  # a Kiln older than this client: it has no plan route (and queued nothing)
        raise e.InvalidRequest(f"{server} does not plan builds (POST /v1/builds/plan: HTTP {resp.status_code}; a "
                               "Kiln older than this client)", field="dry_run",
                               fix="upgrade the server, or drop --server to plan here")
    if resp.status_code != 200:
        raise _fail(resp)
    return resp.json()


def remote_matrix(server: str, document: dict, *, wait: bool, progress, on_entry,
                  timeout: float | None = None) -> list[dict]:
    """``kiln build -f FILE --server``: the whole document in one request (the server checks every entry before it
    submits any), then each build followed in turn (``timeout``: one deadline for them all). ``on_entry(i, out,
    error)`` is called as each ends; ``error``: the KilnError its outcome maps to (exit_for), or WaitTimedOut."""
    with _client(server) as client:
        answer = _post(client, server, document)
        builds = answer["builds"] if "builds" in answer else [answer]
        t0, outs = time.monotonic(), []
        for i, build in enumerate(builds):
            left = None if timeout is None else timeout - (time.monotonic() - t0)
            try:
                if left is not None and left <= 0 and build["status"] not in TERMINAL:
                    raise e.WaitTimedOut(f"build {build['id']} had not finished after {timeout:g}s "
                                         f"({_state(client, build['id'])}); it goes on on {server}", field="timeout",
                                         fix=f"wait longer (--timeout), or follow it with GET /v1/builds/{build['id']}")
                out = _finish(client, server, build, wait=wait, progress=progress, timeout=left)
                error = exit_for(out) if wait else None
            except e.WaitTimedOut as exc:
                out, error = _outcome(client, build), exc
            outs.append(out)
            on_entry(i, out, error)
    return outs


def _outcome(client: httpx.Client, build: dict) -> dict:
    validation: dict = {}
    artifact = None
    if build.get("digest"):
        r = _send(client, "GET", f"/v1/artifacts/{build['digest']}", what="reading the engine", reached=True)
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


def _client(server: str) -> httpx.Client:
    """The HTTP client of one command against ``server``, with ``KILN_TOKEN`` as its bearer token."""
    return httpx.Client(base_url=server_root(server), timeout=60, headers=_auth_headers())


def _auth_headers() -> dict[str, str]:
    import os

    return {"Authorization": f"Bearer {os.environ['KILN_TOKEN']}"} if os.environ.get("KILN_TOKEN") else {}


def fetch_report_document(server: str, digest: str) -> tuple[dict, str | None]:
    """The validation report document and status of engine ``digest`` on a remote Kiln (the same document
    ``kiln report`` renders from a local index), from ``GET /v1/artifacts/{digest}``."""
    from validation.report import report_document

    with _client(server) as client:
        resp = _first(client, server, "GET", f"/v1/artifacts/{digest}", what="reading the engine")
    if resp.status_code != 200:
        raise _fail(resp)
    a = resp.json()
    doc = report_document(a["digest"], repository=a.get("repository"), tag=a.get("tag"),
                          provenance=a.get("provenance") or {}, validation=a.get("validation") or {})
    return doc, a.get("status")


def remote_resolve(server: str, query: dict[str, str | None]) -> dict:
    """``GET /v1/resolve`` on a remote Kiln: the one servable engine's body, or the domain error for why none is
    (404: nothing servable yet, 409: only stale engines or none for the asked runtime; both ArtifactUnknown)."""
    with _client(server) as client:
        resp = _first(client, server, "GET", "/v1/resolve", params={k: v for k, v in query.items() if v is not None},
                      what="the resolve request")
    if resp.status_code == 200:
        return resp.json()
    if resp.status_code in (404, 409):
        err = resp.json().get("error", {})
        raise e.ArtifactUnknown(err.get("message", f"HTTP {resp.status_code}"), field=err.get("field"),
                                fix=err.get("fix"))
    raise _fail(resp)


def fetch_support(server: str) -> dict:
    """``GET /v1/support`` on a remote Kiln: the support matrix with what ran where in that server's registry (the
    document ``kiln models --json`` prints)."""
    with _client(server) as client:
        resp = _first(client, server, "GET", "/v1/support", what="reading the support matrix")
    if resp.status_code != 200:
        raise _fail(resp)
    return resp.json()


#: what ``GET /v1/keys`` answers as PEM (every trusted key, the signing key first)
PEM_TYPE = "application/x-pem-file"


def fetch_public_keys(server: str) -> list[str]:
    """The public keys of a remote Kiln as PEM blocks, its signing key first (``GET /v1/keys`` with
    ``Accept: application/x-pem-file``)."""
    with _client(server) as client:
        resp = _first(client, server, "GET", "/v1/keys", headers={"Accept": PEM_TYPE}, what="reading the keys")
    if resp.status_code != 200:
        raise _fail(resp)
    if not resp.headers.get("content-type", "").startswith(PEM_TYPE):  # a Kiln older than this client: JSON
        try:
            return [k["public_key"] for k in sorted(resp.json()["keys"], key=lambda k: not k.get("signing"))]
        except (ValueError, KeyError, TypeError):
            raise e.KilnError(f"{server} answered GET /v1/keys with neither PEM nor its JSON") from None
    text = resp.text
    blocks = ["-----BEGIN" + part for part in text.split("-----BEGIN")[1:]]
    if not blocks:
        raise e.KilnError(f"{server} answered GET /v1/keys with no PEM key")
    return [b if b.endswith("\n") else b + "\n" for b in blocks]
