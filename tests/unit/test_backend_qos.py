"""The verbs driver's QoS rules where no mechanism exists (the in-memory NIC has none): a policy that limits
anything is refused, never accepted and ignored; one that asks nothing is fine. Enforcement itself is proven
on rxe in the lab (tests/kernel/test_qos_rxe.py) and on real netlink (tests/kernel/test_qos_shaper.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.core.qos import RC_TIMEOUT_UNIT_S, RateMeter, queue_wait_s, rc_timeout_floor, rc_timeout_outlasts
from vrnic.core.specs import AttachInfo, QosPolicy, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict, NotFound, NotSupported
from vrnic.frontend import CQ, PD, QP, Context

ARENA = 1 << 20

pytestmark = pytest.mark.unit


def _spec(n: int, qos: QosPolicy) -> VrnicSpec:
    return VrnicSpec(id=f"q{n}", tenant="t1", vpc_id=1, quota=Quota(), virtual_gid=make_virtual_gid(1, 700 + n),
                     qos=qos)


@contextmanager
def _pair_with_qps(driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch,
                   count: int, kbit: int = 12_000) -> Iterator[tuple[Context, Context, list[QP], list[QP]]]:
    """Guest a on fake0, whose class drains at kbit (what a shaping device would report; the fake NIC cannot
    shape), and guest b on fake1 (shapes nothing), with count RC QPs each on one 64-entry CQ."""
    monkeypatch.setattr(driver, "_qos_drain_kbit", lambda device, vrnic_id: kbit if device == "fake0" else None)
    info_a, info_b = make_vrnic(), make_vrnic(device="fake1")
    with Context.attach(info_b, ARENA) as cb, Context.attach(info_a, ARENA) as ca:
        pd_a, cq_a, pd_b, cq_b = PD(ca), CQ(ca, 64), PD(cb), CQ(cb, 64)
        yield ca, cb, [QP(pd_a, cq_a, cq_a) for _ in range(count)], [QP(pd_b, cq_b, cq_b) for _ in range(count)]


def test_a_limiting_policy_on_a_device_without_a_mechanism_is_refused(driver: VerbsDriver, edge: FakeEdge) -> None:
    for n, policy in enumerate((QosPolicy(rate_cap_mbps=10), QosPolicy(guarantee_mbps=5), QosPolicy(weight=2))):
        with pytest.raises(NotSupported, match="no QoS mechanism"):
            driver.create_vrnic(_spec(n, policy), "fake0")
    assert driver.vrnic_ids() == set()  # nothing half-made
    assert edge.open_contexts == 0  # nor the context opened for the first guest
    driver.create_vrnic(_spec(9, QosPolicy()), "fake0")  # asks nothing: nothing to enforce
    with pytest.raises(NotSupported, match="no QoS mechanism"):
        driver.set_qos("q9", QosPolicy(rate_cap_mbps=10))
    driver.set_qos("q9", QosPolicy())
    with pytest.raises(NotFound):
        driver.set_qos("nope", QosPolicy())
    assert driver.qos_counters() == {} and driver.reconcile_qos() == 0
    driver.release_vrnic("q9")


def test_rate_meter() -> None:
    meter = RateMeter()
    assert meter.read("a", 1000, 10.0) == 0.0  # first reading
    assert meter.read("a", 3000, 12.0) == 8000.0  # 2000 bytes in 2 s
    assert meter.read("a", 100, 13.0) == 0.0  # the counter went back (a new class): no rate
    assert meter.read("b", 5, 13.0) == 0.0


def test_vrnicd_raises_a_connected_rc_qps_timeout_above_its_qos_queue_wait(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake NIC cannot shape; the drain rate a shaping device would report is given (12 Mbit/s), and the
    timeout RTS gave the physical QP is read back from the NIC through query_qp."""
    monkeypatch.setattr(driver, "_qos_drain_kbit", lambda device, vrnic_id: 12_000 if device == "fake0" else None)
    info_a, info_b = make_vrnic(), make_vrnic(device="fake1")
    with Context.attach(info_b, ARENA) as cb, Context.attach(info_a, ARENA) as ca:
        pd_a, cq_a, pd_b, cq_b = PD(ca), CQ(ca, 16), PD(cb), CQ(cb, 16)
        first, second, patient = QP(pd_a, cq_a, cq_a), QP(pd_a, cq_a, cq_a), QP(pd_a, cq_a, cq_a)
        peers = [QP(pd_b, cq_b, cq_b) for _ in range(3)]
        for mine, peer in zip((first, second), peers[:2], strict=True):
            mine.connect(cb.gid, peer.qpn)
            peer.connect(ca.gid, mine.qpn)
        patient.modify("init")
        patient.modify("rtr", remote_gid=cb.gid, remote_qpn=peers[2].qpn)
        patient.modify("rts", timeout=25)  # more than any floor here: kept
        assert first.query()["timeout"] == rc_timeout_floor(1024, 1, 12_000) == 16  # the guest asked 14
        assert second.query()["timeout"] == rc_timeout_floor(1024, 2, 12_000) == 17  # two QPs share the class
        assert patient.query()["timeout"] == 25
        assert peers[0].query()["timeout"] == 14  # fake1 shapes nothing: the guest's own


def test_a_batched_connect_raises_each_qps_timeout_as_connecting_them_one_by_one_would(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """connect_qps keeps the drain rate and the count of connected QPs through the batch instead of walking
    every vRNIC and QP at each RTS: QP i of the batch must still get the floor for i + 1 connected QPs (one
    was connected before it), and the drain rate is asked once per batch, not once per QP."""
    asked: list[str] = []

    def drain(device: str, vrnic_id: str) -> int | None:
        asked.append(vrnic_id)
        return 12_000 if device == "fake0" else None

    monkeypatch.setattr(driver, "_qos_drain_kbit", drain)
    info_a, info_b = make_vrnic(), make_vrnic(device="fake1")
    with Context.attach(info_b, ARENA) as cb, Context.attach(info_a, ARENA) as ca:
        pd_a, cq_a, pd_b, cq_b = PD(ca), CQ(ca, 64), PD(cb), CQ(cb, 64)
        lone, lone_peer = QP(pd_a, cq_a, cq_a), QP(pd_b, cq_b, cq_b)
        lone.modify("init")
        lone.modify("rtr", remote_gid=cb.gid, remote_qpn=lone_peer.qpn)
        lone.modify("rts", timeout=25)  # one that the batch's nine QPs in the queue do not outlast
        mine, peers = QP.create_many(pd_a, cq_a, cq_a, 8), QP.create_many(pd_b, cq_b, cq_b, 8)
        asked.clear()
        QP.connect_many(ca, [(m, cb.gid, p.qpn) for m, p in zip(mine, peers, strict=True)])
        assert len(asked) == 1
        floors = [rc_timeout_floor(1024, 2 + i, 12_000) for i in range(8)]
        assert [m.query()["timeout"] for m in mine] == floors
        assert floors[0] < floors[-1]  # the count moved the floor within the batch


def test_connecting_a_qp_whose_packets_would_outlast_a_connected_qps_timeout_is_refused(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each RC QP connected into a class adds its packets in flight to the queue every packet waits in, and a
    connected QP's timeout cannot change. So the connect that would make that wait outlast a connected QP's
    timeout is refused, with the numbers: the QP stays in RTR, the others keep going. Once the short-timed QP
    is gone, the same QP may join."""
    with _pair_with_qps(driver, make_vrnic, monkeypatch, 6) as (ca, cb, mine, peers):
        # the first QP gets 16 (268 ms: four times one QP's wait at 12 Mbit/s); five QPs' packets wait 243 ms, six's 291
        assert queue_wait_s(1024, 5, 12_000) < RC_TIMEOUT_UNIT_S * 2 ** 16 < queue_wait_s(1024, 6, 12_000)
        for m, p in zip(mine[:5], peers[:5], strict=True):
            m.connect(cb.gid, p.qpn)
        assert mine[0].query()["timeout"] == 16
        with pytest.raises(Conflict, match=rf"connecting RC QP {mine[5].qpn} would .* wait 291 ms .* \(QP "
                                           rf"{mine[0].qpn}: 16, 268 ms\), which RTS cannot raise") as refused:
            mine[5].connect(cb.gid, peers[5].qpn)
        assert refused.value.current_state == "rc_timeout_too_short"
        assert [m.query()["state"] for m in mine] == ["rts"] * 5 + ["rtr"]
        mine[0].close()  # its packets wait no more: five QPs (243 ms) are well within the next-shortest timeout (17)
        mine[5].modify("rts")
        assert mine[5].query()["state"] == "rts"


def test_a_batched_connect_refuses_the_join_that_would_outlast_a_timeout_as_one_by_one_connects_do(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """connect_qps checks each join against the senders it keeps through the batch (the QPs connected before it,
    then each of the batch's as it reaches RTS), not a walk over every QP per join: the batch's sixth sender is
    refused with the numbers a single connect gets, and the batch is undone."""
    with _pair_with_qps(driver, make_vrnic, monkeypatch, 6) as (ca, cb, mine, peers):
        for m, p in zip(mine[:3], peers[:3], strict=True):
            m.connect(cb.gid, p.qpn)  # the first gets 16: five senders' packets wait 243 ms, six's 291 (268 ms)
        assert mine[0].query()["timeout"] == 16
        batch = list(zip(mine[3:], peers[3:], strict=True))
        with pytest.raises(Conflict, match=rf"connecting RC QP {mine[5].qpn} would .* wait 291 ms .* \(QP "
                                           rf"{mine[0].qpn}: 16, 268 ms\), which RTS cannot raise"):
            QP.connect_many(ca, [(m, cb.gid, p.qpn) for m, p in batch])
        assert [m.query()["state"] for m in mine] == ["rts"] * 3 + ["reset"] * 3  # all of the batch, or none
        QP.connect_many(ca, [(m, cb.gid, p.qpn) for m, p in batch[:2]])  # five senders: within 268 ms
        mine[0].close()  # the shortest timeout goes; the next-shortest (17) holds six senders
        QP.connect_many(ca, [(mine[5], cb.gid, peers[5].qpn)])
        assert mine[5].query()["state"] == "rts"


def test_a_connect_the_bounds_clear_walks_no_qp_and_one_they_do_not_clear_walks_as_before(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """A single connect's timeout floor and join check walk every QP of the session; they are skipped when a
    bound already answers: the floor for all of the session's QPs is under the asked timeout, and the least
    timeout ever given outlasts a queue of all of them at the largest MTU. On a fast class (10 Gbit/s) every
    connect is cleared that way and keeps the guest's timeout. A guest asking for a timeout of 1 (8 us) gets
    the floor, counted with the walk; once a QP holds that short a timeout, the next connect's bound fails and
    the join check walks, as before. (The refusals that walk finds are the tests above and below.)"""
    from vrnic.backend.session import GuestSession

    walks: list[str] = []
    for name in ("_rc_connected", "rc_timeouts_outlasted"):
        original = getattr(GuestSession, name)

        def counted(self: GuestSession, *args: object, _name: str = name, _original: Any = original,
                    **kwargs: object) -> object:
            walks.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(GuestSession, name, counted)
    with _pair_with_qps(driver, make_vrnic, monkeypatch, 5, kbit=10_000_000) as (ca, cb, mine, peers):
        for m, p in zip(mine[:3], peers[:3], strict=True):
            m.connect(cb.gid, p.qpn)
        assert walks == [] and [m.query()["timeout"] for m in mine[:3]] == [14] * 3
        mine[3].modify("init")
        mine[3].modify("rtr", remote_gid=cb.gid, remote_qpn=peers[3].qpn)
        mine[3].modify("rts", timeout=1)  # 8 us: raised to the floor for four connected QPs, 1 ms
        assert mine[3].query()["timeout"] == rc_timeout_floor(1024, 4, 10_000_000) == 8
        assert "_rc_connected" in walks  # the bound could not clear that floor: counted
        walks.clear()
        mine[4].connect(cb.gid, peers[4].qpn)  # five senders at the largest MTU would wait 1.09 ms: the walk
        assert "rc_timeouts_outlasted" in walks  # runs, and finds five at 1024 bytes within 1.05 ms
        assert mine[4].query()["state"] == "rts"


def test_the_drain_rate_is_planned_once_while_the_devices_policies_and_link_stay_the_same(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RTS of an RC QP on a device that can shape asks its class's drain rate, and planning every class
    of the device was most of a connect's Python under TCG. The plan is kept, and made again when a vRNIC comes
    or goes, a policy changes or the link's speed does."""
    import vrnic.backend.drivers.paravirtual as paravirtual

    planned: list[dict[str, QosPolicy]] = []
    plan = paravirtual.drain_rates

    def counted(link_mbps: int, policies: dict[str, QosPolicy]) -> dict[str, int]:
        planned.append(dict(policies))
        return plan(link_mbps, policies)

    monkeypatch.setattr(paravirtual, "drain_rates", counted)
    monkeypatch.setattr(driver, "_can_shape", {"fake0": True})
    link = {"fake0": 100}
    monkeypatch.setattr(driver, "_unshaped_link_mbps", lambda device: link[device])
    a, b = make_vrnic().vrnic_id, make_vrnic().vrnic_id
    assert [driver._qos_drain_kbit("fake0", i) for i in (a, b, a, b)] == [50_000] * 4
    assert len(planned) == 1
    c = make_vrnic().vrnic_id
    assert driver._qos_drain_kbit("fake0", a) == 33_333 and len(planned) == 2
    # a new policy object with the same settings plans nothing new; other settings do
    vrnic = driver.registry.get(c)
    vrnic.spec = vrnic.spec.model_copy(update={"qos": QosPolicy()})
    assert driver._qos_drain_kbit("fake0", c) == 33_333 and len(planned) == 2
    vrnic.spec = vrnic.spec.model_copy(update={"qos": QosPolicy(weight=2)})
    assert driver._qos_drain_kbit("fake0", c) == 50_000 and driver._qos_drain_kbit("fake0", a) == 25_000
    assert len(planned) == 3
    link["fake0"] = 40
    assert driver._qos_drain_kbit("fake0", a) == 10_000 and len(planned) == 4
    driver.release_vrnic(c)
    assert driver._qos_drain_kbit("fake0", a) == 20_000 and len(planned) == 5
    assert planned[-1].keys() == {a, b}


def test_the_drain_rate_walks_the_devices_vrnics_only_after_a_spec_or_the_membership_changed(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept plan is checked against vrnic.backend.registry.ChangeMark, which every spec assignment and every
    registry add or remove moves: while it stays put, an RTS's question walks nothing."""
    from vrnic.backend.registry import ChangeMark

    monkeypatch.setattr(driver, "_can_shape", {"fake0": True})
    monkeypatch.setattr(driver, "_unshaped_link_mbps", lambda device: 100)
    walks: list[str] = []
    all_on = driver.registry.all_on
    monkeypatch.setattr(driver.registry, "all_on", lambda device: walks.append(device) or all_on(device))

    def asked(vrnic_id: str) -> tuple[int | None, int]:
        """The drain rate and how many walks asking it took."""
        before = len(walks)
        return driver._qos_drain_kbit("fake0", vrnic_id), len(walks) - before

    a = make_vrnic().vrnic_id
    assert asked(a) == (100_000, 1)
    assert [asked(a) for _ in range(3)] == [(100_000, 0)] * 3
    b = make_vrnic().vrnic_id  # a new vRNIC moves the mark
    assert asked(b) == (50_000, 1)
    assert asked(a) == (50_000, 0)
    vrnic = driver.registry.get(a)
    mark = ChangeMark.current
    vrnic.spec = vrnic.spec.model_copy(update={"qos": QosPolicy(weight=3)})  # so does any spec assignment
    assert ChangeMark.current != mark
    assert asked(a) == (75_000, 1) and asked(b) == (25_000, 0)
    vrnic.spec = vrnic.spec.model_copy(update={"qos": QosPolicy()})
    driver.release_vrnic(b)  # and a release
    assert asked(a) == (100_000, 1)


def test_connects_check_the_timeouts_vrnicd_set_without_asking_the_nic_for_each_connected_qp(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """The join check weighs every connected RC QP's timeout on every connect: asked of the NIC each time, N
    connects cost N^2/2 query_qp calls (0.1 ms each under TCG). vrnicd set each of those timeouts at RTS, so it
    reads its own record; the NIC is asked only for a QP whose physical QP is no longer the one vrnicd timed,
    and the refusal still comes with the NIC's numbers."""
    from vrnic.backend.fake_edge import FakeContext

    asked: list[object] = []
    query = FakeContext.query_rc_timeout

    def counted(self: FakeContext, qp: object) -> int:
        asked.append(qp)
        return query(self, qp)  # type: ignore[arg-type]

    monkeypatch.setattr(FakeContext, "query_rc_timeout", counted)
    with _pair_with_qps(driver, make_vrnic, monkeypatch, 6) as (ca, cb, mine, peers):
        for m, p in zip(mine[:5], peers[:5], strict=True):
            m.connect(cb.gid, p.qpn)
        assert asked == []  # four connects weighed 1 + 2 + 3 + 4 connected QPs from vrnicd's own record
        session = driver.registry.get(ca.vrnic_id).session
        first = next(q for _, q in session.state.qps.items() if q.vqpn == mine[0].qpn)
        assert first.rts_timeout == (first.obj, 16)
        # a record of another physical QP (as after a migration's shadow took over) is not trusted: the NIC is asked
        first.rts_timeout = (object(), 30)
        with pytest.raises(Conflict, match=rf"\(QP {mine[0].qpn}: 16, 268 ms\)"):
            mine[5].connect(cb.gid, peers[5].qpn)
        assert asked == [first.obj]


def test_an_unshaped_devices_link_speed_is_read_once_not_on_every_connect(
        driver: VerbsDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RC timeout floor needs the uplink's speed at every RTS; sysfs is read once per device (as a shaper
    reads it once), with the operator's figure when sysfs has none, and None without an uplink."""
    import vrnic.backend.drivers.paravirtual as paravirtual

    reads: list[str] = []

    def uplink(device: str) -> str:
        reads.append(device)
        if device == "gone0":
            raise NotSupported("no uplink")
        return f"net-{device}"

    monkeypatch.setattr(paravirtual, "uplink_netdev", uplink)
    monkeypatch.setattr(paravirtual, "link_speed_mbps", lambda netdev: 25_000 if netdev == "net-fast0" else None)
    monkeypatch.setattr(driver, "qos_link_mbps", 100)
    for _ in range(3):
        assert driver._unshaped_link_mbps("fast0") == 25_000
        assert driver._unshaped_link_mbps("veth0") == 100  # no speed in sysfs: the operator's figure
        assert driver._unshaped_link_mbps("gone0") is None
    assert sorted(reads) == ["fast0", "gone0", "veth0"]


def test_a_policy_whose_queue_would_outlast_a_connected_rc_qps_timeout_is_refused(
        driver: VerbsDriver, make_vrnic: Callable[..., AttachInfo]) -> None:
    """rxe breaks an RC QP that times out while its packets wait in the QoS queue (vrnic.core.qos), and a
    connected QP's timeout cannot change. So a policy that would drain its class slower than that timeout covers
    is refused, with the numbers; one the timeout covers passes. The in-memory NIC cannot shape, so the rule is
    asked directly with the policies a change would leave on the device (the lab shows it through set_qos)."""
    info_a, info_b = make_vrnic(), make_vrnic(device="fake1")
    with Context.attach(info_b, ARENA) as cb, Context.attach(info_a, ARENA) as ca:
        pd_a, cq_a, pd_b, cq_b = PD(ca), CQ(ca, 16), PD(cb), CQ(cb, 16)
        mine, peer = QP(pd_a, cq_a, cq_a), QP(pd_b, cq_b, cq_b)
        mine.connect(cb.gid, peer.qpn)  # the guest's timeout, 14: 67 ms
        peer.connect(ca.gid, mine.qpn)
        on_device, vrnic_id = driver.registry.all_on("fake0"), info_a.vrnic_id
        # 8 Mbit/s: the 65 packets rxe keeps in flight wait 73 ms in the queue
        assert queue_wait_s(1024, 1, 8_000) > RC_TIMEOUT_UNIT_S * 2 ** 14 > queue_wait_s(1024, 1, 9_000)
        with pytest.raises(Conflict, match=rf"QP {mine.qpn}: 14, 67 ms\); rxe would break them") as refused:
            driver._refuse_outlasted_rc_timeouts(400, on_device, {vrnic_id: QosPolicy(rate_cap_mbps=8)})
        assert "drain at 8000 kbit/s" in str(refused.value) and "wait 73 ms" in str(refused.value)
        driver._refuse_outlasted_rc_timeouts(400, on_device, {vrnic_id: QosPolicy(rate_cap_mbps=9)})
        # another vRNIC's guarantee that leaves this class 8 Mbit/s of the link is refused just the same
        with pytest.raises(Conflict, match="rxe would break them"):
            driver._refuse_outlasted_rc_timeouts(400, on_device, {vrnic_id: QosPolicy(), "other": QosPolicy(
                guarantee_mbps=392)})
        mine.close()  # a QP that is not connected has nothing in flight to wait
        driver._refuse_outlasted_rc_timeouts(400, on_device, {vrnic_id: QosPolicy(rate_cap_mbps=1)})
        peer.close()
    assert rc_timeout_outlasts(0, 3600.0) and rc_timeout_outlasts(14, 0.067) and not rc_timeout_outlasts(14, 0.068)
