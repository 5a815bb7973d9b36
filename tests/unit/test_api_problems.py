"""Every VrnicError maps to one HTTP status and an RFC 9457 body, in one place."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from vrnic import errors
from vrnic.api.problems import MEDIA_TYPE, problem, status_for, status_of
from vrnic.db.schema import SchemaOutOfDate


def _all_subclasses(cls: type) -> set[type]:
    return {cls} | {s for sub in cls.__subclasses__() for s in _all_subclasses(sub)}


EXPECTED = {
    errors.VrnicError: 500,
    errors.InvalidArgument: 400,
    errors.Unauthenticated: 401,
    errors.PermissionDenied: 403,
    errors.QuotaExceeded: 403,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.NotSupported: 422,
    errors.DeviceError: 502,
    errors.ApiError: 502,
    errors.LabError: 500,
    errors.BootFailure: 500,
    SchemaOutOfDate: 503,
    errors.Unavailable: 503,
    errors.ChannelLost: 503,  # a guest's (frontend) error; as Unavailable should one reach the API
}


def _make(cls: type[errors.VrnicError]) -> errors.VrnicError:
    if issubclass(cls, errors.QuotaExceeded):
        return cls("max_qps", 4, 5)
    if issubclass(cls, errors.ApiError):
        return cls(404, {"code": "not_found", "detail": "boom"})
    return cls("boom")


@pytest.mark.parametrize("cls", sorted(EXPECTED, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_status_of_each_error(cls: type[errors.VrnicError]) -> None:
    assert status_of(_make(cls)) == EXPECTED[cls]


def test_every_error_in_the_hierarchy_has_a_status() -> None:
    in_module = {c for c in _all_subclasses(errors.VrnicError) if c.__module__ == "vrnic.errors"}
    assert in_module <= set(EXPECTED), f"map these in vrnic/api/problems.py: {in_module - set(EXPECTED)}"
    for cls in _all_subclasses(errors.VrnicError):  # subclasses elsewhere inherit their parent's status
        assert status_for(cls) == next(EXPECTED[c] for c in cls.__mro__ if c in EXPECTED), cls


def _request(path: str = "/api/v1/vrnics/x") -> Request:
    return Request({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""})


def test_problem_body_carries_the_error_fields() -> None:
    exc = errors.Conflict("cannot release", current_state="attached")
    response = problem(409, exc.code, str(exc), _request(), exc.to_dict())
    assert response.media_type == MEDIA_TYPE
    body = json.loads(bytes(response.body))
    assert body == {"type": "urn:vrnic:problem:conflict", "title": "Conflict", "status": 409,
                    "detail": "cannot release", "code": "conflict", "instance": "/api/v1/vrnics/x",
                    "current_state": "attached"}
    quota = errors.QuotaExceeded("vrnics", 2, 3)
    body = json.loads(bytes(problem(403, quota.code, str(quota), _request(), quota.to_dict()).body))
    assert (body["limit"], body["maximum"], body["requested"]) == ("vrnics", 2, 3)


def test_unauthenticated_says_bearer() -> None:
    response = problem(401, "unauthenticated", "missing bearer token", _request())
    assert response.headers["www-authenticate"] == "Bearer"


def test_an_api_error_keeps_the_problem_bodys_own_status() -> None:
    """Should another API's refusal reach ours, it answers 502 and names that API's answer beside its own."""
    exc = errors.ApiError(404, {"code": "not_found", "detail": "vRNIC v-1 does not exist"})
    response = problem(status_of(exc), exc.code, str(exc), _request(), exc.to_dict())
    body = json.loads(bytes(response.body))
    assert (response.status_code, body["status"], body["api_status"]) == (502, 502, 404)
    assert body["api_problem"]["detail"] == "vRNIC v-1 does not exist"
