"""Peering across agents over real HTTP: AgentDirectory on one side, the agent_peers routes on the other.

Two verbs drivers with their own registries on the in-memory fabric, each behind its own API app (real
create_app, SQLite, uvicorn): a guest of agent a reaches a guest of agent b only through b's /agent/v1 routes.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.peering_fakes import MemoryLocator
from tests.peering_rig import AGENT_TOKEN, PeerGuest, TwoAgents, two_agents, two_agents_on_one_database
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.peer_directory import AgentDirectory, AgentRef
from vrnic.core.peering import Identity
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict, NotFound, Unavailable
from vrnic.frontend import QP, Context, RecvRequest, SendRequest, WcStatus, WrOpcode, cm

ARENA = 1 << 20


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[TwoAgents]:
    edge = FakeEdge()
    with two_agents(edge, ("fake0", "fake1"), tmp_path) as agents:
        yield agents
    assert not edge.live, "objects left on the fake NIC"


Guest = PeerGuest


def send_and_write(a: Guest, b: Guest, text: bytes) -> None:
    b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 64),)))
    a.mr.write(text)
    a.qp.post_send(SendRequest(2, WrOpcode.SEND, (a.mr.sge(0, len(text)),)))
    assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
    assert [(c.status, c.byte_len) for c in b.cq.wait(1)] == [(WcStatus.SUCCESS, len(text))]
    assert b.mr.read(len(text)) == text
    a.mr.write(text[::-1], 1000)
    a.qp.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(1000, len(text)),), remote_addr=b.mr.addr + 3000,
                               rkey=b.mr.rkey))
    assert [(c.wr_id, c.status) for c in a.cq.wait(1)] == [(3, WcStatus.SUCCESS)]
    assert b.mr.read(len(text), 3000) == text[::-1]


def test_guests_behind_two_agents_connect_by_gid_and_move_bytes(rig: TwoAgents) -> None:
    assert isinstance(rig.agents["a"].driver.registry.directory, AgentDirectory)
    with Context.attach(rig.make("a"), ARENA) as ca, Context.attach(rig.make("b"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        a.qp.connect(cb.gid, b.qp.qpn)
        b.qp.connect(ca.gid, a.qp.qpn)
        send_and_write(a, b, b"over two agents")
        send_and_write(b, a, b"and back again")


def test_ud_across_agents_with_the_source_named_virtually(rig: TwoAgents) -> None:
    with Context.attach(rig.make("a"), ARENA) as ca, Context.attach(rig.make("b"), ARENA) as cb:
        a, b = Guest(ca, qp_type="ud"), Guest(cb, qp_type="ud")
        for g in (a, b):
            for state in ("init", "rtr", "rts"):
                g.qp.modify(state)
        b.qp.post_recv(RecvRequest(5, (b.mr.sge(0, 256),)), sync=True)
        a.mr.write(b"datagram")
        a.qp.post_send(SendRequest(6, WrOpcode.SEND, (a.mr.sge(0, 8),), ud_gid=ipaddress.IPv6Address(cb.gid).packed,
                                   ud_qpn=b.qp.qpn, ud_qkey=0x11111111))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        (wc,) = b.cq.wait(1)
        assert (wc.status, wc.src_qp, wc.byte_len) == (WcStatus.SUCCESS, a.qp.qpn, 8)
        assert b.mr.read(8, 40) == b"datagram"  # after the 40-byte GRH


def test_another_tenant_is_refused_and_audited_by_the_owner_then_a_peering_rule_allows_it(rig: TwoAgents) -> None:
    with Context.attach(rig.make("a", tenant="alice", vpc=21), ARENA) as ca, \
            Context.attach(rig.make("b", tenant="bob", vpc=22), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        with pytest.raises(NotFound) as refused:
            a.qp.connect(cb.gid, b.qp.qpn)
        ghost = make_virtual_gid(22, 424242)
        rig.locator.place(AgentRef("b", rig.agents["b"].url), ghost, "::ffff:10.99.0.2", 22)  # b holds no such vRNIC
        with pytest.raises(NotFound) as missing:
            a.qp.connect(ghost, b.qp.qpn)
        assert str(refused.value).replace(cb.gid, "GID") == str(missing.value).replace(ghost, "GID")
        assert ("peer.refused", ca.vrnic_id, cb.vrnic_id) in rig.locator.actions()
        rig.locator.allow("alice", "bob")
        rig.locator.allow("bob", "alice")
        time.sleep(1.05)  # the registries' rule caches
        a.qp.connect(cb.gid, b.qp.qpn)
        b.qp.connect(ca.gid, a.qp.qpn)
        send_and_write(a, b, b"peered VPCs")
        assert ("peer.allowed", ca.vrnic_id, cb.vrnic_id) in rig.locator.actions()


def test_connect_by_virtual_ip_across_agents_with_private_data_both_ways(rig: TwoAgents) -> None:
    with Context.attach(rig.make("a", ip="10.0.0.1"), ARENA) as ca, \
            Context.attach(rig.make("b", ip="10.0.0.2"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        assert cm.resolve(ca, "10.0.0.2") == cb.gid
        assert cm.resolve(cb, "10.0.0.1") == ca.gid
        got: list[cm.ConnectRequest] = []

        def serve() -> None:
            with cm.Listener(cb, 4791) as listener:
                listening.set()
                request = listener.get_request(timeout=15)
                assert request is not None
                got.append(request)
                b.qp.modify("init")
                b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 64),)))
                listener.accept(request, b.qp, bytes(range(196)))

        listening = threading.Event()
        thread = threading.Thread(target=serve)
        thread.start()
        assert listening.wait(5)
        a.qp.modify("init")
        a.qp.post_recv(RecvRequest(9, (a.mr.sge(2048, 64),)))
        done = cm.connect(ca, a.qp, "10.0.0.2", 4791, b"x" * 56, timeout=15)
        thread.join(15)
        assert done == cm.Connected(cb.gid, b.qp.qpn, bytes(range(196)))
        assert [(r.remote_gid, r.private_data) for r in got] == [(ca.gid, b"x" * 56)]
        send_and_write(a, b, b"by virtual IP, across hosts")
        b.mr.write(b"reply")
        b.qp.post_send(SendRequest(4, WrOpcode.SEND, (b.mr.sge(0, 5),)))
        assert [c.status for c in b.cq.wait(1)] == [WcStatus.SUCCESS]
        assert [c.wr_id for c in a.cq.wait(1)] == [9] and a.mr.read(5, 2048) == b"reply"
        with pytest.raises(Conflict, match="nothing listens"):  # the listener went with its `with`
            cm.connect(ca, QP(a.pd, a.cq, a.cq), "10.0.0.2", 4791, timeout=5)


def test_agent_routes_need_the_agent_token(rig: TwoAgents) -> None:
    url = rig.agents["b"].url + "/agent/v1/peers/qp"
    asker = {"vrnic_id": "x", "tenant": "t1", "vpc_id": 1, "virtual_gid": make_virtual_gid(1, 1)}
    body = {"asker": asker, "virtual_gid": make_virtual_gid(1, 2), "vqpn": 1}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = httpx.post(url, json=body, headers={"Authorization": f"Bearer {AGENT_TOKEN}"})
    assert (answer.status_code, answer.json()["code"]) == (404, "not_found")


def test_an_agent_that_is_down_or_refuses_our_token_is_unavailable() -> None:
    locator = MemoryLocator()
    gid = make_virtual_gid(1, 5)
    with socket.socket() as s:  # a port nobody listens on: take a free one and let it go
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    locator.place(AgentRef("gone", f"http://127.0.0.1:{port}"), gid, "::ffff:10.1.1.1", 1)
    directory = AgentDirectory(locator, "token", timeout=1.0)
    asker = Identity("v1", "t1", 1, make_virtual_gid(1, 4))
    try:
        with pytest.raises(Unavailable, match="cannot be reached"):
            directory.peer_qp(asker, gid, 3)
        with pytest.raises(NotFound):
            directory.peer_qp(asker, make_virtual_gid(1, 6), 3)  # the locator knows no agent for it
        assert directory.virtual_qpn(asker, "::ffff:10.9.9.9", 3) == 0
    finally:
        directory.close()


def test_a_wrong_agent_token_is_a_setup_fault_not_a_missing_peer(rig: TwoAgents) -> None:
    directory = AgentDirectory(rig.locator, "not-the-token")
    info = rig.make("b")
    try:
        with pytest.raises(Unavailable, match="refused this agent's token"):
            directory.peer_qp(Identity("v1", "t1", 1, make_virtual_gid(1, 4)), info.virtual_gid, 1)
    finally:
        directory.close()


def test_with_the_database_locator_guests_placed_on_two_hosts_connect_by_virtual_ip(tmp_path: Path) -> None:
    """The whole path: vRNICs placed on two hosts through the REST API, found through the real DbLocator."""
    edge = FakeEdge()
    with two_agents_on_one_database(edge, ("fake0", "fake1"), tmp_path) as cluster:
        httpx.post(f"{cluster.agents['host-a'].url}/api/v1/tenants", json={"name": "acme"},
                   headers=cluster.operator).raise_for_status()
        info_a = cluster.allocate("host-a", {"tenant": "acme", "host": "host-a", "virtual_ip": "10.0.0.11"})
        info_b = cluster.allocate("host-a", {"tenant": "acme", "host": "host-b", "virtual_ip": "10.0.0.12"})
        assert Path(info_b.socket_path or "").name == "host-b.sock"  # placed on b, through b's agent
        with Context.attach(info_a, ARENA) as ca, Context.attach(info_b, ARENA) as cb:
            a, b = Guest(ca), Guest(cb)
            assert cm.resolve(ca, "10.0.0.12") == cb.gid
            listening = threading.Event()

            def serve() -> None:
                with cm.Listener(cb, 5000) as listener:
                    listening.set()
                    request = listener.get_request(timeout=15)
                    assert request is not None
                    b.qp.modify("init")
                    b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 64),)))
                    listener.accept(request, b.qp, b"ok:" + request.private_data)

            thread = threading.Thread(target=serve)
            thread.start()
            assert listening.wait(5)
            done = cm.connect(ca, a.qp, "10.0.0.12", 5000, b"db", timeout=15)
            thread.join(15)
            assert done.private_data == b"ok:db"
            send_and_write(a, b, b"placed by the API, found in the database")
    assert not edge.live

