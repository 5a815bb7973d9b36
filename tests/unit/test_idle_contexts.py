"""A shared-ring vRNIC keeps one device context for its next guest (issue 14), on the fake edge."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.test_backend_session import guest_fds
from vrnic.backend.attachment import PeerCred
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeContext, FakeEdge
from vrnic.backend.idle_contexts import IdleContexts
from vrnic.backend.registry import VirtualRnic
from vrnic.core.recovery import token_digest
from vrnic.core.specs import AttachInfo, DeviceInfo, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.core.verb_args import Attach
from vrnic.errors import Conflict, DeviceError, NotFound
from vrnic.frontend import CQ, MR, PD, QP, Access, Context

ARENA = 1 << 20
ME = PeerCred(os.getpid(), os.getuid(), os.getgid())


def test_a_vrnic_opens_its_context_at_admission_and_each_guest_takes_it_over(
        make_vrnic: Callable[..., AttachInfo], driver: VerbsDriver, edge: FakeEdge) -> None:
    info = make_vrnic()
    assert edge.open_contexts == driver.idle_contexts.count() == 1
    seen = []
    for _ in range(3):
        with Context.attach(info, ARENA) as ctx:
            assert edge.open_contexts == 1 and driver.idle_contexts.count() == 0  # taken, not a new one
            session = driver.registry.get(info.vrnic_id).session
            seen.append(session.device)  # type: ignore[union-attr]
            pd = PD(ctx)
            cq = CQ(ctx, 16)
            QP(pd, cq, cq)
            MR(pd, 4096, Access.LOCAL_WRITE)
        assert edge.open_contexts == driver.idle_contexts.count() == 1
        assert not edge.live  # every object of the guest destroyed before its context was kept
    assert seen[0] is seen[1] is seen[2]
    driver.release_vrnic(info.vrnic_id)
    assert edge.open_contexts == driver.idle_contexts.count() == 0


def test_a_release_with_a_guest_attached_keeps_nothing(make_vrnic: Callable[..., AttachInfo],
                                                       driver: VerbsDriver, edge: FakeEdge) -> None:
    info = make_vrnic()
    session = driver.open_session(Attach(token=info.token or ""), guest_fds(), ME)
    assert driver.idle_contexts.count() == 0
    driver.release_vrnic(info.vrnic_id)
    assert session.closed
    assert edge.open_contexts == driver.idle_contexts.count() == 0


def test_a_second_guest_refused_leaves_the_first_ones_context_alone(make_vrnic: Callable[..., AttachInfo],
                                                                   driver: VerbsDriver, edge: FakeEdge) -> None:
    info = make_vrnic()
    first = driver.open_session(Attach(token=info.token or ""), guest_fds(), ME)
    with pytest.raises(Conflict):
        driver.open_session(Attach(token=info.token or ""), guest_fds(), ME)
    assert edge.open_contexts == 1 and not first.closed
    first.close()
    assert edge.open_contexts == driver.idle_contexts.count() == 1


class _Context(FakeContext):
    def __init__(self, edge: FakeEdge, name: str, reusable: bool) -> None:
        super().__init__(edge, name)
        edge.open_contexts += 1
        self._reusable = reusable

    def reusable(self) -> bool:
        return self._reusable


def _vrnic(vrnic_id: str) -> VirtualRnic:
    """A stand-in with what IdleContexts reads of a vRNIC: its id and device."""
    return SimpleNamespace(spec=SimpleNamespace(id=vrnic_id), device="fake0")  # type: ignore[return-value]


def _registry(held: set[str]) -> Callable[[VirtualRnic], bool]:
    return lambda vrnic: vrnic.spec.id in held


def test_a_context_is_kept_only_if_reusable_the_vrnic_is_held_and_has_none(edge: FakeEdge) -> None:
    held = {"v1", "v2"}
    contexts = IdleContexts(lambda name: _Context(edge, name, True), _registry(held))
    v1, v2 = _vrnic("v1"), _vrnic("v2")
    contexts.prime(v1)
    assert contexts.count() == 1
    spare = _Context(edge, "fake0", True)
    contexts.give_back(v1, spare)  # it has one already
    assert spare.closed and contexts.count() == 1
    taken = contexts.take(v1)
    broken = _Context(edge, "fake0", False)  # an object in it may live on
    contexts.give_back(v1, broken)
    assert broken.closed and contexts.count() == 0
    held.discard("v1")  # released meanwhile
    contexts.give_back(v1, taken)
    assert taken.closed and contexts.count() == 0
    contexts.prime(v2)
    contexts.drop("v2")
    contexts.drop("v2")  # twice: nothing left to close
    assert edge.open_contexts == 0


def test_a_device_that_will_not_open_at_admission_leaves_the_attach_to_report_it(edge: FakeEdge) -> None:
    def refuse(name: str) -> FakeContext:
        raise DeviceError(f"open {name}: no such device")

    contexts = IdleContexts(refuse, _registry({"v1"}))
    contexts.prime(_vrnic("v1"))
    assert contexts.count() == 0
    with pytest.raises(DeviceError, match="no such device"):
        contexts.take(_vrnic("v1"))


def test_at_most_limit_contexts_wait_and_a_kept_one_lets_go_of_its_spares(edge: FakeEdge) -> None:
    released = []

    class Spares(_Context):
        def release_spares(self) -> None:
            released.append(self)

    vrnics = [_vrnic(f"v{n}") for n in range(3)]
    contexts = IdleContexts(lambda name: Spares(edge, name, True), _registry({"v0", "v1", "v2"}), limit=2)
    for vrnic in vrnics:
        contexts.prime(vrnic)
    assert contexts.count() == 2 and edge.open_contexts == 2  # the third vRNIC opens its device at attach
    taken = contexts.take(vrnics[0])
    third = contexts.take(vrnics[2])  # none waiting for it: a new one
    contexts.give_back(vrnics[2], third)
    contexts.give_back(vrnics[0], taken)  # the limit is reached again: closed
    assert contexts.count() == 2 and taken.closed and not third.closed
    assert released[-2:] == [third, taken]
    contexts.close()
    assert edge.open_contexts == 0


class _OpenCountingEdge(FakeEdge):
    """Counts device opens as the pyverbs edge makes them: describe() opens the device for its queries, and
    open_described() reads the description through the context it opens (one open, not two)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_opens = 0

    def describe(self, name: str) -> DeviceInfo:
        self.device_opens += 1
        return super().describe(name)

    def open(self, name: str) -> FakeContext:
        self.device_opens += 1
        return super().open(name)

    def open_described(self, name: str) -> tuple[FakeContext, DeviceInfo]:
        context = self.open(name)
        return context, FakeEdge.describe(self, name)


def test_a_restored_vrnic_opens_its_device_once_and_keeps_that_context_for_its_guest(tmp_path: Path) -> None:
    """Crash recovery holds each vRNIC again as a create does: one device open, whose context its guest takes."""
    spec = VrnicSpec(id="v1", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 1))
    first_edge = _OpenCountingEdge()
    first = VerbsDriver(socket_path=tmp_path / "first.sock", edge=first_edge)
    try:
        opened = first_edge.device_opens  # the driver described each device at start
        info = first.create_vrnic(spec, "fake0")
        assert first_edge.device_opens - opened == 1 and first.idle_contexts.holds("v1")
    finally:
        first.close()
    edge = _OpenCountingEdge()
    second = VerbsDriver(socket_path=tmp_path / "second.sock", edge=edge)
    try:
        opened = edge.device_opens
        second.restore_vrnic(spec, "fake0", token_digest(info.token or ""))
        assert edge.device_opens - opened == 1 and edge.open_contexts == 1 and second.idle_contexts.holds("v1")
        with Context.attach(info.model_copy(update={"socket_path": str(tmp_path / "second.sock")}), ARENA) as ctx:
            PD(ctx)
            assert edge.device_opens - opened == 1 and not second.idle_contexts.holds("v1")  # its guest took it
        with pytest.raises(NotFound):
            second.restore_vrnic(spec.model_copy(update={"id": "v2"}), "no-such-device", "digest")
        assert edge.open_contexts == 1 and second.registry.ids() == {"v1"}  # nothing opened for the refused one
    finally:
        second.close()
    assert edge.open_contexts == 0
