"""Attacks by a direct-engine guest, which holds its vRNIC's uverbs fd and writes the NIC's WQEs itself.

The frontend's translation is the guest's own code, so every test here bypasses it the way a hostile guest
would: it writes physical keys of its choosing into its WQEs. What must stop it is the kernel (one
ucontext and PD per vRNIC; rxe checks lkeys against the QP's PD and rkeys against the responder's PD)
and, after detach, the fact that vrnicd destroyed every object on the ucontext.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.queue_format.base import PhysWr
from vrnic.core.queue_format.rxe import RDMA_VERBS_IOCTL, RxeFormat
from vrnic.core.specs import AttachInfo
from vrnic.frontend import (
    DeviceError,
    RecvRequest,
    SendRequest,
    Sge,
    WcStatus,
    WrOpcode,
)
from vrnic.frontend.direct import PhysKey

from .conftest import wait_for_baseline
from .guest_objects import Guest, connected_pair


def _window(driver: Any, guest: Guest) -> Any:
    """What only vrnicd knows: the physical keys and iova of a guest's MR (the attacker's perfect guess)."""
    session = driver.registry.get(guest.ctx.vrnic_id).session
    return session.state.mr_by_vkey[guest.mr.lkey]


def test_foreign_lkeys_and_other_tenants_rkeys_are_refused_by_the_kernel(
        make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str], driver: Any) -> None:
    a = Guest(make_vrnic(tenant="alice", engine="direct"))
    b = Guest(make_vrnic(tenant="alice", device=device_pair[1], engine="direct"))
    mallory = Guest(make_vrnic(tenant="mallory", device=device_pair[1], engine="direct"))
    try:
        victim = _window(driver, mallory)
        mallory.mr.write(b"M" * 64)
        assert a.ctx.direct is not None
        # a plants mallory's physical keys in its own translation table: its WQEs then carry them.
        a.ctx.direct.local[0xBAD] = PhysKey(victim.phys_lkey, victim.base)
        qa, _ = connected_pair(a, b)
        qa.post_send(SendRequest(1, WrOpcode.SEND, (Sge(mallory.mr.addr, 64, 0xBAD),)))
        wc = a.cq.wait(1)[0]
        # Mallory's lkey is not in a's PD: rxe's lookup fails with EINVAL, reported as a local QP operation
        # error (finish_packet in rxe_req.c; hardware says LOC_PROT_ERR). Nothing of mallory's is sent.
        assert wc.status == WcStatus.LOC_QP_OP_ERR

        qa, _ = connected_pair(a, b)  # an RC error leaves the QP in ERR: a fresh pair for each attack
        a.ctx.direct.remote[(qa.handle, 0xBAD)] = PhysKey(victim.phys_rkey, victim.base)
        qa.post_send(SendRequest(2, WrOpcode.RDMA_READ, (a.mr.sge(0, 64),), remote_addr=mallory.mr.addr,
                                 rkey=0xBAD))
        wc = a.cq.wait(1)[0]
        assert wc.status == WcStatus.REM_ACCESS_ERR  # b's QP answers, and mallory's MR is not in b's PD
        assert a.mr.read(64) != b"M" * 64

        qa, _ = connected_pair(a, b)  # beyond the end of b's own MR
        qa.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr + 65536 - 8,
                                 rkey=b.mr.rkey))
        assert a.cq.wait(1)[0].status == WcStatus.REM_ACCESS_ERR

        qa, _ = connected_pair(a, b)  # and the honest path still works
        qa.post_send(SendRequest(4, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    finally:
        for g in (a, b, mallory):
            g.close()


def test_a_detached_guest_keeping_a_dup_of_the_fd_loses_the_data_path(
        make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str]) -> None:
    baseline = resource_counts()
    a = Guest(make_vrnic(engine="direct"))
    b = Guest(make_vrnic(device=device_pair[1], engine="direct"))
    qa, qb = connected_pair(a, b)
    qa.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
    assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    assert a.ctx.direct is not None and qa.direct is not None
    kept = os.dup(a.ctx.direct.fd)  # the guest keeps a copy, and its mapped send queue
    sq, doorbell = qa.direct.sq, bytearray(qa.direct._doorbell)
    local, remote = a.ctx.direct.local[a.mr.lkey], a.ctx.direct.remote[(qa.handle, b.mr.rkey)]
    iova, lkey, rbase, rkey = local.iova_base, local.key, remote.iova_base, remote.key
    try:
        a.ctx.call("detach")  # detach as a hostile guest does: keeping every mapping and descriptor
        b.mr.write(bytes(64))
        during = resource_counts()
        assert during[device_pair[0]]["qp"] == baseline[device_pair[0]]["qp"]
        assert during[device_pair[0]]["mr"] == baseline[device_pair[0]]["mr"]
        # A WQE written into the old, still-mapped queue goes nowhere: the doorbell names a QP that is gone.
        RxeFormat().send_wqe(sq.buf, sq.slot(sq.producer), PhysWr(9, WrOpcode.RDMA_WRITE, [(iova, 64, lkey)],
                                                                 remote_addr=rbase + b.mr.addr, rkey=rkey), 9)
        sq.advance_producer()
        with pytest.raises(OSError):
            fcntl.ioctl(kept, RDMA_VERBS_IOCTL, doorbell)
        assert b.mr.read(64) == bytes(64)
    finally:
        # The guest's copy and its mappings hold the (now empty) ucontext open until it lets go of them.
        os.close(kept)
        a.ctx.closed = True
        a.ctx._release_local()  # unmaps the queues, closes the fd
        for obj in (qb, b.mr, b.cq, b.pd, b.ctx):
            obj.close()
    assert wait_for_baseline(baseline) == baseline


def test_direct_receives_need_no_daemon_and_errors_are_the_nics(
        make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str]) -> None:
    """A receive the guest posts is on the NIC at once (no daemon, no sync); a full queue is the guest's to see."""
    a = Guest(make_vrnic(engine="direct"))
    b = Guest(make_vrnic(device=device_pair[1], engine="direct"))
    try:
        qa, qb = a.qp(), b.qp()
        qa.connect(b.ctx.gid, qb.qpn)
        qb.connect(a.ctx.gid, qa.qpn)
        qb.post_recv(RecvRequest(7, (b.mr.sge(0, 64),)))
        qa.post_send(SendRequest(8, WrOpcode.SEND, (a.mr.sge(0, 64),)))
        assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
        assert b.cq.wait(1)[0].wr_id == 7
        with pytest.raises(DeviceError, match="queue full"):
            qb.post_recv([RecvRequest(i, (b.mr.sge(0, 64),)) for i in range(100000)])
    finally:
        a.close()
        b.close()


def test_vrnicd_updates_the_guests_translation_table(make_vrnic: Callable[..., AttachInfo],
                                                      device_pair: tuple[str, str], driver: Any) -> None:
    """The guest translates from a table it caches; vrnicd bumps a shared generation when it changes what is
    behind it, and the guest re-reads before its next post (migration re-keys everything this way)."""
    from vrnic.core import verb_args

    a = Guest(make_vrnic(engine="direct"))
    b = Guest(make_vrnic(device=device_pair[1], engine="direct"))
    try:
        assert a.ctx.direct is not None
        qa, _ = connected_pair(a, b)
        qa.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
        assert (qa.handle, b.mr.rkey) in a.ctx.direct.remote  # cached

        # vrnicd re-registers a's MR under the same virtual key (new physical keys), without telling a: its
        # cached lkey is stale and the kernel refuses it.
        session = driver.registry.get(a.ctx.vrnic_id).session
        with session.lock:
            old = session.state.mrs.get(a.mr.handle).window
            session.op_dereg_mr(verb_args.MrRef(mr=a.mr.handle))
            session.op_reg_mr(verb_args.RegMr(pd=a.pd.handle, addr=old.offset, length=old.length,
                                              access=int(old.access)), handle=a.mr.handle, vkey=old.vkey)
            new = session.state.mrs.get(a.mr.handle).window
        assert new.phys_lkey != old.phys_lkey and new.vkey == old.vkey
        stale_generation = a.ctx.direct.seen
        qa, _ = connected_pair(a, b)
        qa.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert a.cq.wait(1)[0].status == WcStatus.LOC_QP_OP_ERR
        # Now vrnicd bumps the generation: the next post re-reads the table and works.
        session.translations_changed()
        qa, _ = connected_pair(a, b)
        qa.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
        assert a.ctx.direct.seen > stale_generation and a.ctx.direct.local[a.mr.lkey].key == new.phys_lkey

        # A peer's MR going away bumps the generation too: the cached rkey is dropped, not used.
        seen = a.ctx.direct.seen
        b.mr.close()
        qa.post_recv([])  # any post brings the table up to date
        assert a.ctx.direct.seen > seen and not a.ctx.direct.remote
    finally:
        a.close()
        b.close()
