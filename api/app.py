"""The FastAPI application: routers, and the handlers that turn domain and framework errors into answers (all
built by ``api.errors.error_response`` from the one table)."""

from __future__ import annotations

import gc

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

import kiln
from api.bodies import SafeJSONResponse
from api.errors import database_unavailable, error_response, framework_error
from api.routes import admission, artifacts, builds, dashboard, health, keys, metrics, models, oci, workers
from kiln import errors as e
from kiln.settings import Settings, get_settings


def _broker_check(url: str):
    def check() -> str:
        if url.startswith("sqla+"):
            return "ok"  # the SQLite broker is a file next to the database
        try:
            from kombu import Connection

            with Connection(url, connect_timeout=2) as conn:
                conn.ensure_connection(max_retries=1)
            return "ok"
        except Exception as exc:
            return f"unreachable: {type(exc).__name__}"
    return check


def create_app(settings: Settings | None = None, *, enqueue=None) -> FastAPI:
    from workers.services import build_services

    from api import auth

    settings = settings or get_settings()
    # route_scope: every route checks the scope its own template needs (api/auth.py)
    app = FastAPI(title="Kiln", version=kiln.__version__, default_response_class=SafeJSONResponse,
                  dependencies=[Depends(auth.route_scope)],
                  docs_url="/docs" if settings.api_docs else None, redoc_url="/redoc" if settings.api_docs else None,
                  description="CI for inference engines: build, validate and serve engines by digest.")
    services = build_services(settings, enqueue=enqueue)  # workers/services.py: as the CLI and worker build them
    app.state.settings, app.state.services = settings, services
    app.state.sessions = services.sessions
    app.state.bell = services.bell  # wakes event-stream readers on commit (kiln/bell.py)
    # The hot reads (resolve, identical build requests) run on autocommit connections: no BEGIN / ROLLBACK.
    app.state.read_engine, app.state.read_sessions = services.read_engine, services.read_sessions
    app.state.store = services.store
    app.state.enqueue = services.enqueue  # the broker's side; routes send through workers/enqueue.py
    app.state.broker_check = _broker_check(settings.broker)
    for r in (health.router, builds.router, artifacts.router, workers.router, models.router, oci.router,
              dashboard.router, metrics.router, keys.router, admission.router):
        app.include_router(r)
    from fastapi.staticfiles import StaticFiles

    app.mount("/static", StaticFiles(directory=dashboard.STATIC), name="static")
    metrics.install(app)  # the database collector and the GET /v1/resolve latency histogram
    app.include_router(auth.router)
    auth.install(app)  # request size limit, tokens and scopes

    @app.exception_handler(e.KilnError)
    async def kiln_error(request: Request, exc: e.KilnError):
        return error_response(exc, request)

    @app.exception_handler(DBAPIError)
    async def database_down(request: Request, exc: DBAPIError):
        if not exc.connection_invalidated and not isinstance(exc, (OperationalError, InterfaceError)):
            raise exc
        return error_response(database_unavailable(exc), request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        errs = [{"field": ".".join(str(p) for p in err["loc"] if p not in ("query", "path", "body")) or "request",
                 "message": err["msg"]} for err in exc.errors()]
        first = errs[0] if errs else {"field": "request", "message": "invalid request"}
        return error_response(e.InvalidRequest(first["message"], field=first["field"], fix="see GET /openapi.json",
                                               details=errs), request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(framework_error(exc), request)

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            # BuildSpec, its parts, and BuildSpecEntry (a matrix's defaults and entries): kiln/document.py
            comps.update(builds.BODY_SCHEMA["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    app.router.on_shutdown.append(app.state.bell.close)
    # Everything imported so far (torch among it: the builder's modules import it) lives as long as the
    # process. Out of the collector's sight, a full collection no longer walks those ~250k objects, which
    # otherwise stalls a request for tens of milliseconds now and then.
    gc.freeze()
    return app
