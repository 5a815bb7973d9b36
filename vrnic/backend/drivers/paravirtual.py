"""The `verbs` driver: paravirtual vRNICs on any verbs device (rxe, or a real RNIC).

Each vRNIC gets its own device context when its guest attaches through the
frontend channel. The driver holds the registry, serves the channel, and
composes each session from its parts: guest memory, a device context from the
RNIC edge, and a data-path engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import ClassVar

from vrnic.backend.attachment import Disconnect, PeerCred
from vrnic.backend.channel import ChannelLimits, ChannelServer
from vrnic.backend.driver import RnicDriver
from vrnic.backend.engine import EngineHost, SharedRingEngine
from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.registry import Registry, VirtualRnic
from vrnic.backend.rnic_edge import DeviceContext, RnicEdge
from vrnic.backend.session import GuestSession
from vrnic.core.specs import AttachInfo, DeviceInfo, VrnicMode, VrnicSpec, active_roce_v2_gid
from vrnic.core.verb_args import Attach
from vrnic.errors import Conflict

log = logging.getLogger(__name__)
DEFAULT_SOCKET = Path("/run/vrnic/vrnicd.sock")


class VerbsDriver(RnicDriver):
    name: ClassVar[str] = "verbs"
    modes: ClassVar[frozenset[VrnicMode]] = frozenset({VrnicMode.PARAVIRTUAL})

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET, devices: list[str] | None = None,
                 edge: RnicEdge | None = None, channel: ChannelLimits | None = None) -> None:
        if edge is None:
            from vrnic.backend.pyverbs_edge import PyverbsEdge  # pyverbs only where a real device is used

            edge = PyverbsEdge()
        self.edge = edge
        self.socket_path = Path(socket_path)
        self._only = devices
        self.registry = Registry()
        self.server = ChannelServer(self.socket_path, self.open_session, channel)
        self.server.start()

    def devices(self) -> list[DeviceInfo]:
        names = [n for n in self.edge.device_names() if self._only is None or n in self._only]
        return [self.edge.describe(n) for n in names]

    def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
        gid_index, phys_gid = active_roce_v2_gid(self.edge.describe(device))  # NotFound for an unknown device
        vrnic = VirtualRnic(spec=spec, device=device, token=secrets.token_urlsafe(24), phys_gid=phys_gid,
                            gid_index=gid_index)
        self.registry.add(vrnic)
        log.info("vRNIC %s (tenant %s) created on %s", spec.id, spec.tenant, device)
        return AttachInfo(vrnic_id=spec.id, mode=spec.mode, device=device, virtual_gid=spec.virtual_gid,
                          socket_path=str(self.socket_path), token=vrnic.token)

    def open_session(self, args: Attach, fds: list[int], cred: PeerCred,
                     disconnect: Disconnect = lambda: None) -> GuestSession:
        """The channel's SessionOpener: memory, device context, engine; all released again on failure."""
        memory: GuestMemory | None = None
        device: DeviceContext | None = None
        session: GuestSession | None = None
        try:
            vrnic = self.registry.by_token(args.token)
            if vrnic.session is not None:  # checked again, atomically, by registry.attach
                raise Conflict(f"vRNIC {vrnic.spec.id} already has a guest attached", current_state="attached")
            memory = GuestMemory(fds[0])
            device = self.edge.open(vrnic.device)

            def engine(host: EngineHost) -> SharedRingEngine:
                return SharedRingEngine(host, busy_poll=args.busy_poll)

            session = GuestSession(vrnic, self.registry, device, memory, cred, doorbell_fd=fds[1],
                                   notify_fd=fds[2] if len(fds) > 2 else None, engine_factory=engine,
                                   disconnect=disconnect)
            self.registry.attach(vrnic, session)
        except BaseException:
            if session is not None:
                session.close()  # closes memory, device and the fds it took
            else:
                if device is not None:
                    device.close()
                if memory is not None:
                    memory.close()
                for fd in fds[0 if memory is None else 1:]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            raise
        session.start()
        return session

    def release_vrnic(self, vrnic_id: str) -> None:
        vrnic = self.registry.remove(vrnic_id)
        session = vrnic.session
        if session is not None:
            session.close()
        log.info("vRNIC %s released", vrnic_id)

    def vrnic_ids(self) -> set[str]:
        return self.registry.ids()

    def attached_ids(self) -> set[str]:
        return self.registry.attached_ids()

    def load(self, device: str) -> int:
        return self.registry.on_device(device)

    def close(self) -> None:
        super().close()
        self.server.stop()
