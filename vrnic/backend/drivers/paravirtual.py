"""The `verbs` driver: paravirtual vRNICs on any verbs device (rxe, or a real RNIC).

Each vRNIC gets its own device context when its guest attaches through the
frontend channel (a shared-ring vRNIC's is opened at admission and kept across
its guests: vrnic.backend.idle_contexts). The driver holds the registry, serves
the channel, and composes each session from its parts: guest memory, a device
context from the RNIC edge, and a data-path engine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from pydantic import SecretStr

from vrnic.backend import vm_handover, vm_migration
from vrnic.backend.attachment import Disconnect, PeerCred
from vrnic.backend.channel import ChannelLimits, ChannelServer
from vrnic.backend.cm import ConnectionManager
from vrnic.backend.direct import DirectEngine, DirectSession
from vrnic.backend.driver import RnicDriver
from vrnic.backend.engine import DataPathEngine, EngineHost, SharedRingEngine
from vrnic.backend.flow_guard import FlowGuard
from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.idle_contexts import IdleContexts
from vrnic.backend.peer_directory import LOOKUP_TIMEOUT_S, AgentDirectory, Locator, PeerDirectory
from vrnic.backend.peer_service import PeerService
from vrnic.backend.qos_shaper import HtbShaper, QosMechanism, link_speed_mbps, uplink_netdev
from vrnic.backend.rdma_cgroup import Confinement
from vrnic.backend.registry import ChangeMark, Registry, VirtualRnic
from vrnic.backend.rnic_edge import DeviceContext, RnicEdge
from vrnic.backend.session import GuestSession
from vrnic.backend.vm_link import VmLink, connect_channel
from vrnic.core.framing import peer_cred
from vrnic.core.handover import HandoverPhase, QpCarry
from vrnic.core.migration import MigrationPhase
from vrnic.core.peer_wire import MrWindowWire
from vrnic.core.qos import admit, drain_kbit, drain_rates, rc_timeout_s
from vrnic.core.recovery import token_digest
from vrnic.core.session_state import SessionSnapshot
from vrnic.core.specs import (
    AttachInfo,
    DataEngine,
    DeviceInfo,
    QosPolicy,
    VmBinding,
    VrnicMode,
    VrnicSpec,
    active_roce_v2_gid,
)
from vrnic.core.verb_args import Attach, VmAttach
from vrnic.errors import Conflict, DeviceError, InvalidArgument, NotFound, NotSupported, VrnicError

log = logging.getLogger(__name__)
DEFAULT_SOCKET = Path("/run/vrnic/vrnicd.sock")


class _DrainPlan(NamedTuple):
    """_qos_drain_kbit's plan for one device: right while ChangeMark and the link stay at mark and link."""

    mark: int
    link: int
    policies: tuple[tuple[str, QosPolicy], ...]  # (vRNIC id, its policy) for each vRNIC on the device
    rates: dict[str, int]  # each one's drain rate, kbit/s


class VerbsDriver(RnicDriver):
    name: ClassVar[str] = "verbs"
    modes: ClassVar[frozenset[VrnicMode]] = frozenset({VrnicMode.PARAVIRTUAL})

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET, devices: list[str] | None = None,
                 edge: RnicEdge | None = None, channel: ChannelLimits | None = None,
                 direct_containment: str = "required", packet_guard: bool | FlowGuard = False,
                 strict_isolation: bool = False, qos_link_mbps: int | None = None, locator: Locator | None = None,
                 agent_token: str | SecretStr | None = None, directory: PeerDirectory | None = None,
                 peer_timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        """direct_containment: "required" refuses a direct-engine guest whose cgroup vrnicd cannot limit
        (rdma.max); "best-effort" lets it attach uncontained, with a warning and `contained: false`.
        packet_guard: filter RoCE egress of the devices served to the flows vrnicd connected (nftables).
        strict_isolation: refuse the direct engine wherever the guard cannot hold (no guard, or a device that
        loops its own traffic back past it, as rxe does).
        locator: the cluster's store (security-group rules, virtual IPs, which host holds a GID, the audit log);
        with agent_token, peers on other hosts are reached through their agents (AgentDirectory; `directory`
        replaces it; peer_timeout_s bounds each of its lookups). Without a locator only this vrnicd's vRNICs are
        peers, and only within their VPC."""
        if direct_containment not in ("required", "best-effort"):
            raise InvalidArgument(f"direct_containment is 'required' or 'best-effort', not {direct_containment!r}")
        self.direct_containment = direct_containment
        self.guard: FlowGuard | None = (packet_guard if isinstance(packet_guard, FlowGuard)
                                        else FlowGuard() if packet_guard else None)
        self.strict_isolation = strict_isolation
        self.qos_link_mbps = qos_link_mbps  # the uplinks' speed when sysfs has none (veth, some virtio-net)
        self._shapers: dict[str, QosMechanism] = {}  # by device, while any vRNIC on it asks for QoS
        self._qos_lock = threading.RLock()
        self._can_shape: dict[str, bool] = {}  # device -> has a QoS mechanism (DeviceInfo caps "qos_shaping")
        self._drain_plans: dict[str, _DrainPlan] = {}  # by device
        # device -> its uplink's speed as the RC timeout floor assumes it while the device shapes nothing (read once,
        # as a shaper reads it once): two sysfs reads on every connect cost a third of the verb under TCG (issue 14)
        self._unshaped_link: dict[str, int | None] = {}
        if edge is None:
            from vrnic.backend.pyverbs_edge import PyverbsEdge  # pyverbs only where a real device is used

            edge = PyverbsEdge()
        self.edge = edge
        self.socket_path = Path(socket_path)
        self._only = devices
        token = agent_token.get_secret_value() if isinstance(agent_token, SecretStr) else agent_token
        if locator is not None and directory is None and not token:
            log.warning("a locator but no agent token: peers on other hosts stay unreachable")
        self._own_directory = (AgentDirectory(locator, token, peer_timeout_s)
                               if directory is None and locator is not None and token else None)
        self.registry = Registry(locator=locator, directory=directory or self._own_directory)
        # one per idle shared-ring vRNIC, for its next guest
        self.idle_contexts = IdleContexts(edge.open, self.registry.still_holds)
        self.cm = ConnectionManager()  # listeners of every vRNIC here, for local and remote connectors
        self.peers = PeerService(self.registry, self.cm)  # what other hosts' agents may ask about ours
        self._vms: dict[str, _BoundVm] = {}
        self._incoming: dict[str, _Incoming] = {}  # VMs handed over from another host, until they serve here
        self._vm_lock = threading.Lock()
        self.server = ChannelServer(self.socket_path, self.open_session, channel, self.opens_quickly)
        self.server.start()
        self._sweep_qos()

    def devices(self) -> list[DeviceInfo]:
        names = [n for n in self.edge.device_names() if self._only is None or n in self._only]
        return [self.edge.describe(n) for n in names]

    def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
        token = secrets.token_urlsafe(24)
        self._hold(spec, device, token_digest(token))
        return AttachInfo(vrnic_id=spec.id, mode=spec.mode, device=device, virtual_gid=spec.virtual_gid,
                          socket_path=str(self.socket_path), token=token)

    def restore_vrnic(self, spec: VrnicSpec, device: str, token_hash: str) -> None:
        """Hold again a vRNIC an earlier vrnicd held (crash recovery): the guest's token still attaches."""
        self._hold(spec, device, token_hash)

    def _hold(self, spec: VrnicSpec, device: str, token_hash: str) -> None:
        """Make and admit the vRNIC. A shared-ring one keeps a device context for its first guest, and its
        description is read through that context: one device open where a description and the context took two
        (issue 14; a restart restoring many vRNICs paid the second open for each)."""
        context, info = (self.edge.open_described(device) if spec.engine is DataEngine.RING
                         and self.idle_contexts.has_room() else (None, self.edge.describe(device)))
        try:
            vrnic = self._make_vrnic(spec, device, token_hash, info)
            self._admit(vrnic, ready_context=context is None)
        except BaseException:
            if context is not None:
                context.close()
            raise
        if context is not None:
            # A restored vRNIC's guest may attach meanwhile (its token is out): it opens its own context, and
            # this one is kept for its next guest, as prime() would keep it.
            self.idle_contexts.give_back(vrnic, context)

    def _make_vrnic(self, spec: VrnicSpec, device: str, token_hash: str, info: DeviceInfo) -> VirtualRnic:
        gid_index, phys_gid = active_roce_v2_gid(info)
        if spec.engine is DataEngine.DIRECT:
            self._check_direct(spec, info)
        if self.guard is not None:
            self.guard.guard_address(phys_gid)
        return VirtualRnic(spec=spec, device=device, token_hash=token_hash, phys_gid=phys_gid,
                           gid_index=gid_index)

    def _admit(self, vrnic: VirtualRnic, ready_context: bool = True) -> None:
        """The vRNIC joins the registry (peers can find it) and its device's QoS; a shared-ring one gets the device
        context its first guest will take (ready_context), unless a session already holds one."""
        spec, device = vrnic.spec, vrnic.device
        with self._qos_lock:
            self._admit_qos(spec.id, device, spec.qos)
            self.registry.add(vrnic)
            try:
                self._qos_refresh(device)
            except BaseException:
                self.registry.remove(spec.id)
                self._qos_refresh(device)
                raise
        if ready_context and spec.engine is DataEngine.RING:
            self.idle_contexts.prime(vrnic)
        log.info("vRNIC %s (tenant %s) on %s", spec.id, spec.tenant, device)

    def _check_direct(self, spec: VrnicSpec, info: DeviceInfo) -> None:
        if not info.caps.get("direct_engine"):
            raise NotSupported(f"{info.name} has no direct data path in vrnic (rxe has); use engine=ring")
        if not self.strict_isolation:
            if self.guard is None:
                log.warning("vRNIC %s: direct engine with the packet guard off: its guest can point its QPs at "
                            "any QP it can name (VRNIC_PACKET_GUARD=true filters that)", spec.id)
            return
        if self.guard is None:
            raise Conflict(f"strict isolation: the direct engine needs the packet guard, which is off "
                           f"(VRNIC_PACKET_GUARD); vRNIC {spec.id} is refused", current_state="unguarded")
        if info.caps.get("direct_guard_loopback_gap"):
            raise Conflict(f"strict isolation: {info.name} loops traffic between its own QPs back past the packet "
                           f"guard, so a direct guest could reach other tenants' QPs on it; vRNIC {spec.id} is "
                           f"refused (use engine=ring)", current_state="loopback_gap")

    def open_session(self, args: Attach, fds: list[int], cred: PeerCred,
                     disconnect: Disconnect = lambda: None) -> GuestSession:
        """The channel's SessionOpener: a container guest's memfd arena and eventfds, by attach token."""
        try:
            vrnic = self.registry.by_token(args.token)
            memory = GuestMemory(fds[0])
        except BaseException:
            _close_fds(fds)
            raise
        return self._compose(vrnic, memory, cred, fds[1], fds[2] if len(fds) > 2 else None, args.busy_poll,
                             disconnect, vm_domain=None)

    def opens_quickly(self, args: Attach) -> bool:
        """The channel's OpensQuickly: a shared-ring vRNIC whose device context waits idle opens no device and
        confines nothing, so its session can open on the channel's selector thread; so is a token that matches
        nothing refused at once, at no thread's cost. The direct engine, or a vRNIC with no idle context, opens
        on the guest's thread, which may block alone."""
        try:
            vrnic = self.registry.by_token(args.token)
        except VrnicError:
            return True  # open_session refuses it before it touches the descriptors' memory or any device
        return vrnic.spec.engine is not DataEngine.DIRECT and self.idle_contexts.holds(vrnic.spec.id)

    def _compose(self, vrnic: VirtualRnic, memory: GuestMemory, cred: PeerCred, doorbell_fd: int,
                 notify_fd: int | None, busy_poll: bool, disconnect: Disconnect,
                 vm_domain: str | None) -> GuestSession:
        """Memory, device context, engine: one session. It owns memory and the fds, also when it raises."""
        device: DeviceContext | None = None
        session: GuestSession | None = None
        confined: GuestContainment | None = None
        try:
            if vrnic.session is not None:  # checked again, atomically, by registry.attach
                raise Conflict(f"vRNIC {vrnic.spec.id} already has a guest attached", current_state="attached")
            session_type: type[GuestSession]
            engine: Callable[[EngineHost], DataPathEngine]
            if vrnic.spec.engine is DataEngine.DIRECT:
                if vm_domain is not None:
                    raise Conflict(f"vRNIC {vrnic.spec.id} uses the direct engine, which VMs cannot: QEMU cannot "
                                   f"map rxe's kernel queues into guest memory", current_state="direct")
                device = self.edge.open_direct(vrnic.device)
                confinement = confined = self._confine(vrnic, cred)
                session_type = functools.partial(DirectSession, confinement=confinement)  # type: ignore[assignment]
                engine = DirectEngine
            else:
                device = self.idle_contexts.take(vrnic)
                session_type = GuestSession
                engine = functools.partial(SharedRingEngine, busy_poll=busy_poll)
            session = session_type(vrnic, self.registry, device, memory, cred, doorbell_fd=doorbell_fd,
                                   notify_fd=notify_fd, engine_factory=engine, disconnect=disconnect,
                                   guard=self.guard, qos=self._shapers.get(vrnic.device), cm=self.cm,
                                   qos_drain_kbit=functools.partial(self._qos_drain_kbit, vrnic.device, vrnic.spec.id),
                                   give_back_device=functools.partial(self.idle_contexts.give_back, vrnic))
            self.registry.attach(vrnic, session, vm_domain)
        except BaseException:
            if session is not None:
                session.close()  # closes memory, device and the fds it took
            else:
                if confined is not None:
                    confined.release()
                if device is not None:
                    device.close()
                memory.close()
                _close_fds([fd for fd in (doorbell_fd, notify_fd) if fd is not None])
            raise
        session.start()
        return session

    def _confine(self, vrnic: VirtualRnic, cred: PeerCred) -> GuestContainment | None:
        """Zero rdma objects for the guest's own cgroup, and its memlock limit down to the quota: what it
        could create through the fd it gets would escape vrnicd's quota otherwise."""
        from vrnic.backend.rdma_cgroup import confine, limit_memlock

        try:
            confinement = confine(cred.pid, vrnic.device)
        except (Conflict, DeviceError) as exc:
            if self.direct_containment == "required":
                raise Conflict(f"vRNIC {vrnic.spec.id}: the direct engine hands the guest its uverbs fd, and this "
                               f"guest cannot be contained: {exc}", current_state="uncontained") from exc
            log.warning("vRNIC %s: direct-engine guest pid %d is NOT contained (%s); objects it creates itself "
                        "escape the quota", vrnic.spec.id, cred.pid, exc)
            return None
        try:
            soft, hard = limit_memlock(cred.pid, vrnic.spec.quota.max_pinned_bytes)
        except VrnicError as exc:
            confinement.release()
            raise Conflict(f"vRNIC {vrnic.spec.id}: cannot limit the guest's locked memory: {exc}") from exc
        log.info("vRNIC %s: guest pid %d confined (rdma.max 0 on %s, memlock %d bytes, was %d)", vrnic.spec.id,
                 cred.pid, vrnic.device, vrnic.spec.quota.max_pinned_bytes, soft)
        return GuestContainment(confinement, cred.pid, (soft, hard))

    # ----- VMs: bound by the libvirt hook, served over their virtio-serial channels ----------------------
    def bind_vm(self, binding: VmBinding) -> None:
        """Map the VM's RAM, reserve its vRNICs and connect to each channel; all or nothing."""
        with self._vm_lock:
            bound = self._vms.get(binding.domain)
            if bound is not None:
                if bound.binding == binding and all(link.alive for link in bound.links):
                    return  # libvirtd's `reconnect`, or a repeated `started`
                self._unbind(binding.domain)  # changed, or QEMU was replaced: bind afresh
            vrnics = [self.registry.get(v.vrnic_id) for v in binding.vrnics]
            direct = [v.spec.id for v in vrnics if v.spec.engine is DataEngine.DIRECT]
            if direct:
                raise Conflict(f"vRNIC(s) {', '.join(direct)} use the direct engine, which VMs cannot: QEMU cannot "
                               f"map rxe's kernel queues into guest memory (VMs keep the ring engine)",
                               current_state="direct")
            memory = GuestMemory.from_vm_ram(Path(binding.ram_path), binding.machine)
            state = _BoundVm(binding, memory)
            try:
                for vrnic in vrnics:
                    self.registry.bind_vm(vrnic, binding.domain)
                    state.vrnics.append(vrnic)
                for vrnic, wanted in zip(vrnics, binding.vrnics, strict=True):
                    sock = connect_channel(Path(wanted.channel_socket))
                    cred = PeerCred(*peer_cred(sock))
                    state.links.append(VmLink(binding.domain, vrnic.spec.id, sock,
                                              functools.partial(self._open_vm_session, vrnic, binding, cred)))
            except BaseException:
                self._release(state)
                raise
            for link in state.links:
                link.start()
            self._vms[binding.domain] = state
        log.info("VM %s bound: vRNIC(s) %s, RAM %s (%d MiB)", binding.domain,
                 ", ".join(v.vrnic_id for v in binding.vrnics), binding.ram_path, memory.size >> 20)

    def _open_vm_session(self, vrnic: VirtualRnic, binding: VmBinding, cred: PeerCred, args: VmAttach,
                         disconnect: Disconnect) -> GuestSession:
        memory = GuestMemory.from_vm_ram(Path(binding.ram_path), binding.machine)
        try:
            doorbell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            memory.close()
            raise
        return self._compose(vrnic, memory, cred, doorbell, None, args.busy_poll, disconnect,
                             vm_domain=binding.domain)

    def unbind_vm(self, domain: str) -> list[str]:
        with self._vm_lock:
            return self._unbind(domain)

    def _unbind(self, domain: str) -> list[str]:
        state = self._vms.pop(domain, None)
        if state is None:
            return []
        self._release(state)
        log.info("VM %s unbound: every kernel object of its vRNIC(s) released", domain)
        return [v.vrnic_id for v in state.binding.vrnics]

    def _release(self, state: _BoundVm) -> None:
        if state.migration is not None and state.migration.phase is not MigrationPhase.DONE:
            for m in state.migration.moving:
                vm_migration.unstage(m, self.registry)
            for link in state.migration.links:
                link.close()
            state.migration.memory.close()
            state.migration = None
        for link in state.links:
            link.close()
        for vrnic in state.vrnics:
            self.registry.unbind_vm(vrnic, state.binding.domain)
        state.memory.close()

    # ----- live migration of a bound VM between two QEMU processes (vrnic.backend.vm_migration) -----------
    def prepare_vm_migration(self, domain: str, target: VmBinding) -> dict[str, object]:
        """The destination QEMU runs (paused, incoming): map its RAM, connect its channels, start the dirty
        log and pre-register the MRs there. The VM keeps running on the source, served as before."""
        t0 = time.perf_counter()
        with self._vm_lock:
            bound = self._vms.get(domain)
            if bound is None:
                raise NotFound(f"VM {domain} is not bound to vrnicd here")
            if bound.migration is not None:
                raise Conflict(f"VM {domain} is already migrating", current_state="migrating")
            if target.domain != domain:
                raise InvalidArgument(f"the destination binding names domain {target.domain}, not {domain}")
            if [v.vrnic_id for v in target.vrnics] != [v.vrnic_id for v in bound.binding.vrnics]:
                raise InvalidArgument(f"the destination must carry the same vRNICs as the source "
                                      f"({', '.join(v.vrnic_id for v in bound.binding.vrnics)})")
            if target.ram_path == bound.binding.ram_path:
                raise InvalidArgument("the destination's RAM file is the source's; a migration needs its own")
            memory = GuestMemory.from_vm_ram(Path(target.ram_path), target.machine)
            links: list[VmLink] = []
            moving: list[vm_migration.MovingVrnic] = []
            try:
                if memory.size != bound.memory.size:
                    raise InvalidArgument(f"the destination has {memory.size >> 20} MiB of RAM, the source "
                                          f"{bound.memory.size >> 20} MiB")
                for vrnic, wanted in zip(bound.vrnics, target.vrnics, strict=True):
                    sock = connect_channel(Path(wanted.channel_socket))
                    cred = PeerCred(*peer_cred(sock))
                    link = VmLink(domain, vrnic.spec.id, sock,
                                  functools.partial(self._open_vm_session, vrnic, target, cred))
                    links.append(link)
                    source = vrnic.session
                    if isinstance(source, GuestSession):
                        moving.append(vm_migration.stage(
                            vrnic, source, functools.partial(self._staged_session, vrnic, target, cred, link),
                            self.registry))
                for link in links:
                    link.start()
            except BaseException:
                for m in moving:
                    vm_migration.unstage(m, self.registry)
                for link in links:
                    link.close()
                memory.close()
                raise
            migration = vm_migration.Migration(domain, memory, links, moving)
            migration.presetup_mrs = sum(len(m.staged.state.mrs) for m in moving)
            migration.prepare_ms = (time.perf_counter() - t0) * 1000
            bound.migration = migration
            bound.target = target
        log.info("VM %s: migration prepared to %s in %.0f ms (%d vRNIC(s) moving, %d MR(s) pre-registered)", domain,
                 target.ram_path, migration.prepare_ms, len(moving), migration.presetup_mrs)
        return {"domain": domain, "phase": str(migration.phase), "moving": [m.vrnic.spec.id for m in moving],
                "presetup_mrs": migration.presetup_mrs, "prepare_ms": migration.prepare_ms}

    def _staged_session(self, vrnic: VirtualRnic, target: VmBinding, cred: PeerCred, link: VmLink) -> GuestSession:
        memory = GuestMemory.from_vm_ram(Path(target.ram_path), target.machine)
        device: DeviceContext | None = None
        doorbell = -1
        try:
            device = self.edge.open(vrnic.device)
            doorbell = vm_migration.new_doorbell()
            source = vrnic.session
            busy = bool(getattr(getattr(source, "engine", None), "busy_poll", False))
            return GuestSession(vrnic, self.registry, device, memory, cred, doorbell_fd=doorbell, notify_fd=None,
                                engine_factory=functools.partial(SharedRingEngine, busy_poll=busy),
                                disconnect=link.session_failed, guard=self.guard,
                                qos=self._shapers.get(vrnic.device), cm=self.cm,
                                qos_drain_kbit=functools.partial(self._qos_drain_kbit, vrnic.device, vrnic.spec.id),
                                give_back_device=functools.partial(self.idle_contexts.give_back, vrnic))
        except BaseException:
            if device is not None:
                device.close()
            if doorbell >= 0:
                os.close(doorbell)
            memory.close()
            raise

    def complete_vm_migration(self, domain: str) -> dict[str, object]:
        """QEMU's last pass is done and the destination has not run yet: switch the vRNICs over. On failure
        the source keeps serving the VM (the caller resumes it there and aborts)."""
        with self._vm_lock:
            bound = self._vms.get(domain)
            if bound is None or bound.migration is None or bound.target is None:
                raise Conflict(f"VM {domain} has no migration prepared", current_state="bound")
            migration, target = bound.migration, bound.target
            report = vm_migration.switchover(migration, bound.memory, self.registry)
            vm_migration.finish(migration, report, self.registry)
            # Nothing of the VM stays on the source: its sessions (kernel objects), links and RAM mapping.
            for m in migration.moving:
                m.source.close()
            for link in bound.links:
                stale = link.give_up_session()
                if stale is not None and stale not in [m.source for m in migration.moving]:
                    stale.close()
                link.close()
            bound.memory.close()
            bound.binding, bound.memory, bound.links = target, migration.memory, migration.links
            bound.migration = bound.target = None
        result = asdict(report)
        log.info("VM %s: switched over to %s in %.1f ms (%s)", domain, target.ram_path, report.total_ms, result)
        return result

    def abort_vm_migration(self, domain: str) -> bool:
        """Drop a prepared (or failed) migration; the source keeps serving the VM. False if there was none."""
        with self._vm_lock:
            bound = self._vms.get(domain)
            if bound is None or bound.migration is None:
                return False
            migration = bound.migration
            if migration.phase is MigrationPhase.DONE:
                raise Conflict(f"VM {domain} has already switched over", current_state="migrated")
            for m in migration.moving:
                m.source.release()
                vm_migration.unstage(m, self.registry)
            for link in migration.links:
                link.close()
            migration.memory.close()
            bound.migration = bound.target = None
        log.info("VM %s: migration aborted; the source keeps serving it", domain)
        return True

    # ----- a VM moving to or from another host (vrnic.backend.vm_handover, vrnic.core.handover) -------------
    def prepare_vm_handover(self, domain: str, target: VmBinding, destination: vm_handover.HandoverDestination,
                            peer_host_of: Callable[[Any], vm_handover.PeerHost]) -> dict[str, object]:
        """The VM's destination QEMU runs on another host (paused, incoming): start the dirty logs here and on
        every host with a peer of it, and have the destination's vrnicd pre-set-up the vRNICs. The VM keeps
        running here, served as before."""
        with self._vm_lock:
            bound = self._vms.get(domain)
            if bound is None:
                raise NotFound(f"VM {domain} is not bound to vrnicd here")
            if bound.migration is not None or bound.handover is not None:
                raise Conflict(f"VM {domain} is already migrating", current_state="migrating")
            if target.domain != domain:
                raise InvalidArgument(f"the destination binding names domain {target.domain}, not {domain}")
            if [v.vrnic_id for v in target.vrnics] != [v.vrnic_id for v in bound.binding.vrnics]:
                raise InvalidArgument(f"the destination must carry the same vRNICs as the source "
                                      f"({', '.join(v.vrnic_id for v in bound.binding.vrnics)})")
            handover = vm_handover.prepare(domain, target, bound.vrnics, self.registry, destination, self.peers,
                                           peer_host_of)
            bound.handover = handover
            for link in bound.links:
                link.keep_session_at_eof = True  # libvirt's migration may end this QEMU before the switchover
        log.info("VM %s: hand-over to another host prepared in %.0f ms (%d peer host(s))", domain,
                 handover.prepare_ms, len(handover.peer_hosts))
        return {"domain": domain, "phase": str(handover.phase), "moving": [m.vrnic.spec.id for m in handover.leaving],
                "peer_hosts": len(handover.peer_hosts), "prepare_ms": handover.prepare_ms, **handover.accepted}

    def complete_vm_handover(self, domain: str, record_move: Callable[[], None]) -> dict[str, object]:
        """QEMU's last pass is done, the destination has not run yet: hand the vRNICs over. record_move tells the
        control plane the vRNICs' new host (before any peer asks again). On an error before the hand-over the
        VM's vRNICs stay served here (the caller resumes it here)."""
        with self._vm_lock:
            bound = self._vms.get(domain)
            if bound is None or bound.handover is None:
                raise Conflict(f"VM {domain} has no hand-over prepared", current_state="bound")
            handover = bound.handover

            def leave() -> None:
                """Nothing of the VM stays here: sessions (kernel objects), links, RAM mapping, the vRNICs."""
                for m in handover.leaving:
                    m.source.close()
                self._vms.pop(domain, None)
                self._release(bound)
                for m in handover.leaving:
                    self._forget_vrnic(m.vrnic.spec.id)

            try:
                report = vm_handover.switchover(handover, bound.memory, self.registry, record_move, leave)
            finally:
                if handover.phase is HandoverPhase.ABORTED:
                    _handover_off(bound)
        result = vm_handover.report_dict(report)
        log.info("VM %s: handed over to another host in %.1f ms (%s)", domain, report.total_ms, result)
        return result

    def abort_vm_handover(self, domain: str) -> bool:
        with self._vm_lock:
            bound = self._vms.get(domain)
            if bound is None or bound.handover is None:
                return False
            vm_handover.abort(bound.handover, self.registry)
            _handover_off(bound)
        log.info("VM %s: hand-over aborted; this host keeps serving it", domain)
        return True

    def _forget_vrnic(self, vrnic_id: str) -> None:
        """A vRNIC that now lives on another host: out of the registry and of its device's QoS."""
        vrnic = self.registry.remove(vrnic_id)
        self.idle_contexts.drop(vrnic_id)
        with self._qos_lock:
            shaper = self._shapers.get(vrnic.device)
            if shaper is not None:
                shaper.forget(vrnic_id)
            self._qos_refresh(vrnic.device)

    # the destination's side
    def accept_handover(self, domain: str, specs: list[VrnicSpec], binding: VmBinding,
                        snapshots: dict[str, SessionSnapshot], device: str | None = None) -> dict[str, Any]:
        """A VM is coming from another host: map its destination RAM, connect its channels, and pre-set-up each
        vRNIC's session (PDs, MRs over this RAM, CQs, QPs held in RESET, with the same handles and virtual
        QPNs). The vRNICs join the registry only at take-over: until then peers here still find them remote."""
        with self._vm_lock:
            if domain in self._vms or domain in self._incoming:
                raise Conflict(f"VM {domain} is already served or expected here", current_state="bound")
            if [s.id for s in specs] != [v.vrnic_id for v in binding.vrnics]:
                raise InvalidArgument("the binding must carry the handed-over vRNICs, in order")
            here = [s.id for s in specs if s.id in self.registry.ids()]
            if here:
                raise Conflict(f"vRNIC(s) {', '.join(here)} exist here already", current_state="exists")
            name = device or next((d.name for d in self.devices()), None)
            if name is None:
                raise Conflict("this vrnicd serves no device", current_state="no_device")
            info = self.edge.describe(name)  # NotFound for an unknown device; read once for every vRNIC
            memory = GuestMemory.from_vm_ram(Path(binding.ram_path), binding.machine)
            incoming = _Incoming(binding, memory)
            try:
                for spec, wanted in zip(specs, binding.vrnics, strict=True):
                    snapshot = snapshots[spec.id]
                    if snapshot.memory_bytes != memory.size:
                        raise InvalidArgument(f"the VM has {snapshot.memory_bytes >> 20} MiB of RAM, the "
                                              f"destination's RAM file {memory.size >> 20} MiB")
                    # A VM attaches by its channel, never by token: the handed-over vRNIC gets an unusable one.
                    vrnic = self._make_vrnic(spec, name, token_digest(secrets.token_urlsafe(24)), info)
                    vrnic.vm_domain = domain
                    incoming.vrnics.append(vrnic)
                    sock = connect_channel(Path(wanted.channel_socket))
                    cred = PeerCred(*peer_cred(sock))
                    link = VmLink(domain, spec.id, sock, functools.partial(self._open_vm_session, vrnic, binding, cred))
                    incoming.links.append(link)
                    staged = self._staged_session(vrnic, binding, cred, link)
                    staged.staged = True
                    incoming.staged.append(staged)
                    staged.converge(snapshot)
                for link in incoming.links:
                    link.start()
            except BaseException:
                incoming.close()
                raise
            self._incoming[domain] = incoming
        return {"device": name, "presetup_mrs": sum(len(s.state.mrs) for s in incoming.staged),
                "phys_gid": {v.spec.id: v.phys_gid for v in incoming.vrnics},
                "qpns": {v.spec.id: {str(q.vqpn): q.phys_qpn for _, q in s.state.qps.items()}
                         for v, s in zip(incoming.vrnics, incoming.staged, strict=True)}}

    def handover_preconnect(self, domain: str, vrnic_id: str, wires: list[dict[str, Any]]) -> int:
        """Connect staged QPs ahead to their peers' second QPs (vrnic.backend.peer_service.PeerService.shadows);
        at the take-over those only get their work requests. Returns how many were connected."""
        with self._vm_lock:
            incoming = self._incoming_vm(domain)
            staged = next((s for v, s in zip(incoming.vrnics, incoming.staged, strict=True) if v.spec.id == vrnic_id),
                          None)
            if staged is None:
                raise NotFound(f"no vRNIC {vrnic_id} is coming with VM {domain}")
            ready = incoming.ready.setdefault(vrnic_id, {})
            for w in wires:
                handle = int(w["handle"])
                staged.preconnect(handle, str(w["peer_id"]), str(w["peer_gid"]), int(w["peer_vqpn"]),
                                  str(w["peer_phys_gid"]), int(w["dest_qpn"]), int(w["access"]), int(w["qkey"]),
                                  {str(k): int(v) for k, v in dict(w["link"]).items()})
                ready[handle] = (str(w["peer_gid"]), int(w["peer_vqpn"]))
            return len(wires)

    def _incoming_vm(self, domain: str) -> _Incoming:
        incoming = self._incoming.get(domain)
        if incoming is None:
            raise Conflict(f"no VM {domain} is coming to this host", current_state="idle")
        return incoming

    def handover_pages(self, domain: str, runs: list[tuple[int, bytes]]) -> int:
        with self._vm_lock:
            return vm_handover.write_runs(self._incoming_vm(domain).memory, runs)

    def handover_take_over(self, domain: str, snapshots: dict[str, SessionSnapshot],
                           carried: dict[str, list[QpCarry]],
                           live_peers: dict[str, list[int]] | None = None) -> dict[str, Any]:
        """The source stopped: its objects as they are now, connected to the peers' physical QPs, the carried
        receives posted and sends queued; then the vRNICs are published here. Their QPs stay held. live_peers:
        per vRNIC, the QPs (virtual QPNs) whose peers the source found held and alive; a pre-connected QP not
        named there is kept only if its peer is still found. Answers with what is published ("published"), so
        that the peers' hosts need not look it up."""
        result: dict[str, Any] = {"qps": 0, "recvs_reposted": 0, "sends_carried": 0, "broken_qps": 0,
                                  "mrs_presetup": 0, "mrs_registered": 0, "preconnected": 0}
        steps = {"converge_ms": 0.0, "peers_ms": 0.0, "continue_ms": 0.0, "publish_ms": 0.0}
        with self._vm_lock:
            incoming = self._incoming_vm(domain)
            for vrnic, staged in zip(incoming.vrnics, incoming.staged, strict=True):
                t0 = time.perf_counter()
                kept, added = staged.converge(snapshots[vrnic.spec.id])
                t1 = time.perf_counter()
                wired = incoming.ready.get(vrnic.spec.id, {})
                held = frozenset((live_peers or {}).get(vrnic.spec.id, ()))
                ready = frozenset(c.handle for c in carried[vrnic.spec.id]
                                  if c.state == "rts" and wired.get(c.handle) == (c.peer_gid, c.peer_vqpn)
                                  and (qp := staged.state.qps.get(c.handle)).state == "rts"
                                  and (qp.vqpn in held or self._peer_alive(vrnic, c.peer_gid, c.peer_vqpn)))
                t2 = time.perf_counter()
                reposted, sends, broken = staged.continue_qps(carried[vrnic.spec.id], ready)
                steps["converge_ms"] += (t1 - t0) * 1000
                steps["peers_ms"] += (t2 - t1) * 1000
                steps["continue_ms"] += (time.perf_counter() - t2) * 1000
                result["preconnected"] += len(ready)
                result["qps"] += len(staged.state.qps)
                result["mrs_presetup"] += kept
                result["mrs_registered"] += added
                result["recvs_reposted"] += reposted
                result["sends_carried"] += sends
                result["broken_qps"] += broken
            t3 = time.perf_counter()
            published: dict[str, Any] = {}
            for vrnic, staged in zip(incoming.vrnics, incoming.staged, strict=True):
                self._admit(vrnic, ready_context=False)  # its staged session has one; the VM is paused here
                incoming.admitted.append(vrnic)
                qpns, mrs = staged.publications()
                self.registry.adopt(vrnic, staged, domain, qpns, mrs)
                published[vrnic.spec.id] = {"phys_gid": vrnic.phys_gid, "qpns": {str(v): p for v, p in qpns.items()},
                                            "windows": [MrWindowWire.of(w).model_dump() for w in mrs.values()]}
            steps["publish_ms"] = (time.perf_counter() - t3) * 1000
        result["steps"] = steps
        result["published"] = published
        return result

    def _peer_alive(self, vrnic: VirtualRnic, gid: str | None, vqpn: int | None) -> bool:
        """Is a pre-connected QP's peer still there (a peer gone since prepare leaves the QP to break)?"""
        if gid is None or vqpn is None:
            return False
        try:
            self.registry.peer_qp(vrnic, gid, vqpn, via="migration")
        except VrnicError:
            return False
        return True

    def handover_release(self, domain: str) -> None:
        """The peers point at this host's QPs now: serve the VM here."""
        with self._vm_lock:
            incoming = self._incoming.pop(domain)
            for link, staged in zip(incoming.links, incoming.staged, strict=True):
                staged.staged = False
                link.adopt(staged)
                staged.start()
                staged.release()
            self._vms[domain] = _BoundVm(incoming.binding, incoming.memory, list(incoming.vrnics),
                                         list(incoming.links))
        log.info("VM %s: arrived from another host; serving vRNIC(s) %s", domain,
                 ", ".join(v.spec.id for v in incoming.vrnics))

    def handover_abort(self, domain: str) -> None:
        with self._vm_lock:
            incoming = self._incoming.pop(domain, None)
            if incoming is None:
                return
            for vrnic in incoming.admitted:
                with contextlib.suppress(NotFound):
                    self._forget_vrnic(vrnic.spec.id)
            incoming.close()
        log.info("VM %s: hand-over called off; nothing of it is left here", domain)

    def vm_bindings(self) -> dict[str, VmBinding]:
        with self._vm_lock:
            return {name: state.binding for name, state in self._vms.items()}

    def reissue_token(self, vrnic_id: str) -> str:
        return self.registry.reissue_token(vrnic_id)

    def release_vrnic(self, vrnic_id: str) -> None:
        with self._vm_lock:  # a VM using it loses its vRNIC service now; the hook's unbind finds nothing
            for domain, state in list(self._vms.items()):
                if any(v.vrnic_id == vrnic_id for v in state.binding.vrnics):
                    self._unbind(domain)
        vrnic = self.registry.remove(vrnic_id)
        session = vrnic.session
        if session is not None:
            session.close()
        self.idle_contexts.drop(vrnic_id)  # after the removal: a session closing meanwhile keeps nothing
        with self._qos_lock:
            shaper = self._shapers.get(vrnic.device)
            if shaper is not None:
                shaper.forget(vrnic_id)
            self._qos_refresh(vrnic.device)
        log.info("vRNIC %s released", vrnic_id)

    # ----- QoS (vrnic.core.qos, vrnic.backend.qos_shaper) -------------------------------------------------
    def _sweep_qos(self) -> None:
        """At start nothing is wanted yet: QoS an earlier vrnicd left on the uplinks goes (set difference)."""
        for info in self.devices():
            if info.caps.get("qos_shaping"):
                try:
                    shaper = HtbShaper(uplink_netdev(info.name))
                    shaper.sweep()
                    shaper.close()
                except VrnicError as exc:
                    log.warning("could not check %s for QoS left behind: %s", info.name, exc)

    def _admit_qos(self, vrnic_id: str, device: str, policy: QosPolicy) -> None:
        """Refuse a policy the device's mechanism cannot enforce, or that its link cannot give. The device is
        described only for a policy with limits: each description opens a device context (issue 14)."""
        if not policy.limits:
            return
        if not self.edge.describe(device).caps.get("qos_shaping"):
            raise NotSupported(f"{device} has no QoS mechanism in vrnic (its RoCE traffic does not cross a netdev "
                               f"vrnicd can shape); a cap, guarantee or weight cannot be enforced there")
        shaper = self._shapers.get(device)
        link = shaper.link_mbps if shaper is not None else (link_speed_mbps(uplink_netdev(device))
                                                             or self.qos_link_mbps)
        on_device = self.registry.all_on(device)
        admit(link, [v.spec.qos for v in on_device if v.spec.id != vrnic_id], policy)
        if link is not None:
            self._refuse_outlasted_rc_timeouts(link, on_device,
                                               {v.spec.id: v.spec.qos for v in on_device} | {vrnic_id: policy})

    def _refuse_outlasted_rc_timeouts(self, link_mbps: int, on_device: list[VirtualRnic],
                                      policies: dict[str, QosPolicy]) -> None:
        """Refuse policies that would drain a vRNIC's class so slowly that its connected RC QPs time out while
        their packets wait in its queue: rxe then breaks them (vrnic.core.qos). A QP's timeout was raised at
        RTS for its class's rate then, and RTS cannot change it; a QP connected after the change gets its own."""
        for vrnic in on_device:
            session = vrnic.session
            if not isinstance(session, GuestSession):
                continue
            drain = drain_kbit(link_mbps, policies, vrnic.spec.id)
            outlasted = session.rc_timeouts_outlasted(drain)
            if outlasted:
                vqpn, timeout, wait_s = outlasted[0]
                raise Conflict(
                    f"vRNIC {vrnic.spec.id}'s QoS class would drain at {drain} kbit/s, where the packets its "
                    f"{len(outlasted)} connected RC QP(s) keep in flight wait {wait_s * 1000:.0f} ms, longer than "
                    f"their RC timeout (QP {vqpn}: {timeout}, {rc_timeout_s(timeout) * 1000:.0f} ms); "
                    f"rxe would break them. Set the policy before they connect, connect them with a longer "
                    f"timeout, or reconnect them after", current_state="rc_timeout_too_short")

    def _qos_drain_kbit(self, device: str, vrnic_id: str) -> int | None:
        """The rate the vRNIC's class on the device drains at, with every vRNIC there shaped as it asks (as
        they are once any asks; it may not yet); None if the device cannot shape or has no known link speed.
        Takes no QoS lock: a session asks under its own lock, and _qos_refresh takes them the other way."""
        if device not in self._can_shape:
            self._can_shape[device] = bool(self.edge.describe(device).caps.get("qos_shaping"))
        if not self._can_shape[device]:
            return None
        shaper = self._shapers.get(device)
        link = shaper.link_mbps if shaper is not None else self._unshaped_link_mbps(device)
        if link is None:
            return None
        # Every RTS asks, and planning the classes is most of a connect's Python under TCG: the plan is kept
        # while the link and the policies on the device are the same. While no vRNIC's spec and no membership
        # changed (ChangeMark, read before the walk), that costs no walk; after a change, a walk over the device's
        # vRNICs, and a new plan only if a policy differs (the tuple compares objects by identity first).
        mark = ChangeMark.current
        kept = self._drain_plans.get(device)
        if kept is None or kept.mark != mark or kept.link != link:
            policies = tuple((v.spec.id, v.spec.qos) for v in self.registry.all_on(device))
            if kept is not None and (kept.link, kept.policies) == (link, policies):
                rates = kept.rates  # a spec changed, but no policy on this device
            else:
                rates = drain_rates(link, dict(policies))
            kept = self._drain_plans[device] = _DrainPlan(mark, link, policies, rates)
        rate = kept.rates.get(vrnic_id)
        return rate if rate is not None else drain_kbit(link, dict(kept.policies), vrnic_id)

    def _unshaped_link_mbps(self, device: str) -> int | None:
        """The device's uplink speed (sysfs, else the operator's figure; None without either or without an uplink),
        read once per device."""
        if device not in self._unshaped_link:
            try:
                self._unshaped_link[device] = link_speed_mbps(uplink_netdev(device)) or self.qos_link_mbps
            except NotSupported:
                self._unshaped_link[device] = None
        return self._unshaped_link[device]

    def _qos_refresh(self, device: str) -> None:
        """QoS is on for a device while any vRNIC on it asks for it; then every vRNIC on it has a class, and
        every connected QP of theirs is classified (unclassified traffic would take the guarantees)."""
        on_device = self.registry.all_on(device)
        wanted = any(v.spec.qos.limits for v in on_device)
        shaper = self._shapers.get(device)
        if wanted:
            if shaper is None:
                shaper = self._shapers[device] = HtbShaper(uplink_netdev(device), link_mbps=self.qos_link_mbps)
            for vrnic in on_device:
                shaper.set_policy(vrnic.spec.id, vrnic.spec.qos)
        elif shaper is None:
            return
        for vrnic in on_device:
            session = vrnic.session
            if isinstance(session, GuestSession):
                session.use_qos(shaper if wanted else None)
        if not wanted and shaper is not None:
            shaper.close()
            del self._shapers[device]

    def set_qos(self, vrnic_id: str, policy: QosPolicy) -> None:
        """Change a live vRNIC's QoS: its class changes in place, its QPs stay connected."""
        vrnic = self.registry.get(vrnic_id)
        with self._qos_lock:
            self._admit_qos(vrnic_id, vrnic.device, policy)
            previous = vrnic.spec
            vrnic.spec = previous.model_copy(update={"qos": policy})
            try:
                self._qos_refresh(vrnic.device)
            except BaseException:
                vrnic.spec = previous
                self._qos_refresh(vrnic.device)
                raise
        log.info("vRNIC %s: QoS now %s", vrnic_id, policy.model_dump())

    def qos_counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each shaped vRNIC sent and received, as the kernel counted them."""
        with self._qos_lock:
            counted: dict[str, dict[str, int]] = {}
            for shaper in self._shapers.values():
                received = shaper.received()
                for i, c in shaper.counters().items():
                    rx = received.get(i)
                    counted[i] = {"tx_bytes": c.bytes, "tx_packets": c.packets,
                                  "rx_bytes": rx.bytes if rx else 0, "rx_packets": rx.packets if rx else 0}
            return counted

    def reconcile_qos(self) -> int:
        """Put back what drifted (a class or filter removed or changed behind vrnicd); how many fixes."""
        fixed = 0
        with self._qos_lock:
            for shaper in self._shapers.values():
                fixed += shaper.reconcile().fixes
        return fixed

    def vrnic_ids(self) -> set[str]:
        return self.registry.ids()

    def attached_ids(self) -> set[str]:
        return self.registry.attached_ids()

    def load(self, device: str) -> int:
        return self.registry.on_device(device)

    def close(self) -> None:
        with self._vm_lock:
            for domain in list(self._vms):
                self._unbind(domain)
            for incoming in self._incoming.values():
                incoming.close()
            self._incoming.clear()
        super().close()
        self.server.stop()
        self.idle_contexts.close()
        with self._qos_lock:
            for shaper in self._shapers.values():
                shaper.close()
            self._shapers.clear()
        if self.guard is not None:
            self.guard.close()
        if self._own_directory is not None:
            self._own_directory.close()


@dataclass
class GuestContainment:
    """What vrnicd limited for a direct-engine guest; release() puts both limits back."""

    cgroup: Confinement
    pid: int
    memlock: tuple[int, int]  # the guest's RLIMIT_MEMLOCK before (soft, hard)

    def release(self) -> None:
        from vrnic.backend.rdma_cgroup import restore_memlock

        try:
            self.cgroup.release()
        finally:
            restore_memlock(self.pid, self.memlock)


@dataclass
class _BoundVm:
    binding: VmBinding
    memory: GuestMemory  # held while the VM is bound: its RAM stays mapped and checked
    vrnics: list[VirtualRnic] = field(default_factory=list)
    links: list[VmLink] = field(default_factory=list)
    migration: vm_migration.Migration | None = None
    target: VmBinding | None = None  # where the migration goes
    handover: vm_handover.Handover | None = None  # to another host


def _handover_off(bound: _BoundVm) -> None:
    """The hand-over was called off: this host serves the VM on, unless its QEMU ended meanwhile."""
    bound.handover = None
    for link in bound.links:
        link.keep_session_at_eof = False
        if link.qemu_gone:
            link.close()  # nobody runs the VM here any more: its session's kernel objects go


@dataclass
class _Incoming:
    """A VM on its way here from another host: its RAM, channels and staged sessions, not yet serving."""

    binding: VmBinding
    memory: GuestMemory
    vrnics: list[VirtualRnic] = field(default_factory=list)
    links: list[VmLink] = field(default_factory=list)
    staged: list[GuestSession] = field(default_factory=list)
    admitted: list[VirtualRnic] = field(default_factory=list)
    ready: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)  # pre-connected QPs: their peer

    def close(self) -> None:
        for session in self.staged:
            session.close()
        for link in self.links:
            link.close()
        self.memory.close()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
