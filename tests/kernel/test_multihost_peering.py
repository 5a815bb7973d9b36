"""Two vrnicd agents on real rxe, linked only over HTTP: guests connect by virtual IP and move real bytes.

The lab's pair topology has rxe0 and rxe1 on the two ends of a veth pair. Agent a serves rxe0, agent b rxe1;
each has its own registry and its own API app, and they find each other through a shared Locator. A guest of
a connects to a guest of b with the rdma_cm-style helper (resolve the virtual IP, listen, connect with
private data): the connect request and every peer lookup cross agent b's /agent/v1 routes, and the QPs are
programmed with the other device's physical GID and QPN, which neither guest ever sees.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.peering_rig import PeerGuest, TwoAgents, two_agents, two_agents_on_one_database
from vrnic.backend.peer_directory import AgentDirectory, RemotePeer
from vrnic.backend.rdma_tool import resource_counts
from vrnic.frontend import Context, RecvRequest, SendRequest, WcStatus, WrOpcode, cm

from .conftest import wait_for_baseline


@pytest.fixture
def rig(device_pair: tuple[str, str], tmp_path: Path) -> Iterator[TwoAgents]:
    from vrnic.backend.pyverbs_edge import PyverbsEdge

    baseline = resource_counts()
    # Guests here are threads of the test process, in vrnicd's own cgroup: the direct engine cannot contain them.
    with two_agents(PyverbsEdge(), device_pair, tmp_path, direct_containment="best-effort",
                    peer_timeout_s=30.0) as agents:  # under the lab's emulation an answer can take seconds
        yield agents
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"


def Guest(ctx: Context, qp_type: str = "rc") -> PeerGuest:  # noqa: N802 (reads as the class it builds)
    return PeerGuest(ctx, qp_type, cqe=64, mr_bytes=65536)


@pytest.mark.parametrize("engine", ["ring", "direct"])
def test_guests_on_two_agents_connect_by_virtual_ip_and_move_bytes(rig: TwoAgents, engine: str) -> None:
    assert isinstance(rig.agents["a"].driver.registry.directory, AgentDirectory)
    info_a = rig.make("a", ip="10.0.0.1", engine=engine)
    info_b = rig.make("b", ip="10.0.0.2", engine=engine)
    a = Guest(Context.attach(info_a, arena_bytes=1 << 20))
    b = Guest(Context.attach(info_b, arena_bytes=1 << 20))
    try:
        assert a.ctx.engine == b.ctx.engine == engine
        assert (a.ctx.ip, b.ctx.ip) == ("10.0.0.1", "10.0.0.2")
        assert cm.resolve(a.ctx, "10.0.0.2") == b.ctx.gid
        started = time.monotonic()  # one plain lookup over HTTP first: how long an agent takes to answer here
        registry_a = rig.agents["a"].driver.registry
        peer, phys_qpn = registry_a.peer_qp(registry_a.get(info_a.vrnic_id), b.ctx.gid, b.qp.qpn)
        print(f"peer lookup over HTTP: {(time.monotonic() - started) * 1000:.0f} ms")
        assert isinstance(peer, RemotePeer) and peer.phys_gid != b.ctx.gid and phys_qpn != 0
        requests: list[cm.ConnectRequest] = []
        failures: list[BaseException] = []

        def listen() -> None:
            try:
                with cm.Listener(b.ctx, 18515) as listener:
                    listening.set()
                    request = listener.get_request(timeout=60)
                    assert request is not None
                    requests.append(request)
                    b.qp.modify("init")
                    b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 256),)))
                    listener.accept(request, b.qp, b"b's rkey follows: " + b.mr.rkey.to_bytes(4, "little"))
            except BaseException as exc:  # reported by the main thread
                failures.append(exc)
                listening.set()

        listening = threading.Event()
        thread = threading.Thread(target=listen)
        thread.start()
        assert listening.wait(30)
        a.qp.modify("init")
        a.qp.post_recv(RecvRequest(9, (a.mr.sge(8192, 256),)))
        try:
            done = cm.connect(a.ctx, a.qp, "10.0.0.2", 18515, b"hello from a", timeout=60)
        finally:
            thread.join(60)
            assert failures == []  # the listener's own error first: it says more
        assert [(r.remote_gid, r.private_data) for r in requests] == [(a.ctx.gid, b"hello from a")]
        assert (done.remote_gid, done.remote_qpn) == (b.ctx.gid, b.qp.qpn)
        assert done.private_data.startswith(b"b's rkey follows: ")
        rkey = int.from_bytes(done.private_data[-4:], "little")
        assert a.qp.query()["state"] == b.qp.query()["state"] == "rts"

        # SEND a -> b over the veth, bytes verified
        payload = bytes(range(256)) * 2
        a.mr.write(payload[:200])
        a.qp.post_send(SendRequest(2, WrOpcode.SEND, (a.mr.sge(0, 200),)))
        assert [c.status for c in a.cq.wait(1, timeout=30)] == [WcStatus.SUCCESS]
        assert [(c.status, c.byte_len) for c in b.cq.wait(1, timeout=30)] == [(WcStatus.SUCCESS, 200)]
        assert b.mr.read(200) == payload[:200]

        # RDMA WRITE a -> b with the rkey b sent as private data (translated through b's agent)
        a.mr.write(payload, 4096)
        a.qp.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(4096, 512),), remote_addr=b.mr.addr + 16384,
                                   rkey=rkey))
        assert [(c.wr_id, c.status) for c in a.cq.wait(1, timeout=30)] == [(3, WcStatus.SUCCESS)]
        assert b.mr.read(512, 16384) == payload

        # and a SEND back, b -> a
        b.mr.write(b"reply from b", 300)
        b.qp.post_send(SendRequest(4, WrOpcode.SEND, (b.mr.sge(300, 12),)))
        assert [c.status for c in b.cq.wait(1, timeout=30)] == [WcStatus.SUCCESS]
        assert [c.wr_id for c in a.cq.wait(1, timeout=30)] == [9]
        assert a.mr.read(12, 8192) == b"reply from b"
    finally:
        a.close()
        b.close()


def test_ud_between_two_agents_resolves_the_destination_and_names_the_source_virtually(rig: TwoAgents) -> None:
    a = Guest(Context.attach(rig.make("a"), arena_bytes=1 << 20), qp_type="ud")
    b = Guest(Context.attach(rig.make("b"), arena_bytes=1 << 20), qp_type="ud")
    try:
        for g in (a, b):
            for state in ("init", "rtr", "rts"):
                g.qp.modify(state)
        b.qp.post_recv([RecvRequest(i, (b.mr.sge(i * 1024, 1024),)) for i in range(2)], sync=True)
        for i in range(2):
            a.mr.write(f"datagram {i}".encode(), i * 64)
            a.qp.post_send(SendRequest(10 + i, WrOpcode.SEND, (a.mr.sge(i * 64, 10),),
                                       ud_gid=ipaddress.IPv6Address(b.ctx.gid).packed, ud_qpn=b.qp.qpn,
                                       ud_qkey=0x11111111))
        assert [c.status for c in a.cq.wait(2, timeout=30)] == [WcStatus.SUCCESS] * 2
        received = b.cq.wait(2, timeout=30)
        assert [(c.status, c.src_qp, c.byte_len) for c in received] == [(WcStatus.SUCCESS, a.qp.qpn, 50)] * 2
        assert [b.mr.read(10, i * 1024 + 40) for i in range(2)] == [b"datagram 0", b"datagram 1"]  # after the GRH
    finally:
        a.close()
        b.close()


def test_guests_placed_on_two_hosts_through_the_api_connect_by_virtual_ip_found_in_the_database(
        device_pair: tuple[str, str], tmp_path: Path) -> None:
    """The whole path on rxe: one control-plane database, the real DbLocator in both agents, vRNICs placed on
    two hosts through the REST API (b's through b's agent), then connected by virtual IP."""
    import httpx

    from vrnic.backend.pyverbs_edge import PyverbsEdge

    baseline = resource_counts()
    with two_agents_on_one_database(PyverbsEdge(), device_pair, tmp_path, peer_timeout_s=30.0) as cluster:
        url_a = cluster.agents["host-a"].url
        httpx.post(f"{url_a}/api/v1/tenants", json={"name": "acme"}, headers=cluster.operator,
                   timeout=60).raise_for_status()
        info_a = cluster.allocate("host-a", {"tenant": "acme", "host": "host-a", "virtual_ip": "10.0.0.11"})
        info_b = cluster.allocate("host-a", {"tenant": "acme", "host": "host-b", "virtual_ip": "10.0.0.12"})
        a = Guest(Context.attach(info_a, arena_bytes=1 << 20))
        b = Guest(Context.attach(info_b, arena_bytes=1 << 20))
        try:
            assert cm.resolve(a.ctx, "10.0.0.12") == b.ctx.gid
            failures: list[BaseException] = []

            def serve() -> None:
                try:
                    with cm.Listener(b.ctx, 5000) as listener:
                        listening.set()
                        request = listener.get_request(timeout=60)
                        assert request is not None
                        b.qp.modify("init")
                        b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 256),)))
                        listener.accept(request, b.qp, b"ok:" + request.private_data)
                except BaseException as exc:  # reported by the main thread
                    failures.append(exc)
                    listening.set()

            listening = threading.Event()
            thread = threading.Thread(target=serve)
            thread.start()
            assert listening.wait(30)
            try:
                done = cm.connect(a.ctx, a.qp, "10.0.0.12", 5000, b"db", timeout=60)
            finally:
                thread.join(60)
                assert failures == []
            assert done.private_data == b"ok:db"
            a.mr.write(b"found in the database")
            a.qp.post_send(SendRequest(2, WrOpcode.SEND, (a.mr.sge(0, 21),)))
            assert [c.status for c in a.cq.wait(1, timeout=30)] == [WcStatus.SUCCESS]
            assert [(c.status, c.byte_len) for c in b.cq.wait(1, timeout=30)] == [(WcStatus.SUCCESS, 21)]
            assert b.mr.read(21) == b"found in the database"
            a.mr.write(b"written across", 4096)
            a.qp.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(4096, 14),), remote_addr=b.mr.addr + 8192,
                                       rkey=b.mr.rkey))
            assert [c.status for c in a.cq.wait(1, timeout=30)] == [WcStatus.SUCCESS]
            assert b.mr.read(14, 8192) == b"written across"
        finally:
            a.close()
            b.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"
