"""Peering on the host: reachability rules (decide, audited), peers of another vrnicd, and rdma_cm-style connects.

Two real verbs drivers, each with its own registry, share the in-memory RNIC fabric (fake0 and fake1) as
two hosts share a network. Here they are linked by a directory that calls the other driver's PeerService
in-process; tests/api/test_agent_peers.py links them over real HTTP (AgentDirectory and agent_peers).
Guests are the real frontend over the real channel.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.peering_fakes import MemoryLocator
from tests.peering_rig import ALL, PeerGuest
from vrnic.backend import registry as registry_module
from vrnic.backend.cm import ConnectionManager
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.peer_directory import AgentRef, RemotePeer
from vrnic.backend.peer_service import PeerService
from vrnic.backend.registry import MR_REFETCH_S, Registry, VirtualRnic
from vrnic.backend.session import GuestSession
from vrnic.core.peering import Identity
from vrnic.core.specs import AttachInfo, VrnicSpec
from vrnic.core.translate import MrWindow
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict, InvalidArgument, NotFound, Unavailable
from vrnic.frontend import MR, Context, RecvRequest, SendRequest, WcStatus, WrOpcode, cm

ARENA = 1 << 20
_serial = itertools.count(5000)


@dataclass
class LoopbackDirectory:
    """A PeerDirectory that asks the owner's PeerService directly (what AgentDirectory does over HTTP)."""

    locator: MemoryLocator
    services: dict[str, PeerService] = field(default_factory=dict)  # host -> its driver's service
    down: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    on_call: Callable[[str], None] = lambda what: None

    def _service(self, agent: AgentRef | None, what: str, gid: str = "") -> PeerService:
        self.calls.append(what)
        self.on_call(what)
        if agent is None:  # as AgentDirectory says it
            raise NotFound(f"no reachable vRNIC with virtual GID {gid}")
        if agent.host in self.down:
            raise Unavailable(f"agent {agent.host} is down")
        return self.services[agent.host]

    def peer_qp(self, asker: Identity, virtual_gid: str, vqpn: int) -> tuple[RemotePeer, int]:
        agent = self.locator.agent_of(virtual_gid)
        target, phys_gid, qpn = self._service(agent, "qp", virtual_gid).qp(asker, virtual_gid, vqpn)
        assert agent is not None
        return RemotePeer(target, phys_gid, agent), qpn

    def peer_mrs(self, asker: Identity, peer: RemotePeer) -> list[MrWindow]:
        return self._service(peer.agent, "mrs").mrs(asker, peer.identity.virtual_gid)

    def virtual_qpn(self, asker: Identity, phys_gid: str, phys_qpn: int) -> int:
        return self._service(self.locator.agent_of_phys_gid(phys_gid), "reverse").reverse(asker, phys_gid, phys_qpn)

    def cm_connect(self, asker: Identity, virtual_gid: str, port: int, vqpn: int, private_data: bytes,
                   timeout: float) -> tuple[int, bytes]:
        service = self._service(self.locator.agent_of(virtual_gid), "cm", virtual_gid)
        return service.cm_connect(asker, virtual_gid, port, vqpn, private_data, timeout)


class Hosts:
    """Two vrnicds (hosts a and b) on one fake fabric, sharing one locator."""

    def __init__(self, edge: FakeEdge, tmp: Path) -> None:
        self.edge = edge
        self.locator = MemoryLocator()
        self.directory = LoopbackDirectory(self.locator)
        self.drivers: dict[str, VerbsDriver] = {}
        for host, device in (("a", "fake0"), ("b", "fake1")):
            self.drivers[host] = VerbsDriver(socket_path=tmp / f"{host}.sock", edge=edge, devices=[device],
                                             locator=self.locator, directory=self.directory)
            self.directory.services[host] = self.drivers[host].peers

    def make(self, host: str, tenant: str = "t1", vpc: int = 1, ip: str | None = None) -> AttachInfo:
        serial = next(_serial)
        spec = VrnicSpec(id=f"p{serial}", tenant=tenant, vpc_id=vpc, virtual_gid=make_virtual_gid(vpc, serial),
                         virtual_ip=ip)
        device = "fake0" if host == "a" else "fake1"
        info = self.drivers[host].create_vrnic(spec, device)
        self.locator.place(AgentRef(host, f"http://{host}.invalid"), spec.virtual_gid, self.edge.gids[device], vpc,
                           ip)
        return info

    def close(self) -> None:
        for driver in self.drivers.values():
            driver.close()


@pytest.fixture
def hosts(edge: FakeEdge, tmp_path: Path) -> Iterator[Hosts]:
    pair = Hosts(edge, tmp_path)
    yield pair
    pair.close()
    assert not edge.live, "objects left on the fake NIC"


Guest = PeerGuest


def send_and_write(a: Guest, b: Guest) -> None:
    """A SENDs to B, then RDMA-WRITEs into B's MR: both arrive byte for byte."""
    b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 64),)))
    a.mr.write(b"across the hosts")
    a.qp.post_send(SendRequest(2, WrOpcode.SEND, (a.mr.sge(0, 16),)))
    assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
    (recv,) = b.cq.wait(1)
    assert (recv.status, recv.byte_len) == (WcStatus.SUCCESS, 16)
    assert b.mr.read(16) == b"across the hosts"
    a.mr.write(b"written remotely", 100)
    a.qp.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(100, 16),), remote_addr=b.mr.addr + 2000,
                               rkey=b.mr.rkey))
    assert [(c.wr_id, c.status) for c in a.cq.wait(1)] == [(3, WcStatus.SUCCESS)]
    assert b.mr.read(16, 2000) == b"written remotely"


# ----- the rule: decide() with the locator's rules, audited ------------------------------------------------

def ident(n: int, tenant: str, vpc: int) -> Identity:
    return Identity(f"v{n}", tenant, vpc, make_virtual_gid(vpc, n))


def test_cross_vpc_needs_an_allow_on_both_sides_and_every_decision_across_vpcs_is_audited() -> None:
    locator = MemoryLocator()
    registry = Registry(locator=locator)
    alice, bob, alice2 = ident(1, "alice", 1), ident(2, "bob", 2), ident(3, "alice", 1)
    assert registry.check(alice, alice2, "connect").allowed
    assert locator.rule_reads == 0 and locator.events == []  # the same VPC never reads rules nor audits
    assert not registry.check(alice, bob, "connect").allowed
    locator.allow("bob", "alice")  # bob's VPC lets alice in; alice's VPC still says nothing
    time.sleep(1.05)  # past the rule cache
    assert not registry.check(alice, bob, "connect").allowed
    locator.allow("alice", "bob")
    time.sleep(1.05)
    decision = registry.check(alice, bob, "connect")
    assert decision.allowed and decision.cross_vpc
    # the second refusal repeats the first within AUDIT_QUIET_S: not news
    assert locator.actions() == [("peer.refused", "v1", "v2"), ("peer.allowed", "v1", "v2")]
    assert locator.events[0].detail["reason"].startswith("VPC of tenant bob")


def test_rules_are_read_at_most_once_a_second() -> None:
    locator = MemoryLocator()
    registry = Registry(locator=locator)
    for _ in range(50):
        registry.check(ident(1, "alice", 1), ident(2, "bob", 2), "ud")
    assert locator.rule_reads == 1


# ----- a peer held by another vrnicd -----------------------------------------------------------------------

def test_guests_of_two_vrnicds_connect_by_gid_and_move_bytes(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a"), ARENA) as ca, Context.attach(hosts.make("b"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        a.qp.connect(cb.gid, b.qp.qpn)
        b.qp.connect(ca.gid, a.qp.qpn)
        send_and_write(a, b)
        # B's MR was looked up once, when A's first WRITE named its key; cached since
        assert hosts.directory.calls.count("mrs") == 1
        assert isinstance(hosts.drivers["a"].registry.peer_qp(
            hosts.drivers["a"].registry.get(ca.vrnic_id), cb.gid, b.qp.qpn)[0], RemotePeer)


def test_a_key_registered_after_connecting_is_fetched_again_but_a_bad_one_not_every_time(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a"), ARENA) as ca, Context.attach(hosts.make("b"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        a.qp.connect(cb.gid, b.qp.qpn)
        b.qp.connect(ca.gid, a.qp.qpn)
        a.qp.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        late = MR(b.pd, 4096, ALL)  # registered after A cached B's windows
        time.sleep(MR_REFETCH_S)
        a.qp.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=late.addr, rkey=late.rkey))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        fetched = hosts.directory.calls.count("mrs")
        for i in range(20):  # a key B never had: refused each time, asked of B at most once per interval
            a.qp.post_send(SendRequest(10 + i, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=b.mr.addr,
                                       rkey=0xBAD))
        assert {c.status for c in a.cq.wait(20)} == {WcStatus.REM_ACCESS_ERR}
        assert hosts.directory.calls.count("mrs") - fetched <= 2


def test_a_remote_peer_is_looked_up_without_the_session_lock(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a"), ARENA) as ca, Context.attach(hosts.make("b"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        session = hosts.drivers["a"].registry.get(ca.vrnic_id).session
        assert isinstance(session, GuestSession)
        free: list[bool] = []

        def take() -> None:
            got = session.lock.acquire(timeout=2)
            free.append(got)
            if got:
                session.lock.release()

        def probe(what: str) -> None:  # while the other agent is asked, another thread (the engine) gets the lock
            if what == "qp":
                taker = threading.Thread(target=take)
                taker.start()
                taker.join()

        hosts.directory.on_call = probe
        a.qp.connect(cb.gid, b.qp.qpn)
        assert free == [True]


def test_a_deregistered_remote_mr_stops_translating_within_the_ttl(hosts: Hosts, edge: FakeEdge,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "MR_TTL_S", 0.3)
    with Context.attach(hosts.make("a"), ARENA) as ca, Context.attach(hosts.make("b"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        a.qp.connect(cb.gid, b.qp.qpn)
        b.qp.connect(ca.gid, a.qp.qpn)
        gone = MR(b.pd, 4096, ALL)
        a.qp.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=gone.addr, rkey=gone.rkey))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        gone.close()
        time.sleep(0.4)
        a.qp.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=gone.addr, rkey=gone.rkey))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.REM_ACCESS_ERR]
        assert 2 not in [wr.wr_id for _, wr in edge.posted]  # refused by vrnicd, not by the NIC


def test_another_tenant_on_another_host_is_refused_audited_and_allowed_by_peering_rules(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a", tenant="alice", vpc=11), ARENA) as ca, \
            Context.attach(hosts.make("b", tenant="bob", vpc=12), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        with pytest.raises(NotFound, match="no reachable vRNIC") as refused:
            a.qp.connect(cb.gid, b.qp.qpn)
        with pytest.raises(NotFound) as missing:  # the same answer as for a GID that does not exist
            a.qp.connect(make_virtual_gid(12, 99_999), 1)
        assert str(refused.value).replace(cb.gid, "G") == str(missing.value).replace(make_virtual_gid(12, 99_999), "G")
        assert ("peer.refused", ca.vrnic_id, cb.vrnic_id) in hosts.locator.actions()  # by b's agent, the owner
        hosts.locator.allow("alice", "bob")
        hosts.locator.allow("bob", "alice")
        time.sleep(1.05)
        a.qp.connect(cb.gid, b.qp.qpn)
        b.qp.connect(ca.gid, a.qp.qpn)
        send_and_write(a, b)
        assert ("peer.allowed", ca.vrnic_id, cb.vrnic_id) in hosts.locator.actions()


def test_an_unreachable_agent_is_unavailable_in_the_vpc_and_not_found_outside_it(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a"), ARENA) as ca, Context.attach(hosts.make("b"), ARENA) as cb, \
            Context.attach(hosts.make("a", tenant="eve", vpc=13), ARENA) as ce:
        a, b, e = Guest(ca), Guest(cb), Guest(ce)
        hosts.directory.down.add("b")
        with pytest.raises(Unavailable, match="down"):
            a.qp.connect(cb.gid, b.qp.qpn)
        with pytest.raises(NotFound, match="no reachable vRNIC"):
            e.qp.connect(cb.gid, b.qp.qpn)


def test_ud_across_vrnicds_resolves_destinations_and_names_the_source_virtually(hosts: Hosts) -> None:
    import ipaddress

    with Context.attach(hosts.make("a"), ARENA) as ca, Context.attach(hosts.make("b"), ARENA) as cb:
        a, b = Guest(ca, qp_type="ud"), Guest(cb, qp_type="ud")
        for g in (a, b):
            for state in ("init", "rtr", "rts"):
                g.qp.modify(state)
        b.qp.post_recv([RecvRequest(i, (b.mr.sge(0, 256),)) for i in range(3)], sync=True)
        for i in range(3):
            a.qp.post_send(SendRequest(i, WrOpcode.SEND, (a.mr.sge(0, 8),),
                                       ud_gid=ipaddress.IPv6Address(cb.gid).packed, ud_qpn=b.qp.qpn,
                                       ud_qkey=0x11111111))
        assert [c.status for c in a.cq.wait(3)] == [WcStatus.SUCCESS] * 3
        received = b.cq.wait(3)
        assert [(c.status, c.src_qp) for c in received] == [(WcStatus.SUCCESS, a.qp.qpn)] * 3
        # one lookup each way, cached for the next work requests
        assert hosts.directory.calls.count("qp") == 1
        assert hosts.directory.calls.count("reverse") == 1


# ----- virtual IPs and rdma_cm-style connects ----------------------------------------------------------------

def test_resolve_finds_virtual_ips_of_the_own_vpc_only(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a", ip="10.0.0.1"), ARENA) as ca:
        b = hosts.make("b", ip="10.0.0.2")
        other = hosts.make("b", tenant="eve", vpc=14, ip="10.0.0.3")
        assert ca.ip == "10.0.0.1"
        assert cm.resolve(ca, "10.0.0.1") == ca.gid  # its own, from the local registry
        assert cm.resolve(ca, "10.0.0.2") == b.virtual_gid  # another host's, from the locator
        with pytest.raises(NotFound, match="no vRNIC with virtual IP 10.0.0.3"):
            cm.resolve(ca, "10.0.0.3")
        assert other.virtual_gid != ca.gid
        with pytest.raises(InvalidArgument):
            cm.resolve(ca, "not-an-ip")


@pytest.mark.parametrize("where", ["same host", "other host"])
def test_connect_by_virtual_ip_exchanges_private_data_and_moves_bytes(hosts: Hosts, where: str) -> None:
    with Context.attach(hosts.make("a", ip="10.0.0.1"), ARENA) as ca, \
            Context.attach(hosts.make("a" if where == "same host" else "b", ip="10.0.0.2"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        served: dict[str, object] = {}

        def listen() -> None:
            with cm.Listener(cb, 7471) as listener:
                ready.set()
                request = listener.get_request(timeout=10)
                assert request is not None
                served["request"] = request
                b.qp.modify("init")  # receives go on a QP in INIT or later (rdma_cm's QPs start in INIT)
                b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 64),)))
                served["connected"] = listener.accept(request, b.qp, b"welcome, " + request.private_data)

        ready = threading.Event()
        thread = threading.Thread(target=listen)
        thread.start()
        assert ready.wait(5)
        done = cm.connect(ca, a.qp, "10.0.0.2", 7471, b"alice here", timeout=10)
        thread.join(10)
        assert done.private_data == b"welcome, alice here"
        assert (done.remote_gid, done.remote_qpn) == (cb.gid, b.qp.qpn)
        request = served["request"]
        assert isinstance(request, cm.ConnectRequest)
        assert (request.remote_gid, request.private_data) == (ca.gid, b"alice here")
        assert served["connected"] == cm.Connected(ca.gid, a.qp.qpn, b"alice here")
        assert a.qp.query()["state"] == b.qp.query()["state"] == "rts"
        a.mr.write(b"by virtual IP")
        a.qp.post_send(SendRequest(2, WrOpcode.SEND, (a.mr.sge(0, 13),)))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        assert b.cq.wait(1)[0].byte_len == 13 and b.mr.read(13) == b"by virtual IP"
        a.mr.write(b"and a WRITE", 200)
        a.qp.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(200, 11),), remote_addr=b.mr.addr + 512,
                                   rkey=b.mr.rkey))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        assert b.mr.read(11, 512) == b"and a WRITE"
        if where == "other host":
            assert hosts.directory.calls.count("cm") == 1


def test_connect_is_refused_without_a_listener_rejected_by_one_and_times_out_on_a_silent_one(hosts: Hosts) -> None:
    with Context.attach(hosts.make("a", ip="10.0.0.1"), ARENA) as ca, \
            Context.attach(hosts.make("b", ip="10.0.0.2"), ARENA) as cb:
        a = Guest(ca)
        with pytest.raises(Conflict, match="nothing listens") as nobody:
            cm.connect(ca, a.qp, "10.0.0.2", 9, timeout=2)
        assert nobody.value.current_state == "rejected"
        listener = cm.Listener(cb, 9)
        with pytest.raises(Conflict, match="already has a listener"):
            cm.Listener(cb, 9)

        def reject() -> None:
            request = listener.get_request(timeout=10)
            assert request is not None
            listener.reject(request)

        thread = threading.Thread(target=reject)
        thread.start()
        with pytest.raises(Conflict, match="rejected") as rejected:
            cm.connect(ca, a.qp, "10.0.0.2", 9, b"x", timeout=10)
        thread.join(10)
        assert rejected.value.current_state == "rejected"
        started = time.monotonic()
        with pytest.raises(Conflict, match="did not answer") as silent:
            cm.connect(ca, a.qp, "10.0.0.2", 9, timeout=0.3)
        assert silent.value.current_state == "timeout" and time.monotonic() - started < 3
        assert listener.get_request(timeout=0.1) is None  # the request that timed out is gone from the queue
        with pytest.raises(InvalidArgument, match="at most 56 bytes"):
            cm.connect(ca, a.qp, "10.0.0.2", 9, bytes(57))
        listener.close()
        assert a.qp.query()["state"] == "reset"  # nothing of this touched the connector's QP


def test_a_listener_ends_with_its_session_and_its_waiting_connector_hears_it(hosts: Hosts) -> None:
    ca = Context.attach(hosts.make("a", ip="10.0.0.1"), ARENA)
    cb = Context.attach(hosts.make("b", ip="10.0.0.2"), ARENA)
    try:
        a = Guest(ca)
        cm.Listener(cb, 80)
        assert hosts.drivers["b"].cm.listening(cb.vrnic_id) == [80]
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                cm.connect(ca, a.qp, "10.0.0.2", 80, timeout=20)
            except Conflict as exc:
                errors.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        time.sleep(0.3)
        cb.close()  # the listening guest detaches
        thread.join(10)
        assert not thread.is_alive()
        assert [str(e) for e in errors] == ["connection rejected: the listener went away"]
        assert hosts.drivers["b"].cm.listening(cb.vrnic_id) == []
    finally:
        ca.close()
        cb.close()


def test_a_cross_tenant_connect_by_gid_through_the_cm_is_not_found() -> None:
    cmgr = ConnectionManager()
    registry = Registry(locator=MemoryLocator())
    owner = object()
    spec = VrnicSpec(id="v1", tenant="bob", vpc_id=2, virtual_gid=make_virtual_gid(2, 1))
    bob = VirtualRnic(spec=spec, device="d", token_hash="t", phys_gid="::ffff:10.0.0.1", gid_index=1)
    registry.add(bob)
    registry.attach(bob, type("S", (), {"close": lambda self: None})())
    cmgr.listen("v1", 5, owner)
    service = PeerService(registry, cmgr)
    with pytest.raises(NotFound, match="no reachable vRNIC"):
        service.cm_connect(ident(9, "eve", 3), spec.virtual_gid, 5, 1, b"", 1.0)
    with pytest.raises(InvalidArgument, match="is not of VPC"):  # an asker whose GID and VPC disagree
        service.cm_connect(Identity("v9", "bob", 2, make_virtual_gid(3, 9)), spec.virtual_gid, 5, 1, b"", 1.0)
    assert cmgr.get_request("v1", 5, owner, 0) is None  # nothing reached the listener


def test_accepting_a_request_whose_connector_gave_up_fails() -> None:
    cmgr = ConnectionManager()
    owner = object()
    cmgr.listen("v1", 5, owner)
    waiting: list[BaseException] = []

    def connect() -> None:
        try:
            cmgr.connect(ident(2, "t", 1), "v1", 5, 7, b"hi", 0.2)
        except Conflict as exc:
            waiting.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    request = cmgr.get_request("v1", 5, owner, 5)
    assert request is not None and request.private_data == b"hi"
    thread.join(5)
    assert waiting and waiting[0].current_state == "timeout"  # type: ignore[attr-defined]
    with pytest.raises(Conflict, match="stopped waiting"):
        cmgr.claim("v1", request.id, owner)
    with pytest.raises(NotFound):
        cmgr.claim("v1", request.id, owner)


def test_a_listener_queues_a_bounded_backlog_and_remote_waits_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from vrnic.backend import cm as cm_module
    from vrnic.backend import peer_service

    monkeypatch.setattr(cm_module, "BACKLOG", 2)
    monkeypatch.setattr(peer_service, "MAX_REMOTE_CM_WAITS", 1)
    cmgr = ConnectionManager()
    registry = Registry()
    spec = VrnicSpec(id="v1", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 1))
    owner = type("S", (), {"close": lambda self: None})()
    target = VirtualRnic(spec=spec, device="d", token_hash="t", phys_gid="::ffff:10.0.0.1", gid_index=1)
    registry.add(target)
    registry.attach(target, owner)
    cmgr.listen("v1", 5, owner)
    outcomes: list[str] = []
    service = PeerService(registry, cmgr)

    def here(n: int) -> object:  # a connector of this host
        return cmgr.connect(ident(10 + n, "t", 1), "v1", 5, n, b"", 1.0)

    def remote(n: int) -> object:  # one of another host, through this agent's route
        return service.cm_connect(ident(10 + n, "t", 1), spec.virtual_gid, 5, n, b"", 1.0)

    def attempt(call: Callable[[int], object], n: int) -> None:
        try:
            call(n)
        except Conflict as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=attempt, args=(remote, 0)), threading.Thread(target=attempt, args=(here, 1))]
    for t in threads:
        t.start()
    time.sleep(0.2)
    attempt(here, 2)  # a third request: the backlog (2) is full
    attempt(remote, 3)  # a second wait from another host: one may wait at a time
    assert outcomes[:2] == ["connection refused: the listener on port 5 has 2 requests waiting",
                            "connection refused: 1 requests from other hosts are waiting here already"]
    for t in threads:
        t.join(5)
    assert sorted(outcomes[2:]) == ["the listener on port 5 did not answer within 1 s"] * 2

