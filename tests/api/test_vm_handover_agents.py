"""A VM's vRNIC handed from agent a to agent b over the agents' real HTTP routes (vrnic.api.agent_handover,
vrnic.backend.remote_handover): the destination and the peer hosts are reached only through /agent/v1.

Two verbs drivers on the in-memory fabric behind their own API apps (tests/peering_rig.py: real create_app,
SQLite, uvicorn), one locator; the scene (tests/handover_rig.py) is a VM on a with a peer guest on each host.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.handover_rig import Scene
from tests.peering_rig import AGENT_TOKEN, TwoAgents, two_agents
from tests.unit.fake_qemu import Vm, vm_factory
from tests.unit.test_backend_vm_migration import resume_on
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.peer_directory import AgentRef
from vrnic.backend.remote_handover import AgentClient, AgentDestination, AgentPeerHost
from vrnic.core.rings import RecvRequest, SendRequest, WcStatus, WrOpcode
from vrnic.errors import Unavailable

pytestmark = pytest.mark.api


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
def rig(edge: FakeEdge, tmp_path: Path) -> Iterator[TwoAgents]:
    with two_agents(edge, ("fake0", "fake1"), tmp_path) as agents:
        yield agents
    assert not edge.live, "objects left on the fake NIC"


@pytest.fixture
def scene(rig: TwoAgents, edge: FakeEdge, tmp_path: Path) -> Iterator[Scene]:
    clients: list[AgentClient] = []

    def client(agent: AgentRef) -> AgentClient:
        clients.append(AgentClient(agent, AGENT_TOKEN))
        return clients[-1]

    b = AgentRef("b", rig.agents["b"].url)
    (tmp_path / "vms").mkdir()
    vms = vm_factory(tmp_path / "vms")
    make_vm: Callable[[str], Vm] = next(vms)
    drivers = {host: agent.driver for host, agent in rig.agents.items()}
    made = Scene(drivers, rig.make, rig.locator, edge, make_vm, AgentDestination(client(b)),
                 lambda agent: AgentPeerHost(client(agent)), b)
    yield made
    made.close()
    for c in clients:
        c.close()
    next(vms, None)  # the fake QEMUs' sockets close


def test_the_handover_runs_over_the_agents_routes_under_traffic(scene: Scene, edge: FakeEdge) -> None:
    g_qps, g_mr, g_cq = scene.g_qps, scene.g_mr, scene.g_cq
    g_qps[1].post_recv([RecvRequest(200 + i, (g_mr.sge(4096 + i * 512, 512),)) for i in range(2)])
    prepared = scene.prepare()
    assert prepared["peer_hosts"] == 2 and prepared["device"] == "fake1"
    for seq in range(1, 6):
        scene.write("a", seq)
        scene.write("b", seq)
    for host in ("a", "b"):
        assert [c.status for c in scene.p_cq[host].wait(5)] == [WcStatus.SUCCESS] * 5
    before = scene.source_objects()
    report = scene.a.complete_vm_handover("vm1", scene.record_move)
    spares = scene.guest.spare_qp_count  # the guest's pool of new QPs moves too
    assert report["peers_repointed"] == 2 and report["qps"] == 2 + spares and report["recvs_reposted"] == 2, report
    assert not before & edge.live  # nothing of the VM is left on a
    for base in (8192, 16384):
        assert scene.dest.read_gpa(g_mr.addr + base + 8, 40) == b"".join(struct.pack("<Q", s) for s in range(1, 6))
    resume_on(scene.guest, scene.dest)
    for seq, host in ((6, "a"), (7, "b")):  # a's peer now reaches the VM on b through b's agent
        scene.write(host, seq)
        assert [c.status for c in scene.p_cq[host].wait(1)] == [WcStatus.SUCCESS]
    assert struct.unpack("<Q", g_mr.read(8, 8192 + 48))[0] == 6
    assert struct.unpack("<Q", g_mr.read(8, 16384 + 56))[0] == 7
    scene.p_mr["b"].write(b"hello", 0)
    scene.p_qps["b"].post_send(SendRequest(9, WrOpcode.SEND, (scene.p_mr["b"].sge(0, 5),)))
    assert [c.status for c in scene.p_cq["b"].wait(1)] == [WcStatus.SUCCESS]
    assert [(c.wr_id, c.byte_len) for c in g_cq.wait(1)] == [(200, 5)] and g_mr.read(5, 4096) == b"hello"


def test_no_vrnicd_at_the_destination_is_unavailable_and_the_source_serves_on(scene: Scene) -> None:
    with socket_nobody_listens() as url:
        client = AgentClient(AgentRef("b", url), AGENT_TOKEN)
        try:
            with pytest.raises(Unavailable, match="cannot be reached"):
                scene.prepare(destination=AgentDestination(client))
        finally:
            client.close()
    assert scene.a.registry.dirty_log(scene.vm_id) is None and scene.b.registry.dirty_log(scene.vm_id) is None
    scene.write("b", 1)
    assert [c.status for c in scene.p_cq["b"].wait(1)] == [WcStatus.SUCCESS]


def test_the_handover_routes_need_the_agent_token(rig: TwoAgents) -> None:
    for method, path in (("POST", "/agent/v1/handover/vm1/take-over"), ("GET", "/agent/v1/moving/v1")):
        reply = httpx.request(method, rig.agents["b"].url + path, json={}, timeout=10)
        assert reply.status_code == 401, reply.text


@contextlib.contextmanager
def socket_nobody_listens() -> Iterator[str]:
    """An http:// URL on a port nothing listens on (bound, never listening, until the block ends)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
