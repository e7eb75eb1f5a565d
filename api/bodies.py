"""Request bodies and JSON answers at the edge.

- :class:`BodyLimitMiddleware` (pure ASGI): every request body is read here, counting the bytes actually
  received (``Content-Length`` or chunked alike), and refused with 413 once it passes ``KILN_MAX_BODY_BYTES`` —
  before any route parses it. A JSON body holding a non-finite number (``NaN``, ``Infinity``, ``1e999``) or
  nested too deeply is refused with 422 naming the field, for every route, before the route sees it.
- :class:`SafeJSONResponse`: the default answer class. A non-finite float already stored (by an older
  version) is answered as ``null`` instead of failing the whole listing with a 500.
"""

from __future__ import annotations

import codecs
import json
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from api.errors import error_response
from kiln import errors as e

#: Deeper JSON than this is no request Kiln takes (and json.loads would hit Python's recursion limit).
MAX_JSON_DEPTH = 64


class NonFinite(ValueError):
    pass


def _strict_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFinite(text)
    return value


def _no_constant(text: str):
    raise NonFinite(text)


def _depth_ok(body: bytes) -> bool:
    if body.count(b"{") + body.count(b"[") <= MAX_JSON_DEPTH:  # cannot be deeper: skip the walk
        return True
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x7B, 0x5B):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                return False
        elif byte in (0x7D, 0x5D):
            depth -= 1
    return True


def non_finite_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first non-finite float in ``value``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "body"
    if isinstance(value, dict):
        for k, v in value.items():
            if (found := non_finite_path(v, f"{path}.{k}" if path else str(k))) is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := non_finite_path(v, f"{path}.{i}" if path else str(i))) is not None:
                return found
    return None


def json_body_problem(body: bytes) -> dict | None:
    """Why a JSON body must be refused (non-finite number, too deep): the fields of an ``invalid_request`` error,
    or None (also for what is no JSON: the route says so itself)."""
    stripped = body.lstrip().removeprefix(codecs.BOM_UTF8).lstrip()  # json.loads reads bytes behind a BOM too
    if stripped[:1] not in (b"{", b"["):
        return None
    if not _depth_ok(stripped):
        return {"code": "invalid_request", "field": "body", "message": f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                "fix": "send a flatter document"}
    try:
        json.loads(stripped, parse_float=_strict_float, parse_constant=_no_constant)
        return None
    except NonFinite:
        pass
    except RecursionError:
        return {"code": "invalid_request", "field": "body", "message": "JSON nested too deeply",
                "fix": "send a flatter document"}
    except ValueError:
        return None
    try:  # find where: parse again, keeping the non-finite values
        field = non_finite_path(json.loads(stripped)) or "body"
    except (ValueError, RecursionError):
        field = "body"
    return {"code": "invalid_request", "field": field, "message": "is not a finite number",
            "fix": "give a finite number (JSON has no NaN or Infinity)"}


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _may_have_body(scope):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([message], receive), send)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                too_large = e.PayloadTooLarge(f"body over {self.max_bytes} bytes", field="body",
                                              fix="send a smaller request", headers={"Connection": "close"})
                return await error_response(too_large, Request(scope))(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and (problem := json_body_problem(body)) is not None:
            invalid = e.InvalidRequest(problem["message"], field=problem["field"], fix=problem["fix"])
            return await error_response(invalid, Request(scope))(scope, receive, send)
        return await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _may_have_body(scope) -> bool:
    if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
        return True
    return any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])


def _replay(messages: list[dict], receive):
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()  # after the body: http.disconnect, when it comes

    return replay


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("utf-8")
        except ValueError:  # a non-finite float stored by an older version: null, not a 500 for the whole list
            return json.dumps(_finite(content), ensure_ascii=False, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
