"""The one place errors become HTTP: every VrnicError (and FastAPI's own) as RFC 9457 problem+json."""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from vrnic.api.schemas import Problem
from vrnic.db.schema import SchemaOutOfDate
from vrnic.errors import (
    ApiError,
    Conflict,
    DeviceError,
    InvalidArgument,
    NotFound,
    NotSupported,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    VrnicError,
)

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"

# Most specific class first; anything else that is a VrnicError is a 500.
STATUS: dict[type[VrnicError], int] = {
    InvalidArgument: 400,
    Unauthenticated: 401,
    PermissionDenied: 403,
    QuotaExceeded: 403,
    NotFound: 404,
    Conflict: 409,
    NotSupported: 422,  # understood, but this host cannot do it (mode not enabled, no device)
    DeviceError: 502,  # the kernel or device below us refused
    ApiError: 502,  # another vrnic API (a client's error) refused: it names that API's own answer
    SchemaOutOfDate: 503,  # someone migrated the database under a running daemon
    Unavailable: 503,  # another host's agent is down or unreachable
}

# Documented on every route, so clients (and schemathesis) know the possible problem answers: problem+json, the
# only type they are served as. They name the Problem schema by reference; install() puts it in the components.
# A `model` on every route made FastAPI build a Problem validator per route and status (400 of them, that no
# request uses: most of the API's start-up, seconds under the lab's TCG) and list the route's own media type
# (application/json, text/plain) as a second, untrue, type of its errors.
RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": HTTPStatus(status).phrase,
             "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}}
    for status in (400, 401, 403, 404, 409, 422)
}


def _operations(app: FastAPI) -> list[tuple[re.Pattern[str], dict[str, frozenset[str]]]]:
    """Per schema path: its pattern, and per method the query parameters it declares (built once)."""
    table: list[tuple[re.Pattern[str], dict[str, frozenset[str]]]] | None = getattr(app.state, "operations", None)
    if table is None:
        table = [(compile_path(path)[0],
                  {method.upper(): frozenset(p["name"] for p in [*operations.get("parameters", []),
                                                                   *operation.get("parameters", [])]
                                             if p.get("in") == "query")
                   for method, operation in operations.items() if method != "parameters"})
                 for path, operations in app.openapi().get("paths", {}).items()]
        app.state.operations = table
    return table


def allowed_methods(app: FastAPI, path: str, fallback: str | None) -> str:
    """Every method the schema has for path (Starlette's own 405 names only the first matching route's);
    fallback (Starlette's Allow) for routes outside the schema."""
    methods = {m for pattern, operations in _operations(app) if pattern.match(path) for m in operations}
    return ", ".join(sorted(methods)) if methods else (fallback or "")


def unknown_query_parameters(app: FastAPI, method: str, path: str, given: set[str]) -> list[str]:
    """Query parameters the schema does not declare for this operation (a typo must not pass silently)."""
    for pattern, operations in _operations(app):
        if pattern.match(path) and method in operations:
            return sorted(given - operations[method])
    return []


def status_for(error_class: type[VrnicError]) -> int:
    for cls in error_class.__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def status_of(exc: VrnicError) -> int:
    return status_for(type(exc))


def problem(status: int, code: str, detail: str, request: Request, extra: dict[str, Any] | None = None) -> JSONResponse:
    body = {"type": f"urn:vrnic:problem:{code}", "title": HTTPStatus(status).phrase, "status": status,
            "detail": detail, "code": code, "instance": request.url.path,
            **{k: v for k, v in (extra or {}).items() if k not in {"code", "message"}}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(jsonable_encoder(body), status_code=status, media_type=MEDIA_TYPE, headers=headers)


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)  # builds and keeps app.openapi_schema
            schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = \
                Problem.model_json_schema(ref_template="#/components/schemas/{model}")
            return schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(VrnicError)
    async def vrnic_error(request: Request, exc: VrnicError) -> JSONResponse:
        status = status_of(exc)
        if status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return problem(status, exc.code, str(exc), request, exc.to_dict())

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
        where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors[:3])
        return problem(422, "invalid_request", f"invalid request: {where}", request, {"errors": errors})

    @app.exception_handler(DataError)
    async def data_error(request: Request, exc: DataError) -> JSONResponse:
        # The database refused a value the schema let through (e.g. NUL in text on PostgreSQL).
        return problem(400, InvalidArgument.code, f"the database refused a value: {exc.orig}", request)

    @app.exception_handler(OperationalError)
    async def database_unavailable(request: Request, exc: OperationalError) -> JSONResponse:
        # The database went away under the request (restarted, link cut, SQLite busy past its timeout). The
        # unit of work rolled back what it could; the pool reconnects on the next checkout (pre-ping), so the
        # client's move is to retry, and an allocation's Idempotency-Key makes that safe.
        log.warning("%s %s: database unavailable: %s", request.method, request.url.path, exc.orig)
        answer = problem(503, Unavailable.code, f"the database is unavailable ({type(exc.orig).__name__}); "
                                                "retry (POST /vrnics with the same Idempotency-Key is safe)", request)
        answer.headers["Retry-After"] = "1"
        return answer

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        answer = problem(exc.status_code, code, str(exc.detail), request)
        if exc.status_code == 405:  # RFC 9110: a 405 names the methods the resource has (all its routes)
            answer.headers["Allow"] = allowed_methods(app, request.url.path, (exc.headers or {}).get("Allow"))
        return answer

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return problem(500, "internal", "internal error (see the daemon's log)", request)
