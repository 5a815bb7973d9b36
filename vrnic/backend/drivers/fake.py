"""The in-tree fake driver: pretend devices and vRNICs held in memory, no hardware.

For unit and API tests of the control plane and for measuring its own overhead.
It never stands in for the real test of a feature that touches RDMA.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import ClassVar

from vrnic.backend.driver import RnicDriver
from vrnic.core.migration import MigrationPhase, SwitchoverReport
from vrnic.core.recovery import token_digest, token_matches
from vrnic.core.specs import AttachInfo, DeviceInfo, PortInfo, QosPolicy, VmBinding, VrnicMode, VrnicSpec
from vrnic.errors import Conflict, InvalidArgument, NotFound


class FakeDriver(RnicDriver):
    name: ClassVar[str] = "fake"
    modes: ClassVar[frozenset[VrnicMode]] = frozenset({VrnicMode.PARAVIRTUAL})

    def __init__(self, device_count: int = 2, socket_path: str = "/run/vrnic/fake.sock",
                 create_delay_s: float = 0.0) -> None:
        """create_delay_s: how long each create_vrnic takes (tests: keeps an allocation in flight for that long,
        as a real driver's kernel work does; e.g. VRNIC_PARAVIRTUAL_DRIVER_OPTIONS='{"create_delay_s": 0.05}')."""
        if create_delay_s < 0:
            raise InvalidArgument(f"create_delay_s must be >= 0, not {create_delay_s}")
        self.create_delay_s = create_delay_s
        self._devices = [
            DeviceInfo(name=f"fake{i}", driver=self.name, node_guid=f"0200:00ff:fe00:{i:04x}",
                       ports=[PortInfo(port=1, state="ACTIVE", mtu=1024)],
                       caps={"max_qp": 1024, "max_cq": 1024, "max_mr": 4096, "max_pd": 256})
            for i in range(device_count)
        ]
        self._socket_path = socket_path
        self._vrnics: dict[str, str] = {}  # vrnic id -> device
        self._load: Counter[str] = Counter()  # device -> its vRNICs (placement asks on every create)
        self.token_hashes: dict[str, str] = {}  # vrnic id -> the digest of its attach token now
        self._attached: set[str] = set()  # what a real driver would observe: a guest holding a session
        self._vms: dict[str, VmBinding] = {}
        self._migrating: dict[str, VmBinding] = {}  # domain -> its destination binding
        self.qos: dict[str, QosPolicy] = {}  # live QoS changes, by vRNIC
        self._lock = threading.Lock()

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
        if device not in {d.name for d in self._devices}:
            raise NotFound(f"no device {device}")
        if self.create_delay_s:
            time.sleep(self.create_delay_s)
        with self._lock:
            if spec.id in self._vrnics:
                raise Conflict(f"vRNIC {spec.id} already exists in the backend")
            self._vrnics[spec.id] = device
            self._load[device] += 1
            token = secrets.token_urlsafe(24)
            self.token_hashes[spec.id] = token_digest(token)
        return AttachInfo(vrnic_id=spec.id, mode=spec.mode, device=device, virtual_gid=spec.virtual_gid,
                          socket_path=self._socket_path, token=token)

    def reissue_token(self, vrnic_id: str) -> str:
        with self._lock:
            if vrnic_id not in self._vrnics:
                raise NotFound(f"no vRNIC {vrnic_id} in the backend")
            token = secrets.token_urlsafe(24)
            self.token_hashes[vrnic_id] = token_digest(token)
        return token

    def restore_vrnic(self, spec: VrnicSpec, device: str, token_hash: str) -> None:
        with self._lock:
            if spec.id in self._vrnics:
                raise Conflict(f"vRNIC {spec.id} already exists in the backend")
            self._vrnics[spec.id] = device
            self._load[device] += 1
            self.token_hashes[spec.id] = token_hash

    def accepts_token(self, vrnic_id: str, token: str) -> bool:
        """Tests: would a guest presenting token attach to vrnic_id (what the verbs driver checks)."""
        with self._lock:
            digest = self.token_hashes.get(vrnic_id)
        return digest is not None and token_matches(token, digest)

    def release_vrnic(self, vrnic_id: str) -> None:
        with self._lock:
            device = self._vrnics.pop(vrnic_id, None)
            if device is None:
                raise NotFound(f"no vRNIC {vrnic_id} in the backend")
            self._load[device] -= 1
            self.token_hashes.pop(vrnic_id, None)
            self._attached.discard(vrnic_id)
            for domain, binding in list(self._vms.items()):
                if any(v.vrnic_id == vrnic_id for v in binding.vrnics):
                    del self._vms[domain]

    def vrnic_ids(self) -> set[str]:
        with self._lock:
            return set(self._vrnics)

    def attached_ids(self) -> set[str]:
        with self._lock:
            return set(self._attached)

    def guest_attached(self, vrnic_id: str) -> None:
        """Tests: a guest attached to the vRNIC (what the verbs driver sees as a session opening)."""
        with self._lock:
            if vrnic_id not in self._vrnics:
                raise NotFound(f"no vRNIC {vrnic_id} in the backend")
            self._attached.add(vrnic_id)

    def guest_detached(self, vrnic_id: str) -> None:
        """Tests: the guest went away."""
        with self._lock:
            self._attached.discard(vrnic_id)

    def bind_vm(self, binding: VmBinding) -> None:
        with self._lock:
            current = self._vms.get(binding.domain)
            if current == binding:
                return
            if current is not None:
                raise Conflict(f"domain {binding.domain} is already bound with other parameters")
            for v in binding.vrnics:
                if v.vrnic_id not in self._vrnics:
                    raise NotFound(f"no vRNIC {v.vrnic_id} in the backend")
                if v.vrnic_id in self._attached or any(v.vrnic_id in {x.vrnic_id for x in b.vrnics}
                                                        for b in self._vms.values()):
                    raise Conflict(f"vRNIC {v.vrnic_id} is attached elsewhere", current_state="attached")
            self._vms[binding.domain] = binding

    def unbind_vm(self, domain: str) -> list[str]:
        with self._lock:
            binding = self._vms.pop(domain, None)
        return [] if binding is None else [v.vrnic_id for v in binding.vrnics]

    def vm_bindings(self) -> dict[str, VmBinding]:
        with self._lock:
            return dict(self._vms)

    def prepare_vm_migration(self, domain: str, target: VmBinding) -> dict[str, object]:
        with self._lock:
            current = self._vms.get(domain)
            if current is None:
                raise NotFound(f"VM {domain} is not bound to vrnicd here")
            if domain in self._migrating:
                raise Conflict(f"VM {domain} is already migrating", current_state="migrating")
            if target.domain != domain or [v.vrnic_id for v in target.vrnics] != [v.vrnic_id for v in current.vrnics]:
                raise InvalidArgument("the destination must be the same domain with the same vRNICs")
            if target.ram_path == current.ram_path:
                raise InvalidArgument("the destination's RAM file is the source's; a migration needs its own")
            self._migrating[domain] = target
        return {"domain": domain, "phase": str(MigrationPhase.PREPARED), "moving": [],
                "presetup_mrs": 0, "prepare_ms": 0.0}

    def complete_vm_migration(self, domain: str) -> dict[str, object]:
        with self._lock:
            target = self._migrating.pop(domain, None)
            if target is None or domain not in self._vms:
                raise Conflict(f"VM {domain} has no migration prepared", current_state="bound")
            self._vms[domain] = target
        return asdict(SwitchoverReport(vrnics=[v.vrnic_id for v in target.vrnics]))

    def set_qos(self, vrnic_id: str, policy: QosPolicy) -> None:
        """The fake has no link: it records the policy (the API tier checks what reaches the backend)."""
        with self._lock:
            if vrnic_id not in self._vrnics:
                raise NotFound(f"no vRNIC {vrnic_id} in the backend")
            self.qos[vrnic_id] = policy

    def abort_vm_migration(self, domain: str) -> bool:
        with self._lock:
            return self._migrating.pop(domain, None) is not None

    def load(self, device: str) -> int:
        with self._lock:
            return self._load[device]
