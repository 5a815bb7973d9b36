"""vrnicd past descriptor 1024: the daemons raise the soft limit, and the engine waits with poll(2), which (unlike
select(2)) watches descriptors numbered 1024 and up."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator

import pytest

from tests.unit.connected_pair import connected_pair
from vrnic.backend.descriptors import raise_descriptor_limit
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.session import GuestSession
from vrnic.core.specs import AttachInfo
from vrnic.frontend import Context, RecvRequest, SendRequest, WrOpcode

ARENA = 1 << 20


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """Descriptors 3..1099 taken, so that what vrnicd receives or opens next is numbered past 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_goes_up_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        assert raise_descriptor_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raise_descriptor_limit() == hard  # already there
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_guests_whose_descriptors_in_vrnicd_are_past_1024_are_served_and_the_engine_sleeps(
        many_descriptors: None, make_vrnic: Callable[..., AttachInfo], driver: VerbsDriver) -> None:
    info_a, info_b = make_vrnic(), make_vrnic(device="fake1")
    with Context.attach(info_a, ARENA) as ca, Context.attach(info_b, ARENA) as cb:
        session = driver.registry.get(info_a.vrnic_id).session
        assert isinstance(session, GuestSession) and session.doorbell_fd >= 1024
        qa, qb, cqa, cqb, mra, mrb = connected_pair(ca, cb)
        for number in range(3):
            mra.buffer.write(b"high %d" % number)
            qb.post_recv(RecvRequest(number, (mrb.sge(0, 64),)))
            qa.post_send(SendRequest(number, WrOpcode.SEND, (mra.sge(0, 6),)))
            assert [(c.wr_id, c.status) for c in cqa.wait(1, timeout=5)] == [(number, 0)]
            assert [(c.wr_id, c.byte_len) for c in cqb.wait(1, timeout=5)] == [(number, 6)]
            assert mrb.buffer.read(6) == b"high %d" % number
        waits = session.engine.waits  # type: ignore[attr-defined]
        time.sleep(0.5)
        # Idle, the engine sleeps in poll until a doorbell, a completion or its one-second tick (select(2) failed
        # at once on such descriptors, and the engine spun)
        assert session.engine.waits - waits <= 2  # type: ignore[attr-defined]
