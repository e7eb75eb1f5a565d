"""The one error table (api/errors.py): every domain error class has its own row, every code is one class's, the
statuses, exit codes and OCI codes are ones the edge may answer; and no error answer is built anywhere else — a
scan of api/'s source (ast) finds none, and finds the ones planted in it here."""

from __future__ import annotations

import ast
import importlib
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.errors import EXIT_CODES, OCI_CODES, TABLE, Row, error_response, exit_code, http_status, row
from kiln import errors as e

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("api", "artifacts", "builder", "deploy", "kiln", "validation", "workers")


def error_classes() -> list[type[e.KilnError]]:
    """KilnError and every subclass of it, recursively."""
    found, todo = [], [e.KilnError]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


def sources(*packages: str):
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            yield path, path.read_text()


# -- the table ---------------------------------------------------------------------------------------------------
def test_every_error_class_has_exactly_its_own_row():
    for module in ("api.app", "api.cli", "api.pull"):  # the edge's modules: any error class they define is walked
        importlib.import_module(module)

    classes = error_classes()
    missing = [c.__qualname__ for c in classes if c not in TABLE]
    assert not missing, f"error classes without their own row in api/errors.py: {missing}"
    stale = [c.__qualname__ for c in TABLE if c not in classes]
    assert not stale, f"rows for classes that are no KilnError: {stale}"
    assert all(c.__module__ == "kiln.errors" for c in classes), [c for c in classes if c.__module__ != "kiln.errors"]


def test_every_code_is_its_own_classes_and_unique():
    classes = error_classes()
    inherited = [c.__qualname__ for c in classes if "code" not in vars(c)]
    assert not inherited, f"classes that inherit their parent's code: {inherited}"
    twice = {code: n for code, n in Counter(c.code for c in classes).items() if n > 1}
    assert not twice, f"codes of more than one class: {twice}"
    assert all(e.by_code(c.code) is c for c in classes)
    assert e.by_code("no_such_code") is None


def test_every_row_is_an_answer_the_edge_may_give():
    for cls, r in TABLE.items():
        assert isinstance(r, Row), cls
        assert 400 <= r.status <= 599, (cls, r)
        assert r.exit in EXIT_CODES, (cls, r)
        assert r.oci is None or r.oci in OCI_CODES, (cls, r)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in r.headers), (cls, r)
        assert (r.status == 401) == any(k == "WWW-Authenticate" for k, _ in r.headers), (cls, r)  # RFC 9110 §15.5.2


def test_lookup_is_by_mro_and_anything_else_is_internal():
    class Planted(e.StageFailed):  # a subclass without a row (the test above forbids one in the code base)
        code = "planted"

    try:
        assert row(Planted("x")) is TABLE[e.StageFailed]
        assert (http_status(ValueError()), exit_code(ValueError())) == (500, 3)
    finally:
        del Planted
        import gc

        gc.collect()  # drop it from KilnError.__subclasses__() for the tests that walk them


def test_a_resolution_answers_the_status_its_error_row_has():
    """api/resolution.py says why no engine is answered with a status and a code: the code's class has the
    same status in the table."""
    tree = ast.parse((REPO / "api" / "resolution.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Resolution"
             and isinstance(n.args[0], ast.Constant) and n.args[0].value is None]
    assert len(calls) >= 5
    for call in calls:
        status, code = call.args[1].value, call.args[2].value
        cls = e.by_code(code)
        assert cls is not None and issubclass(cls, e.ArtifactUnknown), code
        assert TABLE[cls].status == status, (code, status, TABLE[cls])


# -- no error answer built by hand -------------------------------------------------------------------------------
RESPONSES = {"JSONResponse", "SafeJSONResponse", "ORJSONResponse", "UJSONResponse", "Response", "PlainTextResponse",
             "HTMLResponse"}
#: (file, function) where a 4xx/5xx answer is no error: the readiness probe's report (body: its checks).
ALLOWED = {("api/routes/health.py", "readyz")}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _error_status(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and type(n.value) is int and n.value >= 400 for n in ast.walk(node))


def _error_body(node: ast.AST) -> bool:
    """A literal ``{"error": {...}}`` / ``{"errors": [...]}``: an error body written out."""
    return isinstance(node, ast.Dict) and any(
        isinstance(k, ast.Constant) and k.value in ("error", "errors") and isinstance(v, (ast.Dict, ast.List))
        for k, v in zip(node.keys, node.values))


#: The command line and the HTTP clients in api/ (they read error bodies and write reports; they answer no request).
CLIENTS = ("api/cli", "api/remote.py", "api/pull.py")


def hand_built(source: str, filename: str = "<planted>") -> list[str]:
    """Where ``source`` builds an error answer itself: a response class called with a 4xx/5xx status, an error
    body literal (outside the command line and the HTTP clients), an ``OCIError`` or an ``HTTPException``."""
    bodies = not filename.startswith(CLIENTS)
    found = []

    class Visitor(ast.NodeVisitor):
        def __init__(self):
            self.function = None

        def visit_FunctionDef(self, node):
            outer, self.function = self.function, node.name
            self.generic_visit(node)
            self.function = outer

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_ClassDef(self, node):
            if node.name == "OCIError":
                found.append(f"{filename}:{node.lineno} defines OCIError")
            self.generic_visit(node)

        def visit_Dict(self, node):
            if bodies and _error_body(node):
                found.append(f"{filename}:{node.lineno} writes an error body")
            self.generic_visit(node)

        def visit_Call(self, node):
            name = _name(node.func)
            where = f"{filename}:{node.lineno}"
            if name in ("OCIError", "HTTPException"):
                found.append(f"{where} {name}(…)")
            elif name in RESPONSES and (filename, self.function) not in ALLOWED:
                status = [k.value for k in node.keywords if k.arg == "status_code"]
                if len(node.args) > 1:  # Response(content, status_code, …)
                    status.append(node.args[1])
                if any(_error_status(s) for s in status):
                    found.append(f"{where} {name}(…) with an error status in {self.function}()")
            self.generic_visit(node)

    Visitor().visit(ast.parse(source))
    return found


def test_no_error_answer_is_built_outside_the_table():
    found = []
    for path, text in sources("api"):
        rel = path.relative_to(REPO).as_posix()
        if rel != "api/errors.py":
            found += hand_built(text, rel)
    assert not found, "error answers built by hand (raise a kiln.errors class instead):\n" + "\n".join(found)


def test_no_error_class_is_defined_outside_kiln_errors():
    names = {c.__name__ for c in error_classes()}
    found = []
    for path, text in sources(*PACKAGES):
        if path == REPO / "kiln" / "errors.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and any(_name(b) in names for b in node.bases):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} class {node.name}")
    assert not found, "error classes outside kiln/errors.py (the table's home):\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'return JSONResponse({"error": {"code": "x"}}, status_code=404)',
    'return SafeJSONResponse(body, status_code=413)',
    'return JSONResponse(body, 503, headers=h)',
    'return Response(status_code=401)',
    'return JSONResponse(body, status_code=200 if ok else 503)',
    'raise OCIError(404, "BLOB_UNKNOWN", "no blob")',
    'raise HTTPException(status_code=404)',
    'body = {"errors": [{"code": "DENIED"}]}',
])
def test_the_scan_finds_a_planted_hand_built_answer(planted):
    assert hand_built(f"def route():\n    {planted}\n")


@pytest.mark.parametrize("fine", [
    'return JSONResponse({"digest": d}, status_code=202 if created else 200)',
    'return Response(status_code=307, headers=h)',
    'return {"error": build.get("error")}',
    'raise e.ModelUnknown("not tracked", field="model")',
])
def test_the_scan_passes_answers_that_are_no_errors(fine):
    assert not hand_built(f"def route():\n    {fine}\n")


# -- answers -------------------------------------------------------------------------------------------------------
@pytest.fixture
def client(tmp_path):
    from api.app import create_app
    from kiln import db
    from kiln.settings import Settings

    s = Settings(home=tmp_path / "home")
    db.upgrade(s.db_url)
    return TestClient(create_app(s, enqueue=lambda *a: None))


def test_framework_refusals_go_through_the_table(client):
    r = client.get("/v1/no-such-endpoint")
    assert r.status_code == 404 and r.json()["error"]["code"] == "endpoint_unknown"
    r = client.delete("/v1/artifacts")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "GET" in r.headers["Allow"]
    r = client.get("/v1/resolve")  # required query parameters missing: the framework's validation
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["fix"] == "see GET /openapi.json" and len(r.json()["error"]["errors"]) == 5


def test_edge_errors_have_their_codes(client):
    r = client.get("/v1/models/acme/none")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_unknown"
    r = client.delete("/v1/tokens/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "token_unknown"
    r = client.post("/v1/tokens", json={"name": "t", "scopes": ["admin"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "auth_off"
    q = {"model": "acme/none", "precision": "fp8", "profile": "default", "target": "h100", "backend": "trtllm-engine"}
    r = client.get("/v1/resolve", params=q)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_built" and r.json()["error"]["field"] == "model"


def test_the_same_error_under_v2_is_answered_in_the_distribution_spec_format(client):
    from starlette.requests import Request

    for path, method in (("/v2/acme/x/manifests/latest", "GET"), ("/v1/x", "GET"), ("/v2/acme/x/blobs/y", "HEAD")):
        request = Request({"type": "http", "path": path, "method": method, "headers": [], "query_string": b""})
        r = error_response(e.UnsafeLayer("a link in the layer", field="layer"), request)
        assert r.status_code == 422
        if path.startswith("/v1"):
            assert b'"code":"unsafe_layer"' in r.body
        elif method == "HEAD":
            assert r.body == b"" and r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
        else:
            assert b'"code":"UNKNOWN"' in r.body and b'"kiln_code":"unsafe_layer"' in r.body


def test_unsafe_layer_is_bad_content_not_an_internal_error():
    assert (http_status(e.UnsafeLayer("x")), exit_code(e.UnsafeLayer("x"))) == (422, 1)
