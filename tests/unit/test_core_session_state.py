"""A session's state as pure data: tables, quota ledger reservations, snapshots."""

from __future__ import annotations

import json

import pytest

from vrnic.core.guest_phys import arena_layout, vm_layout
from vrnic.core.quota import QuotaLedger, Resource
from vrnic.core.rings import CQ_SLOT, RQ_SLOT, SQ_SLOT, Access, Ring
from vrnic.core.session_state import CqEntry, MrEntry, PdEntry, QpEntry, SessionSnapshot, SessionState
from vrnic.core.specs import Quota
from vrnic.core.translate import MrWindow
from vrnic.errors import Conflict, InvalidArgument, NotFound, QuotaExceeded

MEMORY = bytearray(1 << 16)


def ring(offset: int, entries: int, slot: object) -> Ring:
    return Ring(memoryview(MEMORY), offset, entries, slot)  # type: ignore[arg-type]


def populated() -> tuple[SessionState, PdEntry, CqEntry, MrEntry, QpEntry]:
    state = SessionState(Quota(), arena_layout(len(MEMORY)))
    pd = PdEntry()
    state.add_pd(pd)
    cq = CqEntry(8, ring(0, 8, CQ_SLOT), 0)
    state.add_cq(cq)
    window = MrWindow(vkey=state.new_vkey(), offset=8192, length=4096, access=Access.LOCAL_WRITE, phys_lkey=5,
                      phys_rkey=6, base=0)
    mr = MrEntry(window, pd)
    state.add_mr(mr)
    qp = QpEntry(state.new_vqpn(), "rc", 4242, pd, cq, cq, ring(16384, 4, SQ_SLOT), ring(32768, 4, RQ_SLOT),
                 sq_addr=16384, rq_addr=32768)
    state.add_qp(qp)
    return state, pd, cq, mr, qp


def test_reserve_keeps_charges_on_success_and_refunds_them_on_failure() -> None:
    ledger = QuotaLedger(Quota(max_mrs=2, max_pinned_bytes=100))
    with ledger.reserve((Resource.MR, 1), (Resource.PINNED_BYTES, 60)):
        pass
    with pytest.raises(RuntimeError), ledger.reserve((Resource.MR, 1), (Resource.PINNED_BYTES, 30)):
        raise RuntimeError("the device refused")
    assert ledger.used()["mr"] == 1 and ledger.used()["pinned_bytes"] == 60
    with pytest.raises(QuotaExceeded), ledger.reserve((Resource.MR, 1), (Resource.PINNED_BYTES, 41)):
        pytest.fail("the block must not run when a charge is refused")
    assert ledger.used()["mr"] == 1, "a refused second charge gives back the first"


def test_objects_in_use_cannot_be_taken_and_taking_refunds() -> None:
    state, pd, cq, mr, qp = populated()
    state.ledger.restore({"pd": 1, "cq": 1, "mr": 1, "qp": 1, "pinned_bytes": 4096})
    with pytest.raises(Conflict):
        state.take_pd(pd.handle)
    with pytest.raises(Conflict):
        state.take_cq(cq.handle)
    assert (pd.users, cq.users) == (2, 2)
    assert state.qp_by_phys[4242] is qp and state.mr_by_vkey[mr.window.vkey] is mr.window
    state.take_qp(qp.handle)
    state.take_mr(mr.handle)
    assert (pd.users, cq.users) == (0, 0)
    assert not state.qp_by_phys and not state.qp_by_vqpn and not state.mr_by_vkey
    with pytest.raises(NotFound):
        state.take_qp(qp.handle)
    state.take_cq(cq.handle)
    state.take_pd(pd.handle)
    assert set(state.ledger.used().values()) == {0}


def test_take_all_returns_everything_in_destroy_order() -> None:
    state, pd, cq, mr, qp = populated()
    assert state.take_all() == ([qp], [cq], [mr], [pd])
    assert not any(len(t) for t in (state.pds, state.cqs, state.mrs, state.qps))


def test_snapshots_are_plain_data_that_round_trip() -> None:
    state, pd, cq, mr, qp = populated()
    qp.state, qp.peer_gid, qp.peer_vqpn = "rts", "fd76:726e:1::2", 99
    snap = state.snapshot()
    again = SessionSnapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    assert again == snap
    (q,) = snap.qps
    assert (q.handle, q.vqpn, q.pd, q.send_cq, q.sq_ring, q.rq_ring, q.state, q.peer_vqpn) == (
        qp.handle, qp.vqpn, pd.handle, cq.handle, 16384, 32768, "rts", 99)
    assert snap.mrs[0].vkey == mr.window.vkey and snap.cqs[0].ring == 0


def test_restoring_under_known_handles() -> None:
    state = SessionState(Quota(), arena_layout(len(MEMORY)))
    pd = PdEntry()
    assert state.add_pd(pd, handle=12345) == 12345 and state.pds.get(12345) is pd
    with pytest.raises(InvalidArgument):
        state.add_pd(PdEntry(), handle=12345)
    with pytest.raises(InvalidArgument):
        state.add_pd(PdEntry(), handle=0)


def test_regions_must_lie_in_guest_memory() -> None:
    state = SessionState(Quota(), vm_layout(1 << 24))
    assert state.locate(0x200000, 4096, "MR") == 0x200000
    with pytest.raises(InvalidArgument):
        state.locate(0xC0000, 4096, "MR")  # the legacy ROM window is not RAM
    with pytest.raises(InvalidArgument):
        state.locate((1 << 24) - 1, 2, "MR")


def test_a_batch_of_virtual_qpns_is_distinct_new_and_in_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """One draw of randomness for a batch: QPNs 0 and 1 (special in verbs), a session's QPN and
    one drawn twice are skipped, and more is drawn until the batch is full."""
    state, _, _, _, qp = populated()
    draws = iter([bytes.fromhex("000000" "000001" + f"{qp.vqpn:06x}" + "000102" "000102" "fffffe"),
                  bytes.fromhex("000203" "000204")])
    monkeypatch.setattr("vrnic.core.session_state.secrets.token_bytes", lambda n: next(draws))
    assert state.new_vqpns(4) == [0x102, 0xFFFFFE, 0x203, 0x204]
    monkeypatch.undo()
    many = state.new_vqpns(128)
    assert len(set(many)) == 128 and qp.vqpn not in many and all(2 <= v < 1 << 24 for v in many)


def test_a_batch_of_mrs_enters_and_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_mrs / take_mrs (reg_mrs, dereg_mrs): new keys drawn at once skip a session's key and one drawn twice,
    and more are drawn until the batch is full; taking is all or none, and refunds every MR and its pinned bytes."""
    state, pd, _, mr, _ = populated()
    state.ledger.restore({"pd": 1, "cq": 1, "mr": 4, "qp": 1, "pinned_bytes": 4096 + 3 * 8192})
    taken = mr.window.vkey
    draws = iter([[taken << 32, 7 << 32, 7 << 32], [9 << 32, 11 << 32]])
    monkeypatch.setattr("vrnic.core.session_state.random_words", lambda n: next(draws))
    keys = state.new_vkeys(3)
    monkeypatch.undo()
    assert keys == [7, 9, 11]
    mrs = [MrEntry(MrWindow(vkey=key, offset=16384 + n * 8192, length=8192, access=Access.LOCAL_WRITE,
                            phys_lkey=n, phys_rkey=n, base=0), pd) for n, key in enumerate(keys)]
    state.add_mrs(mrs)
    assert len({m.handle for m in mrs}) == 3 and all(state.mrs.get(m.handle) is m for m in mrs)
    assert pd.users == 2 + 3 and all(state.mr_by_vkey[m.window.vkey] is m.window for m in mrs)
    with pytest.raises(NotFound):
        state.take_mrs([mrs[0].handle, 12345])  # one unknown: nothing is taken
    with pytest.raises(NotFound):
        state.take_mrs([mrs[0].handle, mrs[0].handle])  # one named twice: nothing is taken
    assert len(state.mrs) == 4 and pd.users == 5
    assert state.take_mrs([m.handle for m in mrs]) == mrs
    assert len(state.mrs) == 1 and pd.users == 2 and set(state.mr_by_vkey) == {taken}
    assert state.ledger.used()["mr"] == 1 and state.ledger.used()["pinned_bytes"] == 4096


def test_a_batch_of_qps_enters_at_once() -> None:
    state, pd, cq, _, qp = populated()
    qps = [QpEntry(vqpn, "rc", 5000 + n, pd, cq, cq, ring(40960 + n * 4096, 4, SQ_SLOT),
                   ring(40960 + n * 4096 + 2048, 4, RQ_SLOT)) for n, vqpn in enumerate(state.new_vqpns(3))]
    state.add_qps(qps)
    assert len({q.handle for q in qps} | {qp.handle}) == 4 and all(state.qps.get(q.handle) is q for q in qps)
    assert (pd.users, cq.users) == (2 + 3, 2 + 6)
    assert all(state.qp_by_vqpn[q.vqpn] is q and state.qp_by_phys[q.phys_qpn] is q for q in qps)
    for q in qps:
        state.take_qp(q.handle)
    assert (pd.users, cq.users) == (2, 2) and set(state.qp_by_phys) == {4242}
