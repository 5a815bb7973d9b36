"""The hottest vRNIC routes served in front of FastAPI's middleware and request machinery, for the plain request
(issue 14).

FastAPI's request handler (dependency solving, parameter checks, response validation) costs about half the
HTTP stack's CPU per request, and its five middleware layers a sixth more. Allocation (POST /api/v1/vrnics) and
release (DELETE /api/v1/vrnics/{id}) are the writes a tenant makes most, so a route here serves their plain
request itself: a bearer token the token cache knows, no query string, and for allocation a JSON body that
`VrnicCreate` accepts and at most one Idempotency-Key that the declared header accepts. Every other request goes,
with the body already read, through the app's middleware to the declared FastAPI route, which stays the only one
documented (OpenAPI) and answers every refusal of the request's form. A request served here is one the declared
route would accept, and it gets the same call and the same answer (tests/api/test_fast_routes.py sends the same
requests through both and compares).

Errors of the operation itself (quota, not found, conflicts, unavailable) are answered by the app's problem
handlers, found as Starlette finds them; an error only the catch-all handler answers is answered by it, then
raised for the server to log, as Starlette's ServerErrorMiddleware does. An app with a request body limit
(`max_body_size`) gets no fast routes: its limit must see every request.
"""

from __future__ import annotations

import inspect
import json
import re
from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from vrnic.api.routes import IDEMPOTENCY_KEY_MAX, VRNIC_ID_PATTERN, Printable, answer_allocation
from vrnic.api.schemas import VrnicCreate, VrnicOut

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from vrnic.api.auth import Principal
    from vrnic.api.controlplane import ControlPlane

VRNICS = "/api/v1/vrnics"
_PRINTABLE = re.compile(Printable)  # the declared Idempotency-Key header's pattern (and IDEMPOTENCY_KEY_MAX)
_ONE_VRNIC = re.compile(re.escape(VRNICS) + "/(" + VRNIC_ID_PATTERN.strip("^$") + ")")


def install(app: FastAPI, routes: Sequence[PlainRequestRoute] | None = None) -> None:
    """Put the fast routes (default: allocation and release) in front of the app's middleware; app.state.fast_routes
    is their list (served in its order, counted by each)."""
    app.state.fast_routes = list(routes) if routes is not None else [FastAllocateRoute(), FastReleaseRoute()]
    build = app.build_middleware_stack

    def build_behind_fast_routes() -> ASGIApp:
        stack = build()
        return stack if getattr(app, "max_body_size", None) is not None else FastRoutes(app, stack)

    app.build_middleware_stack = build_behind_fast_routes  # type: ignore[method-assign]


class PlainRequestRoute:
    """One method on one path, served here when `plain` can read the request, else passed on; counts what it
    served and what it passed on."""

    method: str

    def __init__(self) -> None:
        self.served = 0
        self.declined = 0

    @abstractmethod
    def path_arguments(self, path: str) -> tuple[str, ...] | None:
        """The path's parameters if the path is this route's, else None."""

    @abstractmethod
    def plain(self, request: Request, body: bytes, path_arguments: tuple[str, ...]) -> tuple[Any, ...] | None:
        """The operation's arguments after the caller, if the declared route would take the request as it is."""

    @abstractmethod
    async def serve(self, cp: ControlPlane, caller: Principal, arguments: tuple[Any, ...]) -> Response:
        """Run the operation and answer as the declared route does."""


class FastRoutes:
    """The ASGI app in front of app's middleware stack: the fast routes' plain requests are served here, the
    rest go to the stack."""

    def __init__(self, app: FastAPI, stack: ASGIApp) -> None:
        self.app = app
        self.stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            for route in self.app.state.fast_routes:
                if scope["method"] == route.method:
                    found = route.path_arguments(scope["path"])
                    if found is not None:
                        await self._serve(route, found, scope, receive, send)
                        return
        await self.stack(scope, receive, send)

    async def _serve(self, route: PlainRequestRoute, path_arguments: tuple[str, ...], scope: Scope,
                     receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            body = await request.body()
        except ClientDisconnect:  # gone before its request was read: nothing to do, no one to answer
            return
        cp: ControlPlane = self.app.state.control_plane
        caller = _known_caller(request, cp)
        arguments = None if caller is None else route.plain(request, body, path_arguments)
        if caller is None or arguments is None:
            route.declined += 1
            await self.stack(scope, _replaying(body, receive), send)
            return
        route.served += 1
        try:
            response = await route.serve(cp, caller, arguments)
        except Exception as exc:
            await self._answer_error(request, exc, send)
            return
        await response(scope, receive, send)

    async def _answer_error(self, request: Request, exc: Exception, send: Send) -> None:
        handlers = self.app.exception_handlers
        handler = next((handlers[kind] for kind in type(exc).__mro__ if kind in handlers), None)
        catch_all = handler is None or handler is handlers.get(Exception) or handler is handlers.get(500)
        handler = handler or handlers.get(500)
        if handler is None:
            raise exc
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        await response(request.scope, request.receive, send)
        if catch_all:  # as ServerErrorMiddleware: answered, and raised for the server to log
            raise exc


def _replaying(body: bytes, receive: Receive) -> Receive:
    """receive, with the body already read given once more first."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:  # after the body, the connection's own messages (a disconnect)
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class FastAllocateRoute(PlainRequestRoute):
    """POST /api/v1/vrnics."""

    method = "POST"

    def path_arguments(self, path: str) -> tuple[str, ...] | None:
        return () if path == VRNICS else None

    def plain(self, request: Request, body: bytes, path_arguments: tuple[str, ...]) -> tuple[Any, ...] | None:
        if request.headers.get("content-type", "").lower() != "application/json":
            return None
        keys = request.headers.getlist("idempotency-key")
        if len(keys) > 1 or (keys and not (1 <= len(keys[0]) <= IDEMPOTENCY_KEY_MAX
                                           and _PRINTABLE.fullmatch(keys[0]))):
            return None
        try:
            # as FastAPI reads a model body: the parsed JSON validated in Python mode
            create = VrnicCreate.model_validate(json.loads(body), from_attributes=True)
        except (ValueError, ValidationError):  # JSONDecodeError is a ValueError
            return None
        return create, keys[0] if keys else None

    async def serve(self, cp: ControlPlane, caller: Principal, arguments: tuple[Any, ...]) -> Response:
        out, replayed = await cp.write(cp.vrnics.allocate, caller, *arguments)
        response = _vrnic_response(out, 201)
        answer_allocation(response, out, replayed)
        return response


class FastReleaseRoute(PlainRequestRoute):
    """DELETE /api/v1/vrnics/{vrnic_id} (not forced: `?force=` is a query string, so it goes to the declared
    route)."""

    method = "DELETE"

    def path_arguments(self, path: str) -> tuple[str, ...] | None:
        found = _ONE_VRNIC.fullmatch(path)
        return found.groups() if found else None

    def plain(self, request: Request, body: bytes, path_arguments: tuple[str, ...]) -> tuple[Any, ...] | None:
        return path_arguments  # the declared route reads no body and no header but the token

    async def serve(self, cp: ControlPlane, caller: Principal, arguments: tuple[Any, ...]) -> Response:
        out = await cp.write(cp.vrnics.release, caller, *arguments, force=False)
        return _vrnic_response(out, 200)


def _vrnic_response(out: VrnicOut, status: int) -> Response:
    # as FastAPI answers a VrnicOut route: pydantic's JSON of the model, by alias
    return Response(out.model_dump_json(by_alias=True), status, media_type="application/json")


def _known_caller(request: Request, cp: ControlPlane) -> Principal | None:
    """The caller, when the request has no query string and its bearer token is known without a database
    read; else None (the declared route looks the token up, or refuses it)."""
    if request.scope["query_string"]:
        return None
    scheme, token = get_authorization_scheme_param(request.headers.get("authorization"))  # as HTTPBearer
    if scheme.lower() != "bearer" or not token:
        return None
    return cp.tenants.cached_principal(token)
