"""The registry: the only place sessions meet, under one lock and one isolation rule."""

from __future__ import annotations

import threading

import pytest

from vrnic.backend.registry import Registry, VirtualRnic
from vrnic.core.recovery import token_digest
from vrnic.core.rings import Access
from vrnic.core.specs import VrnicSpec
from vrnic.core.translate import MrWindow
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict, NotFound


class Session:
    def close(self) -> None:
        pass


def vrnic(serial: int, tenant: str = "t", vpc: int = 1, phys_gid: str = "::ffff:10.0.0.1") -> VirtualRnic:
    spec = VrnicSpec(id=f"v{serial}", tenant=tenant, vpc_id=vpc, virtual_gid=make_virtual_gid(vpc, serial))
    return VirtualRnic(spec=spec, device="d", token_hash=token_digest(f"tok{serial}"), phys_gid=phys_gid, gid_index=1)


def attached(registry: Registry, *vrnics: VirtualRnic) -> None:
    for v in vrnics:
        registry.add(v)
        registry.attach(v, Session())


def test_without_rules_only_the_same_tenant_and_vpc_is_reachable() -> None:
    registry = Registry()
    a = vrnic(1).identity
    assert registry.check(a, vrnic(2).identity, "connect").allowed
    assert not registry.check(a, vrnic(3, tenant="other").identity, "connect").allowed
    assert not registry.check(a, vrnic(4, vpc=2).identity, "connect").allowed


def test_a_peer_is_found_only_when_attached_and_reachable() -> None:
    registry = Registry()
    a, b, c, d = vrnic(1), vrnic(2), vrnic(3, tenant="other"), vrnic(4, vpc=2)
    attached(registry, a, c, d)
    registry.add(b)  # allocated, no guest yet
    for target in (b, c, d):
        with pytest.raises(NotFound, match="no reachable vRNIC"):
            registry.peer(a, target.spec.virtual_gid)
    registry.attach(b, Session())
    assert registry.peer(a, b.spec.virtual_gid) is b


def test_one_guest_per_vrnic_and_detach_withdraws_everything() -> None:
    registry = Registry()
    a, b = vrnic(1), vrnic(2)
    attached(registry, a, b)
    with pytest.raises(Conflict):
        registry.attach(b, Session())
    registry.publish_qp(b, 77, 1234)
    window = MrWindow(vkey=9, offset=0, length=64, access=Access.REMOTE_WRITE, phys_lkey=1, phys_rkey=2, base=0)
    registry.publish_mr(b, window)
    assert registry.peer_qp(a, b.spec.virtual_gid, 77) == (b, 1234)
    assert registry.peer_mrs(b.spec.id).get(9) == window
    assert registry.virtual_qpn(a, 1234, b.phys_gid) == 77
    registry.detach(b, b.session)  # type: ignore[arg-type]
    assert registry.attached_ids() == {a.spec.id}
    assert registry.peer_mrs(b.spec.id).get(9) is None
    assert registry.virtual_qpn(a, 1234, b.phys_gid) == 0


def test_udp_source_lookup_is_narrowed_by_gid_and_isolated() -> None:
    registry = Registry()
    a = vrnic(1)
    b = vrnic(2, phys_gid="::ffff:10.0.0.2")
    c = vrnic(3, phys_gid="::ffff:10.0.0.3")
    m = vrnic(4, tenant="mallory", phys_gid="::ffff:10.0.0.4")
    attached(registry, a, b, c, m)
    registry.publish_qp(b, 20, 500)
    registry.publish_qp(c, 30, 500)  # same physical QPN on another device
    registry.publish_qp(m, 40, 600)
    assert registry.virtual_qpn(a, 500, b.phys_gid) == 20
    assert registry.virtual_qpn(a, 500, c.phys_gid) == 30
    assert registry.virtual_qpn(a, 500, None) == 0  # ambiguous without a GID
    assert registry.virtual_qpn(a, 600, m.phys_gid) == 0  # another tenant's QPN is never revealed
    assert registry.virtual_qpn(m, 600, m.phys_gid) == 40


def test_lookups_race_with_destroys_without_errors() -> None:
    """Before the registry owned this index, a QP destroyed mid-lookup raised KeyError in a guest's engine."""
    registry = Registry()
    a, b = vrnic(1), vrnic(2, phys_gid="::ffff:10.0.0.2")
    attached(registry, a, b)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        while not stop.is_set():
            for qpn in range(50):
                registry.publish_qp(b, qpn + 2, 1000 + qpn)
            for qpn in range(50):
                registry.withdraw_qp(b, qpn + 2)

    def look() -> None:
        try:
            for _ in range(20000):
                assert registry.virtual_qpn(a, 1000 + _ % 50, None) in (0, _ % 50 + 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    writer = threading.Thread(target=churn)
    readers = [threading.Thread(target=look) for _ in range(2)]
    writer.start()
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    stop.set()
    writer.join()
    assert errors == []


class KeyCachingSession(Session):
    """A direct-engine session: it caches peers' keys, so it hears of every MR a reachable peer withdraws."""

    def __init__(self) -> None:
        self.told = 0

    def translations_changed(self) -> None:
        self.told += 1


class CountingLocator:
    """The security-group store, counting how often the rules are read."""

    def __init__(self) -> None:
        self.reads = 0

    def rules(self) -> list[object]:
        self.reads += 1
        return []


def test_a_withdrawn_mr_is_told_only_to_reachable_key_caching_sessions() -> None:
    locator = CountingLocator()
    registry = Registry(locator=locator)  # type: ignore[arg-type]
    a, same, other_vpc, gone = vrnic(1), vrnic(2), vrnic(3, vpc=2), vrnic(4)
    ring_guests = [vrnic(10 + i, vpc=1 + i % 2) for i in range(50)]
    attached(registry, a, *ring_guests)
    cachers = {v.spec.id: KeyCachingSession() for v in (same, other_vpc, gone)}
    for v in (same, other_vpc, gone):
        registry.add(v)
        registry.attach(v, cachers[v.spec.id])
    registry.remove(gone.spec.id)  # released while attached: no longer told
    window = MrWindow(vkey=9, offset=0, length=64, access=Access.REMOTE_WRITE, phys_lkey=1, phys_rkey=2, base=0)
    registry.publish_mr(a, window)
    registry.withdraw_mr(a, 9)
    assert {i: s.told for i, s in cachers.items()} == {same.spec.id: 1, other_vpc.spec.id: 0, gone.spec.id: 0}
    registry.detach(same, cachers[same.spec.id])
    registry.detach(other_vpc, cachers[other_vpc.spec.id])
    reads = locator.reads
    registry.withdraw_mr(a, 9)  # ring guests cache no keys: the rules are not even read for them
    assert locator.reads == reads and cachers[same.spec.id].told == 1


def test_virtual_gids_stay_unique_and_are_found_after_releases() -> None:
    registry = Registry()
    a, b = vrnic(1), vrnic(2)
    attached(registry, a, b)
    with pytest.raises(Conflict, match="already in use"):
        registry.add(VirtualRnic(spec=b.spec.model_copy(update={"id": "b2"}), device="d", token_hash="x",
                                 phys_gid=b.phys_gid, gid_index=1))
    assert registry.holds(b.spec.virtual_gid) and registry.peer(a, b.spec.virtual_gid) is b
    registry.remove(b.spec.id)
    assert not registry.holds(b.spec.virtual_gid)
    with pytest.raises(NotFound):
        registry.peer(a, b.spec.virtual_gid)
    again = vrnic(2)  # the address is free again
    registry.add(again)
    registry.attach(again, Session())
    assert registry.peer(a, again.spec.virtual_gid) is again


def test_an_attach_token_finds_its_vrnic_by_digest_through_reissues_and_releases() -> None:
    registry = Registry()
    vrnics = [vrnic(n) for n in range(1, 501)]
    for v in vrnics:
        registry.add(v)
    assert registry.by_token("tok123") is vrnics[122]
    assert registry.by_token("tok500") is vrnics[499]
    with pytest.raises(NotFound, match="invalid attach token"):
        registry.by_token("tok501")
    new = registry.reissue_token("v7")
    assert registry.by_token(new) is vrnics[6]
    with pytest.raises(NotFound):
        registry.by_token("tok7")  # the old token stops working
    registry.remove("v123")
    with pytest.raises(NotFound):
        registry.by_token("tok123")
    # two vRNICs holding one digest (a restore given the same hash twice): each is found until it goes
    twin = VirtualRnic(spec=VrnicSpec(id="twin", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 900)),
                       device="d", token_hash=token_digest("tok42"), phys_gid="::ffff:10.0.0.1", gid_index=1)
    registry.add(twin)
    assert registry.by_token("tok42") is vrnics[41]
    registry.remove("v42")
    assert registry.by_token("tok42") is twin
    registry.remove("twin")
    with pytest.raises(NotFound):
        registry.by_token("tok42")
    assert registry.by_token("tok41") is vrnics[40]
