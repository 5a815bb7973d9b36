"""The direct engine: the guest drives its vRNIC's own NIC queues; vrnicd mediates only the control path.

vrnicd still runs every control verb (quotas, virtual identities, connect
checks by tenant and VPC), but creates the vRNIC's objects with raw uverbs
commands on a ucontext of its own (vrnic.backend.uverbs_edge) and leaves the
queues unmapped. The guest gets that ucontext's fd with the attach reply, and
with each create_cq/create_qp reply where its queue lies; with each reg_mr
reply the physical lkey and address base; and, on request, the physical rkey
behind a virtual rkey of a connected peer. It translates its own work requests
from that table, so vrnicd does nothing per post.

Trust: the fd carries the whole ucontext. What contains a guest that abuses
it is the kernel's own PD check (one ucontext and PD set per vRNIC), the rdma
cgroup and RLIMIT_MEMLOCK for objects it creates itself, and the RoCE packet
guard for QPs it points elsewhere (see README, "Two engines").
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any, Protocol

from vrnic.backend.engine import DataPathEngine, EngineHost
from vrnic.backend.session import GuestSession, QpPlan
from vrnic.backend.uverbs_edge import DirectContext, RawCq, RawQp
from vrnic.core import verb_args
from vrnic.core.quota import Resource
from vrnic.core.rings import Access
from vrnic.core.session_state import CqEntry, QpEntry, SessionSnapshot
from vrnic.errors import InvalidArgument, NotFound, NotSupported


class Releasable(Protocol):
    def release(self) -> None: ...


class TranslationGeneration:
    """A page vrnicd shares with a direct guest: a 64-bit generation at offset 0. vrnicd bumps it whenever
    translations the guest may have cached change (a peer's MR went away; migration will re-key everything);
    the guest compares it before each post and re-reads its table when it moved. The guest maps it read-only."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("vrnic-translations", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, mmap.PAGESIZE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, mmap.PAGESIZE)
        except BaseException:
            os.close(self.fd)
            raise
        self._words = memoryview(self._map).cast("Q")

    @property
    def value(self) -> int:
        return int(self._words[0])

    @property
    def closed(self) -> bool:
        return self._map.closed

    def bump(self) -> None:
        self._words[0] = self._words[0] + 1  # one aligned 8-byte store

    def close(self) -> None:
        self._words.release()
        self._map.close()
        os.close(self.fd)


class DirectEngine(DataPathEngine):
    """Nothing to move: the guest writes WQEs, rings the doorbell and polls CQEs itself."""

    busy_poll = False

    def __init__(self, host: EngineHost) -> None:
        self.host = host

    def start(self) -> None:
        return None

    def wake(self) -> None:
        return None

    def drain_queues(self, qps: list[QpEntry] | None = None) -> int:
        return 0  # posted WRs are already in the NIC's queues

    def stop(self) -> None:
        return None


class DirectSession(GuestSession):
    """A guest session on the direct engine: same verbs and checks, different replies."""

    device: DirectContext
    queue_format = "rxe"

    def __init__(self, *args: Any, confinement: Releasable | None = None, **kwargs: Any) -> None:
        self.confinement = confinement  # the guest's cgroup limit, released with the session
        self.generation = TranslationGeneration()
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.generation.close()
            raise

    def attach_result(self) -> dict[str, Any]:
        return {**super().attach_result(), "engine": "direct", "queue_format": self.queue_format,
                "contained": self.confinement is not None, "guarded": self.guard is not None}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.confinement is not None:
                self.confinement.release()
            if not self.generation.closed:
                self.generation.close()

    def attach_fds(self) -> list[int]:
        return [self.device.fd, self.generation.fd]

    def translations_changed(self) -> None:
        """Something the guest may have cached changed: it re-reads its table before its next post."""
        self.generation.bump()

    def op_translations(self, _: verb_args.NoArgs) -> dict[str, Any]:
        """The guest's local table afresh (remote keys it resolves again, lazily)."""
        mrs = [[w.vkey, w.phys_lkey, w.base] for _, mr in self.state.mrs.items() for w in [mr.window]]
        return {"generation": self.generation.value, "mrs": mrs}

    def op_reg_mr(self, args: verb_args.RegMr, handle: int | None = None, vkey: int | None = None) -> dict[str, Any]:
        result = super().op_reg_mr(args, handle, vkey)
        window = self.state.mrs.get(result["mr"]).window
        # The NIC knows the MR by vrnicd's address of it: guest address + iova_base.
        return {**result, "phys_lkey": window.phys_lkey, "iova_base": window.base}

    def op_reg_mrs(self, args: verb_args.RegMrs) -> dict[str, Any]:
        raise NotSupported("reg_mrs pools MRs on the shared-ring engine; the direct engine's guest learns each MR's "
                           "physical key at reg_mr")

    def op_create_cqs(self, args: verb_args.CreateCqs) -> dict[str, Any]:
        raise NotSupported("create_cqs pools CQs on the shared-ring engine; the direct engine maps each CQ's "
                           "own queue at create_cq")

    def op_create_cq(self, args: verb_args.CreateCq, handle: int | None = None) -> dict[str, Any]:
        if handle is not None:
            raise NotSupported("direct-engine sessions cannot be restored")
        self.state.ledger.check_cqe(args.cqe)
        with self.state.ledger.reserve((Resource.CQ, 1)):
            raw: RawCq = self.device.create_cq(args.cqe)
            cq = CqEntry(args.cqe, None, 0, raw)
            try:
                self.state.add_cq(cq, None)
            except BaseException:
                self.device.destroy(raw)
                raise
        return {"cq": cq.handle, "cqe": raw.cqe, "queue": raw.queue.as_dict()}

    def op_create_qp(self, args: verb_args.CreateQp, handle: int | None = None,
                     vqpn: int | None = None) -> dict[str, Any]:
        if handle is not None:
            raise NotSupported("direct-engine sessions cannot be restored")
        return super().op_create_qp(args)

    def _plan_shape(self, shape: verb_args.QpShape) -> QpPlan:
        if shape.qp_type != "rc":
            raise InvalidArgument("on the direct engine QPs are RC: rxe takes a UD destination from the WQE, "
                                  "which the guest writes (use a vRNIC with engine=ring for UD)")
        return super()._plan_shape(shape)

    def _placed(self, plan: QpPlan, sq_addr: int | None, rq_addr: int | None) -> QpPlan:
        return plan  # no rings: the guest posts to the NIC's own queues

    def _placed_many(self, plan: QpPlan, rings: list[int] | None, count: int) -> list[QpPlan]:
        return [plan] * count  # no rings, as _placed

    def _open_qps(self, qps: list[QpEntry]) -> None:
        self.registry.publish_qps(self.vrnic, [(qp.vqpn, qp.phys_qpn) for qp in qps])

    def _qp_reply(self, qp: QpEntry) -> dict[str, Any]:
        return {"qp": qp.handle, "qpn": qp.vqpn, **_queues(qp.obj)}

    def _qps_reply(self, qps: list[QpEntry]) -> dict[str, Any]:
        return {**super()._qps_reply(qps), "queues": [_queues(qp.obj) for qp in qps]}

    def op_resolve_rkey(self, args: verb_args.ResolveRkey) -> dict[str, Any]:
        qp = self.state.qps.get(args.qp)
        peer_mrs = self.peer_mrs(qp)
        if peer_mrs is None:
            raise InvalidArgument("the QP is not connected: remote keys are those of its connected peer")
        window = peer_mrs.get(args.rkey)
        if window is None or not window.access & (Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC):
            raise NotFound(f"rkey {args.rkey:#x} is not a remote key of this QP's peer")
        return {"rkey": window.phys_rkey, "iova_base": window.base}

    def snapshot(self) -> SessionSnapshot:
        raise NotSupported("direct-engine sessions cannot be snapshotted yet: their queues are the NIC's")

    def restore(self, snapshot: SessionSnapshot) -> None:
        raise NotSupported("direct-engine sessions cannot be restored yet")


def _queues(raw: RawQp) -> dict[str, Any]:
    """What a guest needs to drive a QP: its physical QPN, the doorbell's handle and the queues."""
    return {"phys_qpn": raw.qpn, "doorbell_handle": raw.handle, "sq": raw.sq.as_dict(), "rq": raw.rq.as_dict(),
            "max_send_wr": raw.caps.max_send_wr, "max_recv_wr": raw.caps.max_recv_wr, "max_sge": raw.caps.max_sge}
