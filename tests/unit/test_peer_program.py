"""vrnic.frontend.peer_program without a vRNIC: the command loop (seq echo, refusals while the receive stream
runs), the control port surviving its host end going away, and the receive stream over a fake QP and CQ."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from vrnic.core.rings import Completion, RecvRequest, WcOpcode, WcStatus
from vrnic.frontend import peer_program
from vrnic.frontend.peer_program import RECV_SLOT, STREAM_WR, RecvStream, read_lines, serve

pytestmark = pytest.mark.unit


class FakeMr:
    def __init__(self, size: int = 64 * RECV_SLOT) -> None:
        self.data = bytearray(size)

    def read(self, length: int, offset: int = 0) -> bytes:
        return bytes(self.data[offset:offset + length])

    def sge(self, offset: int, length: int) -> tuple[int, int]:
        return offset, length


class FakeQpCq:
    """A QP whose receives complete as `arrive` says: each arrival lands its seq in the oldest posted slot."""

    def __init__(self, mr: FakeMr, arrive: list[int], fail_after: int | None = None) -> None:
        self.mr = mr
        self.posted: list[int] = []
        self.arrive = arrive
        self.fail_after = fail_after
        self.delivered = 0

    def post_recv(self, wrs: list[RecvRequest]) -> None:
        self.posted += [wr.wr_id for wr in wrs]

    def poll(self, max_entries: int = 16) -> list[Completion]:
        if not self.arrive or not self.posted:
            return []
        wr_id = self.posted.pop(0)
        seq = self.arrive.pop(0)
        self.delivered += 1
        if self.fail_after is not None and self.delivered > self.fail_after:
            return [Completion(wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV)]
        slot = wr_id - STREAM_WR
        self.mr.data[slot * RECV_SLOT:slot * RECV_SLOT + 8] = seq.to_bytes(8, "little")
        return [Completion(wr_id, WcStatus.SUCCESS, WcOpcode.RECV, byte_len=8)]


class FakePeer:
    def __init__(self, arrive: list[int] | None = None, fail_after: int | None = None) -> None:
        self.mr = FakeMr()
        self.qp = self.cq = FakeQpCq(self.mr, arrive or [], fail_after)
        self.stream: RecvStream | None = None
        self.closed = False

    def peek(self, offset: int, length: int) -> dict[str, Any]:
        return peer_program.Peer.peek(self, offset, length)  # type: ignore[arg-type]

    def recv_stream_start(self, slots: int = 16) -> dict[str, Any]:
        return peer_program.Peer.recv_stream_start(self, slots)  # type: ignore[arg-type]

    def recv_stream_stop(self, expect: int, timeout: float = 30.0) -> dict[str, Any]:
        return peer_program.Peer.recv_stream_stop(self, expect, timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.closed = True


def run(peer: FakePeer, *commands: dict[str, Any]) -> list[dict[str, Any]]:
    replies: list[dict[str, Any]] = []
    serve(peer, [json.dumps(c) for c in commands], replies.append)  # type: ignore[arg-type]
    return replies


def test_replies_echo_seq_and_unknown_commands_fail() -> None:
    replies = run(FakePeer(), {"op": "peek", "offset": 0, "length": 2, "seq": 7}, {"op": "nope", "seq": 8},
                  {"op": "peek", "offset": 0, "length": 1})
    assert replies == [{"op": "peek", "ok": True, "data": "0000", "seq": 7},
                       {"ok": False, "error": "VrnicError: unknown command 'nope'", "seq": 8},
                       {"op": "peek", "ok": True, "data": "00"}]


def test_receive_stream_reposts_and_owns_the_qp_until_stopped() -> None:
    peer = FakePeer(arrive=list(range(1, 31)))
    replies = run(peer, {"op": "recv_stream_start", "slots": 4}, {"op": "send", "data": "00"},
                  {"op": "peek", "offset": 0, "length": 1}, {"op": "recv_stream_stop", "expect": 30, "timeout": 10},
                  {"op": "recv_stream_stop", "expect": 1})
    assert replies[1]["ok"] is False and "receive stream" in replies[1]["error"]
    assert replies[2]["ok"] is True  # the control port answers while the stream runs
    assert replies[3] == {"op": "recv_stream_stop", "ok": True, "seqs": list(range(1, 31)), "errors": []}
    assert replies[4]["ok"] is False
    assert len(peer.qp.posted) == 4  # every slot reposted


def test_receive_stream_records_errors_and_stops_on_timeout() -> None:
    peer = FakePeer(arrive=[1, 2, 3], fail_after=2)
    peer.recv_stream_start(slots=2)
    result = peer.recv_stream_stop(expect=3, timeout=0.3)
    assert result["seqs"] == [1, 2]
    assert result["errors"] == [f"wr {STREAM_WR}: WR_FLUSH_ERR"]
    with pytest.raises(Exception, match="1 to 16"):
        RecvStream(peer, 17)  # type: ignore[arg-type]


@pytest.fixture
def scripted_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    chunks: list[bytes] = []
    monkeypatch.setattr(peer_program.os, "read", lambda fd, n: chunks.pop(0) if chunks else b"")
    monkeypatch.setattr(peer_program.time, "sleep", lambda s: None)
    yield chunks


def test_read_lines_waits_out_eof_on_a_virtio_port(scripted_reads: list[bytes]) -> None:
    # EOF while the host end is away (a migration), then the rest of a line from the new host end
    scripted_reads += [b'{"op": "a"}\n{"op"', b"", b"", b': "b"}\n\n']
    lines = read_lines(3, reconnect=True)
    assert [next(lines), next(lines)] == ['{"op": "a"}', '{"op": "b"}']


def test_read_lines_ends_at_eof_on_stdin(scripted_reads: list[bytes]) -> None:
    scripted_reads += [b'{"op": "a"}\n', b"", b'{"op": "b"}\n']
    assert list(read_lines(0, reconnect=False)) == ['{"op": "a"}']
