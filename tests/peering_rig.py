"""Two vrnicd agents in one process, linked only over HTTP: each a verbs driver with its own registry, served by
its own API app (create_app on its own SQLite database), finding the other through a shared Locator.

The API tier runs it on the in-memory fabric (fake0, fake1); the kernel tier on rxe0 and rxe1 of the lab's pair
topology. AgentDirectory (one agent) talks to agent_peers (the other) for real.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import SecretStr

from tests.peering_fakes import MemoryLocator
from vrnic.api.app import create_app
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.peer_directory import AgentRef
from vrnic.backend.rnic_edge import RnicEdge
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import AttachInfo, DataEngine, VrnicMode, VrnicSpec, active_roce_v2_gid
from vrnic.core.vaddr import make_virtual_gid
from vrnic.daemon import serve_in_thread
from vrnic.db.engine import make_engine
from vrnic.db.migrate import upgrade
from vrnic.frontend import CQ, MR, PD, QP, Access, Context

AGENT_TOKEN = "vra_peering-rig-agent-token"
_serial = itertools.count(7000)


@dataclass
class Agent:
    host: str
    device: str
    driver: VerbsDriver
    url: str = ""


@dataclass
class TwoAgents:
    locator: MemoryLocator
    edge: RnicEdge
    agents: dict[str, Agent] = field(default_factory=dict)

    def make(self, host: str, tenant: str = "t1", vpc: int = 1, ip: str | None = None,
             engine: str = "ring") -> AttachInfo:
        """A vRNIC on host's device, recorded in the locator as the control plane would."""
        agent = self.agents[host]
        serial = next(_serial)
        spec = VrnicSpec(id=f"mh{serial}", tenant=tenant, vpc_id=vpc, virtual_gid=make_virtual_gid(vpc, serial),
                         virtual_ip=ip, engine=DataEngine(engine))
        info = agent.driver.create_vrnic(spec, agent.device)
        _, phys_gid = active_roce_v2_gid(self.edge.describe(agent.device))
        self.locator.place(AgentRef(host, agent.url), spec.virtual_gid, phys_gid, vpc, ip)
        return info


@contextlib.contextmanager
def two_agents(edge: RnicEdge, devices: tuple[str, str], tmp: Path, **driver_options: object) -> Iterator[TwoAgents]:
    """Agents "a" (devices[0]) and "b" (devices[1]), each served over HTTP on 127.0.0.1."""
    rig = TwoAgents(MemoryLocator(), edge)
    with contextlib.ExitStack() as stack:
        for host, device in zip(("a", "b"), devices, strict=True):
            driver = VerbsDriver(socket_path=tmp / f"{host}.sock", edge=edge, devices=[device], locator=rig.locator,
                                 agent_token=AGENT_TOKEN, **driver_options)  # type: ignore[arg-type]
            backend = BackendService({VrnicMode.PARAVIRTUAL: driver})
            stack.callback(backend.close)
            engine = make_engine(f"sqlite:///{tmp / f'{host}.db'}")
            stack.callback(engine.dispose)
            upgrade(engine)
            settings = DaemonSettings(state_dir=tmp, operator_token=SecretStr("vro_peering-rig-operator"),
                                      agent_token=SecretStr(AGENT_TOKEN), host_name=f"host-{host}",
                                      paravirtual_driver=None, sriov_driver=None, qos_reconcile_interval=0)
            url = stack.enter_context(serve_in_thread(create_app(settings, backend, engine=engine)))
            rig.agents[host] = Agent(host, device, driver, url)
        yield rig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """Two agents on one control-plane database: the real DbLocator, vRNICs placed through the REST API."""

    agents: dict[str, Agent]
    operator: dict[str, str]

    def allocate(self, via: str, body: dict[str, object]) -> AttachInfo:
        reply = httpx.post(f"{self.agents[via].url}/api/v1/vrnics", json=body, headers=self.operator, timeout=60)
        reply.raise_for_status()
        return AttachInfo.model_validate(reply.json()["attach"])


@contextlib.contextmanager
def two_agents_on_one_database(edge: RnicEdge, devices: tuple[str, str], tmp: Path,
                               **driver_options: object) -> Iterator[Cluster]:
    """Hosts "host-a" (devices[0]) and "host-b" (devices[1]) registered in one database (SQLite here, as the
    daemon's default), each with its own backend, DbLocator and API on its own port."""
    from vrnic.db.locator import DbLocator

    database = f"sqlite:///{tmp / 'cluster.db'}"
    operator = "vro_peering-rig-operator"
    agents: dict[str, Agent] = {}
    with contextlib.ExitStack() as stack:
        shared = make_engine(database)
        stack.callback(shared.dispose)
        upgrade(shared)
        for host, device in zip(("host-a", "host-b"), devices, strict=True):
            engine = make_engine(database)
            stack.callback(engine.dispose)
            driver = VerbsDriver(socket_path=tmp / f"{host}.sock", edge=edge, devices=[device],
                                 locator=DbLocator(engine), agent_token=AGENT_TOKEN,
                                 **driver_options)  # type: ignore[arg-type]
            backend = BackendService({VrnicMode.PARAVIRTUAL: driver})
            stack.callback(backend.close)
            port = free_port()
            settings = DaemonSettings(state_dir=tmp, operator_token=SecretStr(operator), host_name=host,
                                      agent_token=SecretStr(AGENT_TOKEN), listen_port=port,
                                      advertise_url=f"http://127.0.0.1:{port}", paravirtual_driver=None,
                                      sriov_driver=None, qos_reconcile_interval=0)
            url = stack.enter_context(serve_in_thread(create_app(settings, backend, engine=engine), port=port))
            agents[host] = Agent(host, device, driver, url)
        yield Cluster(agents, {"Authorization": f"Bearer {operator}"})



ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class PeerGuest:
    """A guest's PD, one CQ, one MR and one QP on an attached context (the peering tests' endpoint)."""

    def __init__(self, ctx: Context, qp_type: str = "rc", cqe: int = 32, mr_bytes: int = 4096) -> None:
        self.ctx = ctx
        self.pd = PD(ctx)
        self.cq = CQ(ctx, cqe)
        self.mr = MR(self.pd, mr_bytes, ALL)
        self.qp = QP(self.pd, self.cq, self.cq, qp_type=qp_type)

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq, self.pd, self.ctx):
            obj.close()
