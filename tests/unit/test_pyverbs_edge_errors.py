"""The pyverbs edge turns pyverbs' exceptions into the project's, and nothing else (pyverbs imports on any host)."""

from __future__ import annotations

import errno

import pytest
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError

from vrnic.backend.pyverbs_edge import device_errors
from vrnic.errors import DeviceError, NotSupported


def test_pyverbs_failures_become_device_errors_with_their_errno_and_what_failed() -> None:
    with pytest.raises(DeviceError, match=r"^create QP: Cannot allocate memory$") as raised, \
            device_errors("create QP"):
        raise PyverbsRDMAError("Failed to create QP", errno.ENOMEM)
    assert raised.value.errno == errno.ENOMEM and isinstance(raised.value.__cause__, PyverbsRDMAError)
    for code in (errno.EOPNOTSUPP, errno.ENOSYS):
        with pytest.raises(NotSupported, match="modify QP to rtr: not supported by the device"), \
                device_errors("modify QP to rtr"):
            raise PyverbsRDMAError("no", code)
    with pytest.raises(DeviceError, match="^reg MR: bad buffer$") as raised, device_errors("reg MR"):
        raise PyverbsError("bad buffer")
    assert raised.value.errno == 0


def test_other_exceptions_pass_and_one_instance_serves_every_use() -> None:
    guard = device_errors("query QP")
    with pytest.raises(KeyError), guard:
        raise KeyError("not pyverbs'")
    with guard:
        value = 5
    assert value == 5
    with pytest.raises(DeviceError, match="^query QP: "), guard:
        raise PyverbsRDMAError("again", errno.EINVAL)
