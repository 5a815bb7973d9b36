"""What a session's first QPs cost: rings on never-written guest memory stay untouched (neither written at create
nor read by the engine until the guest writes one), and the data path's thread starts once the guest has its reply
(issue 14). The real driver and channel on the fake RNIC edge."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable

import pytest

from tests.unit.test_backend_session import ME, guest_fds, session_of
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.engine import SharedRingEngine
from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.session import GuestSession
from vrnic.core.rings import CQ_SLOT, HEADER_BYTES, RQ_SLOT, Ring, pack_recv, unpack_completion
from vrnic.core.specs import AttachInfo
from vrnic.core.verb_args import Attach
from vrnic.frontend import CQ, PD, QP, Context, RecvRequest, WcStatus

ARENA = 1 << 20
PAGE = mmap.PAGESIZE


def test_data_extents_tell_holes_from_data_in_the_guests_memory_file(memory: GuestMemory) -> None:
    memory.view[3 * PAGE + 100] = 1  # one byte makes its page data; a page of zeros written is data too
    memory.view[6 * PAGE:7 * PAGE] = bytes(PAGE)
    memory.view[7 * PAGE + 5] = 1
    assert memory.data_extents(0, 16 * PAGE) == [(3 * PAGE, 4 * PAGE), (6 * PAGE, 8 * PAGE)]
    assert memory.data_extents(3 * PAGE + 4000, 6 * PAGE + 2) == [(3 * PAGE + 4000, 4 * PAGE), (6 * PAGE, 6 * PAGE + 2)]
    assert memory.data_extents(0, 64) == []
    assert memory.data_extents(4 * PAGE, 6 * PAGE) == []
    assert memory.data_extents(9 * PAGE, 16 * PAGE) == []  # no data up to the end of the file (ENXIO)
    assert _pages_with_data(memory.fd) == [3, 6, 7]  # asking wrote nothing


def test_data_extents_are_all_data_where_the_file_cannot_tell(memory: GuestMemory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without SEEK_DATA (EINVAL), or any other failure: all of it may hold data, so rings get
    reset."""
    def refuse(fd: int, pos: int, how: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "lseek", refuse)
    assert memory.data_extents(64, PAGE + 64) == [(64, PAGE + 64)]


def test_holds_data_tells_which_spans_touch_data_with_one_look_at_the_file(memory: GuestMemory,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    memory.view[3 * PAGE + 100] = 1
    memory.view[7 * PAGE + 5] = 1
    looks: list[tuple[int, int]] = []
    extents = memory.data_extents
    monkeypatch.setattr(memory, "data_extents", lambda start, end: looks.append((start, end)) or extents(start, end))
    spans = [(0, 64), (3 * PAGE, 3 * PAGE + 64), (4 * PAGE - 64, 4 * PAGE), (4 * PAGE, 4 * PAGE + 64),
             (5 * PAGE, 7 * PAGE + 1), (6 * PAGE, 7 * PAGE), (7 * PAGE + 4000, 7 * PAGE + 4064), (15 * PAGE, 16 * PAGE)]
    assert memory.holds_data(spans) == [False, True, True, False, True, False, True, False]
    assert looks == [(0, 16 * PAGE)]
    assert memory.holds_data([]) == [] and len(looks) == 1


def test_the_engine_leaves_rings_no_one_wrote_unread_until_the_guests_first_doorbell(
        make_vrnic: Callable[..., AttachInfo], driver: VerbsDriver) -> None:
    """Reading a never-written page of shared memory faults it in as a write does (20-30 us under TCG). Through
    their create, a verb's drain (which looks at the file first) and the engine's steps, fresh QPs' ring pages stay
    unallocated. The guest's first doorbell makes every QP readable: the engine serves it, and reads the other
    QPs' rings from then on (looking at the file at every doorbell instead taxed every SEND)."""
    info = make_vrnic()
    with Context.attach(info, ARENA) as ctx:
        pd, cq = PD(ctx), CQ(ctx, 64)
        qps = QP.create_many(pd, cq, cq, 6, max_send_wr=256, max_recv_wr=256)  # rings of two pages or more
        session = session_of(driver, info)
        engine = session.engine
        assert isinstance(engine, SharedRingEngine)
        _wait_until(lambda: engine.waits > 0)  # its thread ran its first step and sleeps
        entries = {qp.vqpn: qp for _, qp in session.state.qps.items()}
        qps[2].close()  # a destroyed QP leaves the blank ones
        del entries[qps[2].qpn]
        header_pages = {ring.offset // PAGE for qp in entries.values() for ring in (qp.sq, qp.rq) if ring is not None}

        def header_pages_read_or_written() -> set[int]:
            return header_pages & set(_pages_with_data(session.memory.fd))

        assert all(qp.blank for qp in entries.values())
        assert set(session._blank_qps) == {qp.handle for qp in entries.values()}
        assert header_pages_read_or_written() == set()
        qps[0].modify("init")  # a verb's drain looks, and reads nothing
        qps[3].modify("init")
        assert header_pages_read_or_written() == set()
        assert all(qp.blank for qp in entries.values())

        qps[1].modify("init")
        qps[1].post_recv(RecvRequest(7, ()))  # no buffer: refused, in a completion the engine writes
        [done] = cq.wait(1, timeout=5)
        assert (done.wr_id, done.status) == (7, WcStatus.LOC_QP_OP_ERR)
        assert not any(qp.blank for qp in entries.values()) and not session._blank_qps
        _wait_until(lambda: header_pages_read_or_written() == header_pages)  # the engine reads them all now

        qps[4].modify("init")  # and serves a QP that was blank before the doorbell, as any other
        qps[4].post_recv(RecvRequest(8, ()))
        [done] = cq.wait(1, timeout=5)
        assert (done.wr_id, done.status) == (8, WcStatus.LOC_QP_OP_ERR)


def test_a_verbs_drain_reads_a_blank_qps_ring_once_its_guest_wrote_it(make_vrnic: Callable[..., AttachInfo],
                                                                       driver: VerbsDriver) -> None:
    """No engine thread here (no reply went out): modify_qp's own drain must find what the guest posted before
    it, on a QP that was blank until then, and read no other QP's ring."""
    info = make_vrnic()
    session = driver.open_session(Attach(token=info.token or ""), guest_fds(), ME)
    try:
        assert isinstance(session, GuestSession)
        fd = session.memory.fd
        pd = session.handle("alloc_pd", {})["pd"]
        cq = session.handle("create_cq", {"cqe": 16, "ring": 0})["cq"]
        shape = {"pd": pd, "send_cq": cq, "recv_cq": cq, "max_send_wr": 4, "max_recv_wr": 4}
        made = session.handle("create_qps", {"shape": shape, "count": 2, "rings": [PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE]})
        first, second = (session.state.qps.get(handle) for handle in made["qps"])
        assert first.blank and second.blank and _pages_with_data(fd) == []
        view, words = session.memory.view, session.memory.words
        Ring(view, 2 * PAGE, 4, RQ_SLOT, words).produce(pack_recv(RecvRequest(9, ())))  # as its guest posts
        session.handle("modify_qp", {"qp": made["qps"][0], "state": "init"})
        assert not first.blank and second.blank
        completions = Ring(view, 0, 16, CQ_SLOT, words)
        assert [(c.wr_id, c.status) for c in map(unpack_completion, completions.consume(16))] == [
            (9, WcStatus.LOC_QP_OP_ERR)]  # refused (no buffer), in the CQ's ring
        assert _pages_with_data(fd) == [0, 1, 2]  # the CQ's ring and the first QP's two; the second's unread
    finally:
        session.close()


def _pages_with_data(fd: int) -> list[int]:
    """The pages of the file that hold data (written, or allocated), by SEEK_DATA and SEEK_HOLE."""
    pages, at, size = [], 0, os.fstat(fd).st_size
    while at < size:
        try:
            start = os.lseek(fd, at, os.SEEK_DATA)
        except OSError as exc:
            assert exc.errno == errno.ENXIO
            break
        at = os.lseek(fd, start, os.SEEK_HOLE)
        pages += range(start // PAGE, at // PAGE)
    return pages


def test_new_rings_on_never_written_memory_stay_unwritten_and_rings_on_written_memory_are_emptied(
        make_vrnic: Callable[..., AttachInfo], driver: VerbsDriver) -> None:
    """create_qps, create_qp and create_cq write a ring's empty header only where the guest's memory was written
    before (a ring freed and placed again leaves its indices there); elsewhere the header reads as zeros already,
    and vrnicd faults no page in for it."""
    info = make_vrnic()
    for verb in ("create_qps", "create_qp"):
        session = driver.open_session(Attach(token=info.token or ""), guest_fds(), ME)
        try:
            view, fd = session.memory.view, session.memory.fd
            for at in (4 * PAGE, 9 * PAGE + 64):  # stale indices of earlier rings
                view[at:at + HEADER_BYTES] = b"\xff" * HEADER_BYTES
            pd = session.handle("alloc_pd", {})["pd"]
            cq = session.handle("create_cq", {"cqe": 16, "ring": 0})["cq"]
            other_cq = session.handle("create_cq", {"cqe": 16, "ring": 9 * PAGE + 64})["cq"]
            shape = {"pd": pd, "send_cq": cq, "recv_cq": other_cq, "max_send_wr": 4, "max_recv_wr": 4}
            if verb == "create_qps":
                session.handle(verb, {"shape": shape, "count": 3,
                                      "rings": [PAGE, 2 * PAGE, 4 * PAGE, 5 * PAGE, 6 * PAGE, 7 * PAGE + 64]})
            else:
                session.handle(verb, {**shape, "sq_ring": 5 * PAGE, "rq_ring": 4 * PAGE})
            # (its first QP: the engine starts after the reply, which no one sends here, so nothing reads the rings)
            assert _pages_with_data(fd) == [4, 9]  # the written pages, no other
            for at in (4 * PAGE, 9 * PAGE + 64):
                assert bytes(view[at:at + HEADER_BYTES]) == bytes(HEADER_BYTES)
            for _, qp in session.state.qps.items():  # every ring empty (reading pages in)
                assert qp.sq is not None and qp.rq is not None
                assert qp.sq.count() == 0 and qp.rq.count() == 0
        finally:
            session.close()


def test_a_guest_has_its_first_qps_before_their_engine_starts(make_vrnic: Callable[..., AttachInfo],
                                                             driver: VerbsDriver,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the data path's thread took 2.6 ms of a first create_qps in the lab: it starts after the reply,
    and then moves the guest's work as before."""
    replied = threading.Event()
    started_after_reply: list[bool] = []
    real_start = SharedRingEngine.start

    def start(self: SharedRingEngine) -> None:
        started_after_reply.append(replied.wait(timeout=5))
        real_start(self)

    monkeypatch.setattr(SharedRingEngine, "start", start)
    info = make_vrnic()
    with Context.attach(info, ARENA) as ctx:
        pd, cq = PD(ctx), CQ(ctx, 16)
        assert not started_after_reply  # no QP, no engine
        qp = QP(pd, cq, cq)
        replied.set()
        engine = session_of(driver, info).engine
        assert isinstance(engine, SharedRingEngine)
        _wait_until(lambda: engine.waits > 0)  # the thread runs, and went to sleep with nothing to do
        assert started_after_reply == [True]
        qp.modify("init")
        qp.post_recv(RecvRequest(7, ()))  # no buffer: refused, in a completion the engine writes
        [done] = cq.wait(1, timeout=5)  # the doorbell woke it: it serves the guest as before
        assert (done.wr_id, done.status) == (7, WcStatus.LOC_QP_OP_ERR)


def test_a_caller_that_runs_no_after_reply_starts_the_engine_with_its_next_request_or_doorbell(
        make_vrnic: Callable[..., AttachInfo], driver: VerbsDriver) -> None:
    info = make_vrnic()
    for kick in ("request", "doorbell"):
        session = driver.open_session(Attach(token=info.token or ""), guest_fds(), ME)
        try:
            assert isinstance(session, GuestSession)
            session.start()
            pd = session.handle("alloc_pd", {})["pd"]
            cq = session.handle("create_cq", {"cqe": 16, "ring": 0})["cq"]
            session.handle("create_qp", {"pd": pd, "send_cq": cq, "recv_cq": cq, "qp_type": "rc",
                                         "max_send_wr": 4, "max_recv_wr": 4, "max_sge": 1,
                                         "sq_ring": PAGE, "rq_ring": 2 * PAGE})
            assert session.engine.stats()["alive"] is False  # due, not started: no reply went out yet
            if kick == "request":
                session.handle("null_rpc", {})
            else:
                session.ring_doorbell()
            assert session.engine.stats()["alive"] is True
        finally:
            session.close()


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
