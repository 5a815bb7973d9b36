"""The owner's side of peering: what this vrnicd tells other hosts' agents about the vRNICs it holds.

Each question names the asking vRNIC (its Identity, as its agent states it). Every answer goes through
the same reachability check a local session's would (Registry.local_peer: decide, audited), and only about
vRNICs held here: a question is never passed on to a third host. A refusal is the NotFound of a GID that
does not exist. The HTTP routes are vrnic.api.agent_peers; the asking side is peer_directory.AgentDirectory.
"""

from __future__ import annotations

import threading

from vrnic.backend.cm import ConnectionManager
from vrnic.backend.registry import Registry
from vrnic.core.peering import Identity
from vrnic.core.translate import MrWindow
from vrnic.core.vaddr import parse_virtual_gid
from vrnic.errors import Conflict, InvalidArgument

# Connect requests from other hosts wait for a guest's answer on one of the API's worker threads: at most this
# many at once, so guests that never answer cannot take every thread of this agent's API.
MAX_REMOTE_CM_WAITS = 16


class PeerService:
    def __init__(self, registry: Registry, cm: ConnectionManager) -> None:
        self.registry = registry
        self.cm = cm
        self._cm_waits = threading.BoundedSemaphore(MAX_REMOTE_CM_WAITS)

    @staticmethod
    def _check_asker(asker: Identity) -> None:
        """A virtual GID carries its VPC: an asker whose GID and VPC disagree is made up."""
        vpc_id, _ = parse_virtual_gid(asker.virtual_gid)
        if vpc_id != asker.vpc_id:
            raise InvalidArgument(f"asker {asker.vrnic_id}: GID {asker.virtual_gid} is not of VPC {asker.vpc_id}")

    def qp(self, asker: Identity, virtual_gid: str, vqpn: int, via: str = "connect") -> tuple[Identity, str, int]:
        """(the target's identity, its device GID, the QP's physical QPN)."""
        self._check_asker(asker)
        target = self.registry.local_peer(asker, virtual_gid, f"{via} (remote)")
        return target.identity, target.phys_gid, self.registry.published_qpn(target, vqpn)

    def mrs(self, asker: Identity, virtual_gid: str) -> list[MrWindow]:
        self._check_asker(asker)
        return self.registry.published_mrs(self.registry.local_peer(asker, virtual_gid, "rdma (remote)"))

    def reverse(self, asker: Identity, phys_gid: str, phys_qpn: int) -> int:
        self._check_asker(asker)
        return self.registry.reverse(asker, phys_qpn, phys_gid)

    def cm_connect(self, asker: Identity, virtual_gid: str, port: int, vqpn: int, private_data: bytes,
                   timeout: float) -> tuple[int, bytes]:
        """Queue the request on the listener and wait for its guest's answer (the caller's thread waits)."""
        self._check_asker(asker)
        target = self.registry.local_peer(asker, virtual_gid, "cm connect (remote)")
        if not self._cm_waits.acquire(blocking=False):
            raise Conflict(f"connection refused: {MAX_REMOTE_CM_WAITS} requests from other hosts are waiting here "
                           f"already", current_state="rejected")
        try:
            return self.cm.connect(asker, target.spec.id, port, vqpn, private_data, timeout)
        finally:
            self._cm_waits.release()
