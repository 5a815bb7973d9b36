"""A VM's vRNIC handed from one host's vrnicd to another's (cross-host live migration), the pure parts.

The steps, driven by the source vrnicd (vrnic.backend.vm_handover) while QEMU migrates the VM:

1. prepare (QEMU pre-copies): the source starts its dirty log; every other host with a peer QP connected to
   the VM logs its peers' RDMA WRITEs into it (track); the destination agent creates the vRNIC with the same
   spec, maps the destination QEMU's RAM, connects its channel and pre-sets-up PDs, MRs (over that RAM),
   CQs and QPs with the same handles and virtual QPNs (accept).
2. switchover (the source VM stopped, the destination not yet running): hold the VM's QPs and every peer QP
   connected to it, on every host; wait until no send is on the NIC (or only sends that wait for a receive
   the stopped VM cannot post); send the destination every page the NIC or vrnicd wrote (all hosts' logs)
   and every ring; hand over each QP's state and the work requests the NIC held or had not taken (carry),
   which the destination connects to the peers' physical QPs and posts again (take_over).
3. the control plane records the vRNIC's new host (the locator then answers with the destination agent).
4. the source's kernel objects go; every peer host re-points its held QPs: it forgets what it cached of the
   vRNIC and learns where it lives from what the destination published at take-over (Arrival; a QP that
   record does not name is asked of the directory, now the destination), moves the QP onto its pre-connected
   second QP (or resets and reconnects it), posts its receives again and lets it go (moved). The guest
   programs on both sides never notice.
5. the destination releases its QPs and serves the VM (release).

A failure before step 3 aborts: the destination drops what it set up, the peers are let go, the source
serves on. No I/O here: phases, the records that travel between agents, and their JSON forms.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, ValidationError

from vrnic.core.peer_wire import GID, QPN, IdentityWire, MrWindowWire, Wire
from vrnic.core.peering import Identity
from vrnic.core.rings import RecvRequest, SendRequest, Sge, WrOpcode
from vrnic.core.translate import MrWindow
from vrnic.errors import Conflict, InvalidArgument

PAGE_BATCH_BYTES = 1 << 20  # one pages request carries at most this much guest memory


class HandoverPhase(StrEnum):
    PREPARED = "prepared"  # dirty logs running, the destination pre-set-up
    SWITCHING = "switching"  # QPs held on every host, draining, pages and state moving
    HANDED_OVER = "handed_over"  # the destination holds the vRNIC's QPs; the control plane is told
    DONE = "done"  # peers re-pointed, the destination serves, nothing left on the source
    ABORTED = "aborted"  # the source serves as before; the destination's pre-setup is gone


_NEXT = {HandoverPhase.PREPARED: {HandoverPhase.SWITCHING, HandoverPhase.ABORTED},
         HandoverPhase.SWITCHING: {HandoverPhase.HANDED_OVER, HandoverPhase.ABORTED},
         HandoverPhase.HANDED_OVER: {HandoverPhase.DONE}}  # past the hand-over there is no way back


def advance(current: HandoverPhase, to: HandoverPhase) -> HandoverPhase:
    if to not in _NEXT.get(current, set()):
        raise Conflict(f"a hand-over that is {current} cannot become {to}", current_state=str(current))
    return to


# ----- work requests as JSON ---------------------------------------------------------------------------

def _sges(sges: Iterable[Sge]) -> list[list[int]]:
    return [[s.addr, s.length, s.lkey] for s in sges]


def _sges_back(raw: Any) -> tuple[Sge, ...]:
    return tuple(Sge(int(a), int(n), int(k)) for a, n, k in raw)


def send_to_wire(wr: SendRequest) -> dict[str, Any]:
    return {"wr_id": wr.wr_id, "opcode": int(wr.opcode), "sges": _sges(wr.sges), "signaled": wr.signaled,
            "imm": wr.imm, "remote_addr": wr.remote_addr, "rkey": wr.rkey, "compare_add": wr.compare_add,
            "swap": wr.swap, "ud_gid": wr.ud_gid.hex(), "ud_qpn": wr.ud_qpn, "ud_qkey": wr.ud_qkey}


def send_from_wire(raw: dict[str, Any]) -> SendRequest:
    try:
        return SendRequest(wr_id=int(raw["wr_id"]), opcode=WrOpcode(int(raw["opcode"])), sges=_sges_back(raw["sges"]),
                           signaled=bool(raw["signaled"]), imm=int(raw["imm"]), remote_addr=int(raw["remote_addr"]),
                           rkey=int(raw["rkey"]), compare_add=int(raw["compare_add"]), swap=int(raw["swap"]),
                           ud_gid=bytes.fromhex(raw["ud_gid"]), ud_qpn=int(raw["ud_qpn"]),
                           ud_qkey=int(raw["ud_qkey"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"not a send work request: {exc}") from None


def recv_to_wire(wr: RecvRequest) -> dict[str, Any]:
    return {"wr_id": wr.wr_id, "sges": _sges(wr.sges)}


def recv_from_wire(raw: dict[str, Any]) -> RecvRequest:
    try:
        return RecvRequest(wr_id=int(raw["wr_id"]), sges=_sges_back(raw["sges"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"not a receive work request: {exc}") from None


@dataclass
class QpCarry:
    """One QP as the destination must continue it: its connection as the guest made it, the receives the NIC
    held (posted again there, in order) and the sends the NIC never took (queued again there, first)."""

    handle: int
    state: str
    qp_type: str
    access: int
    qkey: int
    peer_gid: str | None
    peer_vqpn: int | None
    link: dict[str, int] = field(default_factory=dict)
    recvs: list[RecvRequest] = field(default_factory=list)
    sends: list[SendRequest] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"handle": self.handle, "state": self.state, "qp_type": self.qp_type, "access": self.access,
                "qkey": self.qkey, "peer_gid": self.peer_gid, "peer_vqpn": self.peer_vqpn, "link": dict(self.link),
                "recvs": [recv_to_wire(w) for w in self.recvs], "sends": [send_to_wire(w) for w in self.sends]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QpCarry:
        try:
            return cls(handle=int(raw["handle"]), state=str(raw["state"]), qp_type=str(raw["qp_type"]),
                       access=int(raw["access"]), qkey=int(raw["qkey"]),
                       peer_gid=None if raw["peer_gid"] is None else str(raw["peer_gid"]),
                       peer_vqpn=None if raw["peer_vqpn"] is None else int(raw["peer_vqpn"]),
                       link={str(k): int(v) for k, v in raw["link"].items()},
                       recvs=[recv_from_wire(w) for w in raw["recvs"]],
                       sends=[send_from_wire(w) for w in raw["sends"]])
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise InvalidArgument(f"not a QP hand-over record: {exc}") from None


# ----- guest memory as JSON --------------------------------------------------------------------------

def pages_to_wire(runs: Iterable[tuple[int, bytes]]) -> list[dict[str, Any]]:
    return [{"address": address, "data": base64.b64encode(data).decode()} for address, data in runs]


def pages_from_wire(raw: Iterable[dict[str, Any]]) -> list[tuple[int, bytes]]:
    try:
        return [(int(r["address"]), base64.b64decode(r["data"], validate=True)) for r in raw]
    except (KeyError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"not a list of guest pages: {exc}") from None


def batches(ranges: Iterable[tuple[int, int]], limit: int = PAGE_BATCH_BYTES) -> list[list[tuple[int, int]]]:
    """(address, length) ranges cut into batches of at most `limit` bytes each (a range may be split)."""
    if limit <= 0:
        raise InvalidArgument("a batch limit must be positive")
    out: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    room = limit
    for address, length in ranges:
        while length > 0:
            take = min(length, room)
            current.append((address, take))
            address, length, room = address + take, length - take, room - take
            if room == 0:
                out.append(current)
                current, room = [], limit
    if current:
        out.append(current)
    return out


def merge_ranges(*groups: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Several hosts' dirty ranges as one sorted list without overlaps (adjacent ones joined)."""
    merged: list[tuple[int, int]] = []
    for address, length in sorted(r for g in groups for r in g if r[1] > 0):
        if merged and address <= merged[-1][0] + merged[-1][1]:
            start, size = merged[-1]
            merged[-1] = (start, max(size, address + length - start))
        else:
            merged.append((address, length))
    return merged


@dataclass(frozen=True)
class PeerQpStatus:
    """A peer host's QP connected to the moving vRNIC, as its vrnicd sees it while held."""

    vm_vqpn: int  # the moving vRNIC's QP it is connected to
    sends: int  # sends on the NIC, not completed
    head_needs_recv: bool  # the first of them consumes a receive at the VM (SEND, WRITE with immediate)
    recvs: int  # receives posted on the NIC

    def to_dict(self) -> dict[str, Any]:
        return {"vm_vqpn": self.vm_vqpn, "sends": self.sends, "head_needs_recv": self.head_needs_recv,
                "recvs": self.recvs}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PeerQpStatus:
        return cls(int(raw["vm_vqpn"]), int(raw["sends"]), bool(raw["head_needs_recv"]), int(raw["recvs"]))


def drained(peers: Iterable[PeerQpStatus], vm_recvs: dict[int, int], vm_sends: dict[int, tuple[int, bool]]) -> bool:
    """Is nothing left on the NIC that will still complete? Sends that wait for a receive at the other end, which
    nobody can post now (the VM is stopped, the peers are held), count as drained: they were not taken and go
    again on the new connection. vm_recvs: receives posted per VM QP (by vqpn); vm_sends: per VM QP (sends on
    the NIC, the first consumes a receive) towards these peers, whose own status is in `peers`."""
    by_vm = {p.vm_vqpn: p for p in peers}
    for p in by_vm.values():
        if p.sends and not (p.head_needs_recv and vm_recvs.get(p.vm_vqpn, 0) == 0):
            return False
    for vqpn, (sends, head_needs_recv) in vm_sends.items():
        if not sends:
            continue
        peer = by_vm.get(vqpn)
        if peer is None or not head_needs_recv or peer.recvs:
            return False
    return True


@dataclass(frozen=True)
class Arrival:
    """Where a handed-over vRNIC lives now, as its destination published it at take-over: its identity, the
    destination's agent and device GID, its QPs (virtual -> physical QPN) and MR windows. A peer host re-points
    its held QPs with it instead of asking the directory (the database, then the destination) during the
    blackout; a QP it does not name is looked up as before."""

    identity: Identity
    agent_host: str
    agent_url: str
    phys_gid: str
    qpns: dict[int, int]
    windows: tuple[MrWindow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"target": IdentityWire.of(self.identity).model_dump(), "agent_host": self.agent_host,
                "agent_url": self.agent_url, "phys_gid": self.phys_gid,
                "qpns": {str(v): p for v, p in self.qpns.items()},
                "windows": [MrWindowWire.of(w).model_dump() for w in self.windows]}

    @classmethod
    def from_dict(cls, raw: Any) -> Arrival:
        try:
            wire = ArrivalWire.model_validate(raw)
        except ValidationError as exc:
            raise InvalidArgument(f"not an arrival record: {exc.errors()[0]['msg']}") from None
        return cls(wire.target.identity(), wire.agent_host, wire.agent_url, wire.phys_gid, dict(wire.qpns),
                   tuple(w.window() for w in wire.windows))


class ArrivalWire(Wire):
    target: IdentityWire
    agent_host: str = Field(min_length=1, max_length=253)
    agent_url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://")
    phys_gid: str = GID
    qpns: dict[Annotated[int, QPN], Annotated[int, QPN]] = Field(max_length=1 << 16)
    windows: list[MrWindowWire] = Field(max_length=1 << 16)
