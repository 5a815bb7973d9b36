"""POST /api/v1/vrnics served without FastAPI's per-request machinery, for the plain request (issue 14).

FastAPI's request handler (dependency solving, parameter checks, response validation) costs about half the
HTTP stack's CPU per allocation, the hottest write of the API. This route serves the plain request itself:
a JSON body that `VrnicCreate` accepts, a bearer token the token cache knows, no query string, at most one
Idempotency-Key that the declared header accepts. It gives every other request, with the body it read, to the
FastAPI route, which stays the only one documented (OpenAPI) and answers every refusal of the request's form.
A request the fast path serves is one the FastAPI route would accept, and it gets the same call and the same
answer (tests/api/test_fast_allocate.py sends the same requests through both and compares).

Errors from the allocation itself (quota, conflicts, unavailable) propagate to the app's problem handlers,
as they do from any route.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound

from vrnic.api.schemas import VrnicCreate, VrnicOut

if TYPE_CHECKING:
    from starlette.datastructures import URLPath
    from starlette.types import Receive, Scope, Send

    from vrnic.api.auth import Principal

PATH = "/api/v1/vrnics"
# the declared Idempotency-Key header's rules (routes.py declares the header with these)
IDEMPOTENCY_KEY_MAX = 255
PRINTABLE_PATTERN = r"^[\x20-\x7e]*$"
_PRINTABLE = re.compile(PRINTABLE_PATTERN)
_DECLINED = "vrnic.fast_allocate.declined"  # scope key: the request goes to the FastAPI route


def answer_allocation(response: Response, out: VrnicOut, replayed: bool) -> None:
    """The status and headers of an allocation's answer, on either route."""
    response.headers["Location"] = f"{PATH}/{out.id}"
    if replayed:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
        response.headers["Link"] = f'<{PATH}/{out.id}/token>; rel="token"'


class FastAllocateRoute(BaseRoute):
    """Put first in the app's routes. It matches POST /api/v1/vrnics only (never partially, so a 405's Allow
    still comes from the routes that declare the path), and counts what it served and what it passed on."""

    def __init__(self) -> None:
        self.served = 0
        self.declined = 0

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == PATH
                and not scope.get("root_path") and _DECLINED not in scope):
            return Match.FULL, {"path_params": {}}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        body = await request.body()
        cp = request.app.state.control_plane
        parsed = _plain_request(request, body, cp)
        if parsed is None:
            self.declined += 1
            await _to_the_declared_route(scope, body, receive, send)
            return
        self.served += 1
        out, replayed = await cp.write(cp.vrnics.allocate, *parsed)
        # as FastAPI answers a VrnicOut route: pydantic's JSON of the model, by alias
        response = Response(out.model_dump_json(by_alias=True), 201, media_type="application/json")
        answer_allocation(response, out, replayed)
        await response(scope, receive, send)


def _plain_request(request: Request, body: bytes, cp: Any) -> tuple[Principal, VrnicCreate, str | None] | None:
    """(caller, body, Idempotency-Key) of a request the declared route would accept as they are, else None."""
    if request.scope["query_string"]:
        return None
    headers = request.headers
    if headers.get("content-type", "").lower() != "application/json":
        return None
    scheme, token = get_authorization_scheme_param(headers.get("authorization"))  # as HTTPBearer reads it
    if scheme.lower() != "bearer" or not token:
        return None
    principal = cp.tenants.cached_principal(token)
    if principal is None:  # unknown here: the declared route looks it up (or refuses it)
        return None
    keys = headers.getlist("idempotency-key")
    if len(keys) > 1 or (keys and not (1 <= len(keys[0]) <= IDEMPOTENCY_KEY_MAX and _PRINTABLE.fullmatch(keys[0]))):
        return None
    try:
        # as FastAPI reads a model body: the parsed JSON validated in Python mode
        create = VrnicCreate.model_validate(json.loads(body), from_attributes=True)
    except (ValueError, ValidationError):  # JSONDecodeError is a ValueError
        return None
    return principal, create, keys[0] if keys else None


async def _to_the_declared_route(scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
    """Route the request again, with this route out of the way and the body it already read."""
    replayed = False

    async def replay() -> Any:
        nonlocal replayed
        if replayed:  # after the body, the connection's own messages (a disconnect)
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope[_DECLINED] = True
    await scope["router"](scope, replay, send)
