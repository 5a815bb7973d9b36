"""The `verbs` driver: paravirtual vRNICs on any verbs device (rxe, or a real RNIC).

Each vRNIC gets its own verbs context when its guest attaches through the
frontend channel; the driver holds the registry and serves that channel.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import ClassVar

from vrnic.backend.channel import ChannelServer
from vrnic.backend.driver import RnicDriver
from vrnic.backend.pyverbs_edge import describe, device_names, roce_v2_ipv4_gid
from vrnic.backend.registry import Registry, VirtualRnic
from vrnic.core.specs import AttachInfo, DeviceInfo, VrnicMode, VrnicSpec
from vrnic.errors import DeviceError

log = logging.getLogger(__name__)
DEFAULT_SOCKET = Path("/run/vrnic/vrnicd.sock")


class VerbsDriver(RnicDriver):
    name: ClassVar[str] = "verbs"
    modes: ClassVar[frozenset[VrnicMode]] = frozenset({VrnicMode.PARAVIRTUAL})

    def __init__(self, socket_path: Path | str = DEFAULT_SOCKET, devices: list[str] | None = None) -> None:
        self.socket_path = Path(socket_path)
        self._only = devices
        self.registry = Registry()
        self.server = ChannelServer(self.socket_path, self.registry)
        self.server.start()

    def devices(self) -> list[DeviceInfo]:
        names = [n for n in device_names() if self._only is None or n in self._only]
        return [describe(n) for n in names]

    def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
        info = describe(device)  # NotFound for an unknown device
        if not info.ports or info.ports[0].state != "ACTIVE":
            raise DeviceError(f"{device} port 1 is not ACTIVE")
        gid_index, phys_gid = roce_v2_ipv4_gid(info)
        vrnic = VirtualRnic(spec=spec, device=device, token=secrets.token_urlsafe(24), phys_gid=phys_gid,
                            gid_index=gid_index)
        self.registry.add(vrnic)
        log.info("vRNIC %s (tenant %s) created on %s", spec.id, spec.tenant, device)
        return AttachInfo(vrnic_id=spec.id, mode=spec.mode, device=device, virtual_gid=spec.virtual_gid,
                          socket_path=str(self.socket_path), token=vrnic.token)

    def release_vrnic(self, vrnic_id: str) -> None:
        vrnic = self.registry.remove(vrnic_id)
        session = vrnic.session
        if session is not None:
            session.close()
            vrnic.session = None
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
