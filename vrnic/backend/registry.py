"""The vRNICs this vrnicd holds, findable by id, attach token and virtual GID."""

from __future__ import annotations

import hmac
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vrnic.core.specs import VrnicSpec
from vrnic.errors import Conflict, NotFound

if TYPE_CHECKING:
    from vrnic.backend.session import GuestSession


@dataclass
class VirtualRnic:
    spec: VrnicSpec
    device: str
    token: str
    phys_gid: str  # the device's RoCE v2 GID: programmed into peers' QPs, never shown to guests
    gid_index: int
    session: GuestSession | None = field(default=None, repr=False)


class Registry:
    def __init__(self) -> None:
        self._by_id: dict[str, VirtualRnic] = {}
        self._lock = threading.Lock()

    def add(self, vrnic: VirtualRnic) -> None:
        with self._lock:
            if vrnic.spec.id in self._by_id:
                raise Conflict(f"vRNIC {vrnic.spec.id} already exists in the backend")
            if any(v.spec.virtual_gid == vrnic.spec.virtual_gid for v in self._by_id.values()):
                raise Conflict(f"virtual GID {vrnic.spec.virtual_gid} is already in use")
            self._by_id[vrnic.spec.id] = vrnic

    def remove(self, vrnic_id: str) -> VirtualRnic:
        with self._lock:
            vrnic = self._by_id.pop(vrnic_id, None)
        if vrnic is None:
            raise NotFound(f"no vRNIC {vrnic_id} in the backend")
        return vrnic

    def by_token(self, token: str) -> VirtualRnic:
        with self._lock:
            candidates = list(self._by_id.values())
        for vrnic in candidates:
            if hmac.compare_digest(vrnic.token.encode(), token.encode()):
                return vrnic
        raise NotFound("invalid attach token")

    def peer(self, asker: VirtualRnic, virtual_gid: str) -> VirtualRnic:
        """The attached vRNIC with that virtual GID, if asker may reach it (same tenant and VPC).

        Anything else looks exactly like a GID that does not exist.
        """
        with self._lock:
            found = next((v for v in self._by_id.values() if v.spec.virtual_gid == virtual_gid), None)
        if (found is None or found.spec.tenant != asker.spec.tenant or found.spec.vpc_id != asker.spec.vpc_id
                or found.session is None):
            raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}")
        return found

    def virtual_qpn(self, asker: VirtualRnic, phys_qpn: int, phys_gid: str | None) -> int:
        """The virtual QPN of a peer QP seen as a UD source, 0 if unknown or ambiguous.

        Physical QPNs are per device, so the source GID narrows the search to one
        device, and only the asker's own tenant and VPC are searched.
        """
        with self._lock:
            peers = [v.session for v in self._by_id.values() if v.session is not None
                     and v.spec.tenant == asker.spec.tenant and v.spec.vpc_id == asker.spec.vpc_id
                     and (phys_gid is None or v.phys_gid == phys_gid)]
        matches = [s.qp_by_phys[phys_qpn].vqpn for s in peers if phys_qpn in s.qp_by_phys]
        return matches[0] if len(matches) == 1 else 0

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._by_id)

    def attached_ids(self) -> set[str]:
        """The vRNICs whose guest has a session open now."""
        with self._lock:
            return {v.spec.id for v in self._by_id.values() if v.session is not None}

    def on_device(self, device: str) -> int:
        with self._lock:
            return sum(1 for v in self._by_id.values() if v.device == device)
