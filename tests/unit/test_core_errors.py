"""The one error hierarchy and its wire form (vrnic.errors)."""

from __future__ import annotations

import json

import pytest

from vrnic import errors
from vrnic.core.proto import ProtocolError
from vrnic.core.rings import RingCorrupt, WcStatus
from vrnic.core.translate import WrRejected
from vrnic.errors import (
    ApiError,
    BootFailure,
    ChannelLost,
    Conflict,
    DeviceError,
    InvalidArgument,
    LabError,
    NotFound,
    NotSupported,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    VrnicError,
    error_from_dict,
)


def all_error_classes() -> set[type[VrnicError]]:
    found: set[type[VrnicError]] = {VrnicError}
    todo = [VrnicError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__ == errors.__name__ and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


EXAMPLES: list[VrnicError] = [
    VrnicError("something broke"),
    InvalidArgument("bad port 0"),
    NotFound("unknown pd handle 5"),
    Conflict("already attached", current_state="attached"),
    Conflict("no state"),
    QuotaExceeded("max_qps", 64, 65),
    NotSupported("mode sriov is not enabled on this host"),
    Unauthenticated("missing bearer token"),
    PermissionDenied("not yours"),
    Unavailable("the agent of host b is unreachable"),
    ChannelLost("vrnicd closed the channel"),
    DeviceError("ibv_create_qp failed", errno=12),
    DeviceError("no errno"),
    LabError("qemu missing"),
    BootFailure("guest did not boot"),
    ApiError(404, {"code": "not_found", "detail": "vRNIC v-1 does not exist; refusing to start vm1"}),
    ApiError(409, {"code": "conflict", "detail": "released", "current_state": "released"}),
]


def test_examples_cover_every_error_class_of_vrnic_errors() -> None:
    assert {type(e) for e in EXAMPLES} == all_error_classes()


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in all_error_classes()]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip_keeps_type_message_and_fields(error: VrnicError) -> None:
    wire = json.loads(json.dumps(error.to_dict()))  # what really crosses the socket
    back = error_from_dict(wire)
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.to_dict() == error.to_dict()
    assert vars(back) == vars(error)  # limit/maximum/requested, current_state, errno


def test_field_values_survive() -> None:
    quota = error_from_dict(QuotaExceeded("max_pinned_bytes", 1 << 28, (1 << 28) + 1).to_dict())
    assert isinstance(quota, QuotaExceeded)
    assert (quota.limit, quota.maximum, quota.requested) == ("max_pinned_bytes", 1 << 28, (1 << 28) + 1)
    device = error_from_dict(DeviceError("busy", 16).to_dict())
    assert isinstance(device, DeviceError) and device.errno == 16
    conflict = error_from_dict(Conflict("x", "rts").to_dict())
    assert isinstance(conflict, Conflict) and conflict.current_state == "rts"


@pytest.mark.parametrize("error", [ProtocolError("bad magic"), RingCorrupt("indices claim 9"),
                                   WrRejected(WcStatus.LOC_PROT_ERR, "lkey 3 unknown")],
                         ids=lambda e: type(e).__name__)
def test_core_subclasses_come_back_as_invalid_argument(error: InvalidArgument) -> None:
    back = error_from_dict(error.to_dict())
    assert type(back) is InvalidArgument
    assert str(back) == str(error)


def test_unknown_or_missing_codes_become_the_base_error() -> None:
    back = error_from_dict({"code": "from_the_future", "message": "hm"})
    assert type(back) is VrnicError and str(back) == "hm"
    empty = error_from_dict({})
    assert type(empty) is VrnicError and str(empty) == "unknown error"


def test_malformed_fields_get_safe_defaults() -> None:
    quota = error_from_dict({"code": "quota_exceeded", "limit": "max_mrs", "maximum": "lots", "requested": None})
    assert isinstance(quota, QuotaExceeded)
    assert (quota.limit, quota.maximum, quota.requested) == ("max_mrs", 0, 0)
    device = error_from_dict({"code": "device_error", "message": "m", "errno": "EBUSY"})
    assert isinstance(device, DeviceError) and device.errno == 0
    conflict = error_from_dict({"code": "conflict", "message": "m", "current_state": 5})
    assert isinstance(conflict, Conflict) and conflict.current_state is None


def test_a_guest_catching_a_base_class_catches_what_the_wire_rebuilt() -> None:
    """Frontends catch by family (`except InvalidArgument`); the rebuilt error must land in the same family."""
    for error in EXAMPLES:
        back = error_from_dict(error.to_dict())
        families = [cls for cls in all_error_classes() if isinstance(error, cls)]
        assert families and all(isinstance(back, cls) for cls in families), type(error).__name__
    with pytest.raises(LabError):  # a boot failure is handled wherever the lab failing is
        raise error_from_dict(BootFailure("guest did not boot").to_dict())
