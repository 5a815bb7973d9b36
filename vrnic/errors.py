"""The one error hierarchy of vrnic.

Edges (verbs, netlink, sysfs, libvirt, subprocess) translate what they catch
into these; everything above them only ever sees a VrnicError.
"""

from __future__ import annotations

import json
from typing import Any


class VrnicError(Exception):
    """Base of every error vrnic raises on purpose."""

    code = "internal"

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": str(self)}


class InvalidArgument(VrnicError):
    code = "invalid_argument"


class NotFound(VrnicError):
    """An unknown name or handle (also what a foreign handle looks like)."""

    code = "not_found"


class Conflict(VrnicError):
    """The request is valid but not in the object's current state."""

    code = "conflict"

    def __init__(self, message: str, current_state: str | None = None) -> None:
        super().__init__(message)
        self.current_state = current_state

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "current_state": self.current_state}


class QuotaExceeded(VrnicError):
    code = "quota_exceeded"

    def __init__(self, limit: str, maximum: int, requested: int) -> None:
        super().__init__(f"quota exceeded: {limit} (limit {maximum}, would reach {requested})")
        self.limit = limit
        self.maximum = maximum
        self.requested = requested

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "limit": self.limit, "maximum": self.maximum,
                "requested": self.requested}


class NotSupported(VrnicError):
    code = "not_supported"


class Unauthenticated(VrnicError):
    """No credentials, or credentials nobody issued (API: 401)."""

    code = "unauthenticated"


class PermissionDenied(VrnicError):
    """Known caller, but the operation is not theirs to do (API: 403)."""

    code = "permission_denied"


class Unavailable(VrnicError):
    """Another host's agent (or the service it needs) cannot be reached now; retry later (API: 503)."""

    code = "unavailable"


class ChannelLost(Unavailable):
    """A guest's channel to vrnicd is gone (vrnicd restarted, was stopped, or released the vRNIC): every object
    of that attachment died with it. Attach again with the same token and rebuild them."""

    code = "channel_lost"


class DeviceError(VrnicError):
    """The kernel or device refused an operation; carries the errno."""

    code = "device_error"

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "errno": self.errno}


class ApiError(VrnicError):
    """The REST API answered with a problem (its JSON body in `problem`); raised by the API's clients."""

    code = "api_error"

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        detail = problem.get("detail") or problem.get("title") or "request failed"
        state = f" (current state: {problem['current_state']})" if problem.get("current_state") else ""
        super().__init__(f"{status} {problem.get('code', 'error')}: {detail}{state}")

    @classmethod
    def from_answer(cls, status: int, body: str, reason: str) -> ApiError:
        """The error for an answer of status >= 400, whether or not its body is a JSON problem."""
        try:
            problem = json.loads(body)
        except ValueError:
            problem = {"detail": body[:200] or reason}
        return cls(status, problem if isinstance(problem, dict) else {"detail": str(problem)})

    def to_dict(self) -> dict[str, object]:  # named apart from a problem body's own status
        return {**super().to_dict(), "api_status": self.status, "api_problem": self.problem}


class LabError(VrnicError):
    """The lab (QEMU guest) could not be prepared or started."""

    code = "lab_error"


class BootFailure(LabError):
    code = "boot_failure"


def error_from_dict(data: dict[str, object]) -> VrnicError:
    """Rebuild a typed error from its wire form (the frontend's side of to_dict)."""
    code = str(data.get("code", "internal"))
    message = str(data.get("message", "unknown error"))

    def _int(key: str) -> int:
        value = data.get(key, 0)
        return value if isinstance(value, int) else 0

    if code == QuotaExceeded.code:
        return QuotaExceeded(str(data.get("limit", "?")), _int("maximum"), _int("requested"))
    if code == DeviceError.code:
        return DeviceError(message, _int("errno"))
    if code == Conflict.code:
        state = data.get("current_state")
        return Conflict(message, state if isinstance(state, str) else None)
    if code == ApiError.code:
        problem = data.get("api_problem")
        return ApiError(_int("api_status"), problem if isinstance(problem, dict) else {"detail": message})
    # Any class with that code, rebuilt as its nearest ancestor from this module: subclasses kept
    # elsewhere (vrnic.core) may need constructor arguments the wire form does not carry.
    found = _by_code().get(code, VrnicError)
    rebuilt: type[VrnicError] = next(c for c in found.__mro__ if c.__module__ == __name__)
    return rebuilt(message)


def _by_code() -> dict[str, type[VrnicError]]:
    classes: dict[str, type[VrnicError]] = {}
    pending: list[type[VrnicError]] = [VrnicError]
    while pending:
        cls = pending.pop()
        classes.setdefault(cls.code, cls)
        pending += cls.__subclasses__()
    return classes
