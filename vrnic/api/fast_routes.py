"""The hottest vRNIC routes served without FastAPI's per-request machinery, for the plain request (issue 14).

FastAPI's request handler (dependency solving, parameter checks, response validation) costs about half the
HTTP stack's CPU per request. Allocation (POST /api/v1/vrnics) and release (DELETE /api/v1/vrnics/{id}) are
the writes a tenant makes most, so a route here serves their plain request itself: a bearer token the token
cache knows, no query string, and for allocation a JSON body that `VrnicCreate` accepts and at most one
Idempotency-Key that the declared header accepts. Every other request is routed again, with the body already
read, past these routes to the declared FastAPI route, which stays the only one documented (OpenAPI) and
answers every refusal of the request's form. A request served here is one the declared route would accept,
and it gets the same call and the same answer (tests/api/test_fast_routes.py sends the same requests through
both and compares).

Errors of the operation itself (quota, not found, conflicts, unavailable) propagate to the app's problem
handlers, as they do from any route.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound

from vrnic.api.routes import IDEMPOTENCY_KEY_MAX, VRNIC_ID_PATTERN, Printable, answer_allocation
from vrnic.api.schemas import VrnicCreate, VrnicOut

if TYPE_CHECKING:
    from starlette.datastructures import URLPath
    from starlette.types import Receive, Scope, Send

    from vrnic.api.auth import Principal
    from vrnic.api.controlplane import ControlPlane

VRNICS = "/api/v1/vrnics"
_PRINTABLE = re.compile(Printable)  # the declared Idempotency-Key header's pattern (and IDEMPOTENCY_KEY_MAX)
_ONE_VRNIC = re.compile(re.escape(VRNICS) + "/(" + VRNIC_ID_PATTERN.strip("^$") + ")")
_DECLINED = "vrnic.fast_routes.declined"  # scope key: the request goes to the declared routes
_ARGUMENTS = "vrnic.fast_routes.arguments"  # scope key: the path's parameters, as the route matched them


def install(app: FastAPI) -> None:
    """Put the fast routes in front of the app's own (after its routers are included)."""
    app.router.routes[:0] = [FastAllocateRoute(), FastReleaseRoute()]


class PlainRequestRoute(BaseRoute):
    """One method on one path, served here when `plain` can read the request, else passed on. It matches
    fully or not at all (never partially, so a 405's Allow still comes from the declared routes), and counts
    what it served and what it passed on."""

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

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (scope["type"] == "http" and scope["method"] == self.method and not scope.get("root_path")
                and _DECLINED not in scope):
            found = self.path_arguments(scope["path"])
            if found is not None:
                return Match.FULL, {"path_params": {}, _ARGUMENTS: found}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        body = await request.body()
        cp: ControlPlane = request.app.state.control_plane
        caller = _known_caller(request, cp)
        arguments = None if caller is None else self.plain(request, body, scope[_ARGUMENTS])
        if caller is None or arguments is None:
            self.declined += 1
            await _to_the_declared_routes(scope, body, receive, send)
            return
        self.served += 1
        response = await self.serve(cp, caller, arguments)
        await response(scope, receive, send)


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


async def _to_the_declared_routes(scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
    """Route the request again, with the fast routes out of the way and the body already read."""
    replayed = False

    async def replay() -> Any:
        nonlocal replayed
        if replayed:  # after the body, the connection's own messages (a disconnect)
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope[_DECLINED] = True
    await scope["router"](scope, replay, send)
