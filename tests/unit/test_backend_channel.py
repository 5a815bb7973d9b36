"""The guest channel under idle, hostile and broken clients: real sockets, the real driver on the fake RNIC edge."""

from __future__ import annotations

import fcntl
import os
import resource
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from vrnic.backend.channel import ChannelLimits, group_id
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.session import GuestSession
from vrnic.core import framing
from vrnic.core.proto import BINARY_VERSION, HEADER, JSON_VERSION, MAGIC, MSGPACK_VERSION, VERSION, FrameDecoder, encode
from vrnic.core.recovery import token_digest
from vrnic.core.specs import AttachInfo, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.core.verb_args import Attach
from vrnic.frontend import CQ, MR, PD, ChannelLost, Context, InvalidArgument, NotFound, VrnicError
from vrnic.frontend.channel import WIRE_VERSION_ENV, UnixChannel

ARENA = 1 << 20


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., tuple[VerbsDriver, AttachInfo]]]:
    """A driver with the given channel limits and one vRNIC on it."""
    drivers: list[VerbsDriver] = []

    def make(**limits: object) -> tuple[VerbsDriver, AttachInfo]:
        drv = VerbsDriver(socket_path=tmp_path / f"vrnicd{len(drivers)}.sock", edge=FakeEdge(),
                          channel=ChannelLimits(**limits))  # type: ignore[arg-type]
        drivers.append(drv)
        spec = VrnicSpec(id=f"v{len(drivers)}", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, len(drivers)))
        return drv, drv.create_vrnic(spec, "fake0")

    yield make
    for drv in drivers:
        drv.close()


def connect(info: AttachInfo) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(info.socket_path or "")
    return sock


def request(sock: socket.socket, op: str, fds: list[int] | None = None, **args: object) -> dict[str, object]:
    socket.send_fds(sock, [encode({"id": 1, "op": op, "args": args})], fds or [])
    decoder = FrameDecoder()
    sock.settimeout(5)
    while True:
        data = sock.recv(65536)
        assert data, "vrnicd closed the connection instead of answering"
        messages = decoder.feed(data)
        if messages:
            return messages[0]


def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_silent_connection_is_closed_at_the_attach_deadline(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) \
        -> None:
    drv, info = serve(attach_deadline_s=0.3)
    idle = connect(info)
    started = time.monotonic()
    assert closed_by_server(idle)
    assert 0.25 <= time.monotonic() - started < 3
    assert drv.server.pending == 0


def test_a_bad_first_request_fails_alone_then_attach_works(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) \
        -> None:
    _, info = serve()
    sock = connect(info)
    reply = request(sock, "alloc_pd")
    assert reply["error"]["code"] == "invalid_argument"  # type: ignore[index]
    assert "first request must be attach" in reply["error"]["message"]  # type: ignore[index]
    reply = request(sock, "attach", token="not a token", fds=[os.eventfd(0), os.eventfd(0)])
    assert reply["error"]["code"] == "not_found"  # type: ignore[index]
    sock.close()
    with Context.attach(info, ARENA) as ctx:
        PD(ctx)


def test_a_framing_error_closes_the_stream(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    _, info = serve()
    sock = connect(info)
    sock.sendall(HEADER.pack(MAGIC ^ 1, VERSION, 0, 2) + b"{}")
    assert closed_by_server(sock)


def test_descriptors_of_a_failed_attach_are_closed(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    _, info = serve()
    before = open_fds()
    for _ in range(20):
        sock = connect(info)
        fds = [os.eventfd(0), os.eventfd(0)]  # not a memfd: the session refuses it
        reply = request(sock, "attach", token=info.token, fds=fds)
        assert reply["error"]["code"] == "invalid_argument"  # type: ignore[index]
        for fd in fds:
            os.close(fd)
        sock.close()
    deadline = time.monotonic() + 5
    while open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert open_fds() <= before, "vrnicd kept descriptors a failed attach passed it"


def test_internal_errors_reach_the_guest_only_as_a_reference(serve: Callable[..., tuple[VerbsDriver, AttachInfo]],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    _, info = serve()

    def bug(*_: object) -> dict[str, object]:
        raise KeyError("/secret/internal/state")

    with Context.attach(info, ARENA) as ctx:
        monkeypatch.setattr(GuestSession, "op_alloc_pd", bug)
        with pytest.raises(VrnicError) as caught:
            PD(ctx)
        message = str(caught.value)
        assert message.startswith("internal error (ref ") and "secret" not in message
        ref = message.removeprefix("internal error (ref ").rstrip(")")
        assert f"ref {ref}" in caplog.text and "/secret/internal/state" in caplog.text
        monkeypatch.undo()
        PD(ctx)  # the session survives a failed request


def test_detach_and_disconnect(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    drv, info = serve()
    with Context.attach(info, ARENA) as ctx:
        CQ(ctx, 8)
        assert drv.attached_ids() == {info.vrnic_id}
    assert drv.attached_ids() == set()
    with Context.attach(info, ARENA) as ctx:
        session = drv.registry.by_token(info.token or "").session
        assert isinstance(session, GuestSession)
        threading.Thread(target=session.disconnect).start()  # what a failing engine does, from its thread
        with pytest.raises((VrnicError, OSError)):
            for _ in range(100):
                ctx.call("query_device")
                time.sleep(0.01)
    deadline = time.monotonic() + 5
    while drv.attached_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drv.attached_ids() == set()


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _guest_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "vrnic-guest"}


def test_guest_threads_wait_for_the_next_guests_a_few_at_most_and_end_with_the_server(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    """Starting a thread was 0.9 ms of each attach in the lab (issue 14): one waits from the start, and a thread
    whose guest left serves the next one. At most KEPT_THREADS wait; stopping ends them all."""
    from vrnic.backend.channel import KEPT_THREADS

    before = _guest_threads()
    drv, info = serve()
    [waiting] = _guest_threads() - before
    for _ in range(3):
        _wait_until(lambda: drv.server.waiting_threads == 1)  # the last guest's thread is back
        with Context.attach(info, ARENA):
            assert _guest_threads() - before == {waiting}  # no thread started for this guest
    others = [drv.create_vrnic(VrnicSpec(id=f"w{n}", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 50 + n)),
                               "fake0") for n in range(KEPT_THREADS + 2)]
    contexts = [Context.attach(other, ARENA) for other in others]  # at once: one waits, the rest get new threads
    # a quick attach is answered before its thread is handed the guest, so the last thread may start just after
    _wait_until(lambda: len(_guest_threads() - before) == KEPT_THREADS + 2)
    for ctx in contexts:
        ctx.close()
    _wait_until(lambda: drv.server.waiting_threads == KEPT_THREADS)
    _wait_until(lambda: len(_guest_threads() - before) == KEPT_THREADS)  # the others ended with their guests
    with Context.attach(info, ARENA) as ctx:
        PD(ctx)
    drv.server.stop()
    assert not _guest_threads() - before


def test_a_guest_that_detaches_and_attaches_at_once_finds_its_thread_waiting(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    """The thread joins those waiting before it answers the detach, so the guest's next attach, however quick,
    starts no thread."""
    before = _guest_threads()
    drv, info = serve()
    [waiting] = _guest_threads() - before
    opener = drv.server.open_session

    def slow_to_finish(*args: Any) -> Any:  # what the thread does after the detach's reply takes a while
        session = opener(*args)
        close = session.close
        calls = []

        def close_slowly() -> None:
            calls.append(1)
            close()
            if len(calls) > 1:
                time.sleep(0.05)
        session.close = close_slowly
        return session

    drv.server.open_session = slow_to_finish
    for _ in range(5):
        with Context.attach(info, ARENA) as ctx:
            PD(ctx)
            assert _guest_threads() - before == {waiting}
    _wait_until(lambda: drv.server.waiting_threads == 1)


def test_after_a_quiet_while_one_guest_thread_still_waits(serve: Callable[..., tuple[VerbsDriver, AttachInfo]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import vrnic.backend.channel as channel

    monkeypatch.setattr(channel, "KEPT_THREAD_IDLE_S", 0.05)
    before = _guest_threads()
    drv, _ = serve()
    infos = [drv.create_vrnic(VrnicSpec(id=f"q{n}", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 70 + n)),
                              "fake0") for n in range(3)]
    for ctx in [Context.attach(info, ARENA) for info in infos]:
        ctx.close()
    _wait_until(lambda: len(_guest_threads() - before) == 1)
    time.sleep(0.2)  # several waits ran out meanwhile
    assert len(_guest_threads() - before) == 1 and drv.server.waiting_threads == 1
    with Context.attach(infos[0], ARENA) as ctx:  # and it serves
        PD(ctx)
        assert len(_guest_threads() - before) == 1


def test_the_socket_gets_the_mode_and_group_operators_set(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) \
        -> None:
    _, info = serve(socket_mode=0o640, socket_gid=os.getgid() + 1)
    st = os.stat(info.socket_path or "")
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_gid == os.getgid() + 1
    assert not [p for p in Path(info.socket_path or "").parent.iterdir() if p.name.startswith(".vrnicd-")]


def test_the_oldest_idle_connection_of_a_uid_makes_room(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) \
        -> None:
    drv, info = serve(max_pending_per_uid=4, attach_deadline_s=30)
    idle = [connect(info) for _ in range(4)]
    deadline = time.monotonic() + 5
    while drv.server.pending < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    newest = connect(info)
    assert closed_by_server(idle[0]), "the oldest idle connection goes"
    assert not closed_by_server(idle[1], timeout=0.2)
    with Context.attach(info, ARENA) as ctx:  # a real guest still gets in
        PD(ctx)
    for sock in [*idle, newest]:
        sock.close()


def _openers(drv: VerbsDriver) -> list[str]:
    """From now on, the name of each thread that opens a session on drv, in order."""
    names: list[str] = []
    opener = drv.server.open_session

    def recording(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return opener(*args)
    drv.server.open_session = recording
    return names


def test_an_attach_that_opens_no_device_is_answered_by_the_selector_thread(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    """A shared-ring vRNIC whose device context waits idle: the selector opens the session and answers, so the
    attach waits for no thread to wake (issue 14); the guest's thread serves what follows."""
    drv, info = serve()
    names = _openers(drv)
    assert drv.idle_contexts.holds(info.vrnic_id)
    for _ in range(2):
        with Context.attach(info, ARENA) as ctx:
            PD(ctx).close()
            MR(PD(ctx), 4096, 0).close()
    assert names == ["vrnic-channel", "vrnic-channel"]


def test_an_attach_that_must_open_its_device_is_opened_by_the_guest_thread(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    """With no idle context the attach opens a device, which can block: never on the selector, which every other
    guest's accept waits on. Its clean detach leaves the context idle, so the next attach is quick again."""
    drv, info = serve()
    drv.idle_contexts.drop(info.vrnic_id)
    names = _openers(drv)
    for _ in range(2):
        with Context.attach(info, ARENA) as ctx:
            PD(ctx)
    assert names == ["vrnic-guest", "vrnic-channel"]


def test_an_attach_with_an_unknown_token_is_refused_by_the_selector_and_costs_no_thread(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    """A token that matches nothing is refused before any memory or device is touched, so the selector answers it
    and no guest thread is taken or started for it (the direct engine's attach, which is not quick, is checked in
    the lab: tests/kernel/test_direct_confinement.py)."""
    drv, info = serve()
    assert drv.opens_quickly(Attach(token=info.token or ""))
    assert drv.opens_quickly(Attach(token="not a token"))
    names = _openers(drv)
    before = _guest_threads()
    _wait_until(lambda: drv.server.waiting_threads == 1)
    for _ in range(3):
        sock = connect(info)
        reply = request(sock, "attach", token="not a token", fds=[os.eventfd(0), os.eventfd(0)])
        assert reply["error"]["code"] == "not_found"  # type: ignore[index]
        sock.close()
    assert names == ["vrnic-channel"] * 3
    assert _guest_threads() == before and drv.server.waiting_threads == 1


def test_a_guest_that_cannot_take_its_attach_answer_at_once_is_dropped_and_leaves_nothing(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The selector answers a quick attach on a non-blocking socket. A guest that never read its earlier answers
    (its buffer full) would hold the selector, so it is dropped, its session closed, and the vRNIC stays free."""
    import vrnic.backend.channel as channel

    drv, info = serve(attach_deadline_s=30)
    names = _openers(drv)
    sock = connect(info)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    flood = encode({"id": 1, "op": "alloc_pd", "args": {}}) * 4000  # each gets an error answer, none is read
    sock.sendall(flood)
    memfd = os.memfd_create("arena", os.MFD_ALLOW_SEALING)  # an arena vrnicd accepts, as the frontend makes it
    os.ftruncate(memfd, ARENA)
    fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    fds = [memfd, os.eventfd(0), os.eventfd(0)]
    answered: list[bool] = []
    send_now = channel._send_now
    monkeypatch.setattr(channel, "_send_now", lambda *args: answered.append(send_now(*args)) or answered[-1])
    socket.send_fds(sock, [encode({"id": 2, "op": "attach", "args": {"token": info.token}})], fds)
    _wait_until(lambda: bool(answered))  # read nothing until then: reading makes room for the answer
    assert names == ["vrnic-channel"] and answered == [False]  # opened, then the answer could not go out
    assert closed_by_server(sock, timeout=10)
    assert drv.registry.get(info.vrnic_id).session is None
    for fd in fds:
        os.close(fd)
    sock.close()
    with Context.attach(info, ARENA) as ctx:  # the vRNIC is free for the next guest
        PD(ctx)


def test_a_session_cap(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    drv, info = serve(max_sessions=1)
    other = drv.create_vrnic(VrnicSpec(id="second", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 99)),
                             "fake0")
    with Context.attach(info, ARENA), pytest.raises(VrnicError, match="serves 1 guests at most"):
        Context.attach(other, ARENA)


def test_1000_idle_connections_from_one_user_do_not_starve_a_real_guest(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    drv, info = serve()  # the default limits
    threads_before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for i in range(1000):
            sock = connect(info)
            if i % 2:
                sock.send(HEADER.pack(MAGIC, VERSION, 0, 100)[:5])  # half a header, then nothing
            idle.append(sock)
        assert threading.active_count() <= threads_before + 1, "idle connections must not cost threads"
        started = time.monotonic()
        with Context.attach(info, ARENA) as ctx:
            pd = PD(ctx)
            MR(pd, 4096)
            CQ(ctx, 16)
            assert ctx.call("query_device")["quota_used"]["mr"] == 1 + ctx.spare_mr_count
        elapsed = time.monotonic() - started
        assert elapsed < 5, f"a real guest waited {elapsed:.1f} s behind idle connections"
        assert drv.server.pending <= ChannelLimits().max_pending_per_uid
        assert threading.active_count() <= threads_before + 2  # the guest's thread, the engine's (both gone soon)
        survivors = sum(1 for sock in idle[-40:] if not closed_by_server(sock, timeout=0.01))
        assert survivors <= ChannelLimits().max_pending_per_uid
    finally:
        for sock in idle:
            sock.close()


def test_a_refused_attach_is_a_typed_error_for_the_guest(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) \
        -> None:
    drv, info = serve()
    drv.release_vrnic(info.vrnic_id)
    with pytest.raises(NotFound):
        Context.attach(info, ARENA)


def test_at_the_total_cap_the_uid_holding_the_most_pays(serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) \
        -> None:
    drv, info = serve(max_pending_per_uid=100, max_pending_total=4, attach_deadline_s=30)
    server = drv.server
    # Two "users" in one test process: pretend the first two connections came from another uid.
    first = [connect(info) for _ in range(2)]
    deadline = time.monotonic() + 5
    while server.pending < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    for pending in list(server._pending.values()):
        object.__setattr__(pending, "cred", type(pending.cred)(pending.cred.pid, 4242, pending.cred.gid))
    mine = [connect(info) for _ in range(3)]  # the third of mine hits the total cap of 4
    assert closed_by_server(mine[0]), "my own oldest goes: I hold the most"
    assert not any(closed_by_server(sock, timeout=0.1) for sock in first), "the other user keeps both"
    for sock in [*first, *mine]:
        sock.close()


def test_the_socket_group_is_a_name_or_a_number() -> None:
    assert group_id(None) is None
    assert group_id("4242") == 4242
    assert group_id("root") == 0
    with pytest.raises(InvalidArgument, match="no group 'no-such-group-xyz'"):
        group_id("no-such-group-xyz")


def test_a_reissued_token_attaches_and_the_old_one_no_longer_does(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    drv, info = serve()
    new = drv.reissue_token(info.vrnic_id)
    assert new != info.token
    with pytest.raises(NotFound):
        Context.attach(info, ARENA)
    with Context.attach(info.model_copy(update={"token": new}), ARENA) as ctx:
        assert ctx.query_device() is not None
    with pytest.raises(NotFound):
        drv.reissue_token("no-such-vrnic")


def test_a_restarted_vrnicd_takes_the_same_token_and_the_old_guest_gets_a_clear_error(tmp_path: Path) -> None:
    """vrnicd dies under an attached guest: the guest's next call is ChannelLost; a new vrnicd that holds the
    vRNIC again (crash recovery: same spec, the token's digest from the database) lets it attach and rebuild."""
    spec = VrnicSpec(id="v1", tenant="t", vpc_id=1, virtual_gid=make_virtual_gid(1, 1))
    socket_path = tmp_path / "vrnicd.sock"
    first = VerbsDriver(socket_path=socket_path, edge=FakeEdge())
    info = first.create_vrnic(spec, "fake0")
    ctx = Context.attach(info, ARENA)
    PD(ctx)
    first.close()  # what the kernel does to a killed vrnicd's sockets
    with pytest.raises(ChannelLost, match="attach again with the same token"):
        CQ(ctx, 4)  # a request (a PD would come from the frontend's pool without one)
    ctx.close()
    second = VerbsDriver(socket_path=socket_path, edge=FakeEdge())
    try:
        second.restore_vrnic(spec, "fake0", token_digest(info.token or ""))
        with Context.attach(info, ARENA) as again:
            cq = CQ(again, 4)
            assert cq is not None and second.attached_ids() == {"v1"}
        with pytest.raises(NotFound):
            Context.attach(info.model_copy(update={"token": "not the token"}), ARENA)
    finally:
        second.close()


def replies_with_versions(sock: socket.socket, count: int) -> list[tuple[int, dict[str, Any]]]:
    decoder = FrameDecoder()
    sock.settimeout(5)
    got: list[tuple[int, dict[str, Any]]] = []
    while len(got) < count:
        data = sock.recv(65536)
        assert data, "vrnicd closed the connection instead of answering"
        got += decoder.feed_frames(data)
    return got


def test_each_request_is_answered_in_its_own_protocol_version(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    _, info = serve()
    sock = connect(info)
    versions = [JSON_VERSION, BINARY_VERSION, MSGPACK_VERSION, JSON_VERSION]
    sock.sendall(b"".join(encode({"id": i, "op": "alloc_pd", "args": {}}, version)
                          for i, version in enumerate(versions, 1)))  # one write, so one read takes them all
    replies = replies_with_versions(sock, 4)
    assert [(version, reply["id"]) for version, reply in replies] == list(zip(versions, [1, 2, 3, 4], strict=True))
    assert all("first request must be attach" in reply["error"]["message"] for _, reply in replies)
    sock.close()


@pytest.mark.parametrize("version", [JSON_VERSION, BINARY_VERSION, MSGPACK_VERSION])
def test_a_guest_attaches_and_works_in_any_version(serve: Callable[..., tuple[VerbsDriver, AttachInfo]],
                                                      monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    _, info = serve()
    monkeypatch.setenv(WIRE_VERSION_ENV, str(version))
    with Context.attach(info, ARENA) as ctx:
        assert ctx.channel is not None and ctx.channel.version == version
        assert ctx.channel._decoder.version == version  # the attach reply came back in it
        pd = PD(ctx)
        CQ(ctx, 8)
        MR(pd, 4096)
        assert ctx.channel._decoder.version == version
        with pytest.raises(NotFound):
            ctx.call("dealloc_pd", pd=pd.handle + 1)


def test_a_bad_version_2_body_is_answered_in_version_2_and_ends_the_stream(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    _, info = serve()
    sock = connect(info)
    sock.sendall(HEADER.pack(MAGIC, BINARY_VERSION, 0, 3) + b"\xb1\x01\x01")  # an int where a key belongs
    [(version, reply)] = replies_with_versions(sock, 1)
    assert version == BINARY_VERSION
    assert reply["error"]["code"] == "protocol_error"
    assert "a dict key must be a str, not an int" in reply["error"]["message"]
    assert closed_by_server(sock)


def test_an_unsupported_version_is_answered_in_version_1_naming_those_spoken(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    _, info = serve()
    sock = connect(info)
    sock.sendall(HEADER.pack(MAGIC, 4, 0, 2) + b"{}")
    [(version, reply)] = replies_with_versions(sock, 1)
    assert version == JSON_VERSION  # what any peer reads
    assert reply["error"]["message"] == "unsupported protocol version 4 (this end speaks 1, 2 and 3)"
    assert closed_by_server(sock)


def test_a_guest_steps_down_to_version_2_for_a_vrnicd_that_speaks_1_and_2(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest library upgraded before vrnicd: vrnicd refuses version 3 at the attach and closes the stream; the
    guest connects again and attaches in version 2, and stays there. Played by this vrnicd with its decoder
    taught the older list of versions."""
    _, info = serve()
    monkeypatch.delenv(WIRE_VERSION_ENV, raising=False)
    monkeypatch.setattr(framing, "VERSIONS", (JSON_VERSION, BINARY_VERSION))
    monkeypatch.setattr(framing, "_SPOKEN", "1 and 2")
    with Context.attach(info, ARENA) as ctx:
        assert ctx.channel is not None and ctx.channel.version == BINARY_VERSION
        assert ctx.channel._decoder.version == BINARY_VERSION  # the attach reply came in it
        pd = PD(ctx)
        MR(pd, 4096)
        assert ctx.query_port()["gid_tbl_len"] == 1
    # Asked for by name, version 3 is not traded for another: the refusal is the caller's
    monkeypatch.setenv(WIRE_VERSION_ENV, str(MSGPACK_VERSION))
    with pytest.raises(InvalidArgument, match=r"unsupported protocol version 3 \(this end speaks 1 and 2\)"):
        Context.attach(info, ARENA)


def test_a_bad_version_3_body_is_answered_in_version_3_and_ends_the_stream(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]]) -> None:
    _, info = serve()
    sock = connect(info)
    body = b"\x81\x01\x01"  # {1: 1}: an int where a key belongs
    sock.sendall(HEADER.pack(MAGIC, MSGPACK_VERSION, 0, len(body)) + body)
    [(version, reply)] = replies_with_versions(sock, 1)
    assert version == MSGPACK_VERSION
    assert reply["error"]["code"] == "protocol_error"
    assert "not a version 3 message" in reply["error"]["message"]
    assert closed_by_server(sock)


@pytest.mark.parametrize(("args", "code", "says"), [
    ({"pd": b"\x01"}, "invalid_argument", "pd"),  # bytes: version 2 has no word for them, the schema refuses
    ({"pd": (1 << 64) - 1}, "not_found", ""),  # past int64: a handle that is no one's
    ({"pd": float("nan")}, "invalid_argument", "pd"),
    ({"pd": msgpack.Timestamp(1, 0)}, "invalid_argument", "pd"),  # msgpack's extension -1, which it reads itself
    ({"pd": 1, "extra": [[[[1]]]]}, "invalid_argument", "extra"),
])
def test_values_only_version_3_carries_are_refused_by_the_verbs_schema_and_the_guest_goes_on(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]], monkeypatch: pytest.MonkeyPatch,
        args: dict[str, Any], code: str, says: str) -> None:
    """What a version 3 body decodes to but a version 2 one cannot hold meets dealloc_pd's argument schema: a
    typed error for that request, and the session lives on."""
    _, info = serve()
    monkeypatch.setenv(WIRE_VERSION_ENV, str(MSGPACK_VERSION))
    with Context.attach(info, ARENA) as ctx:
        channel = ctx.open_channel()
        assert isinstance(channel, UnixChannel)
        body = msgpack.packb({"id": 77, "op": "dealloc_pd", "args": args})
        channel._send(HEADER.pack(MAGIC, MSGPACK_VERSION, 0, len(body)) + body, None)
        reply = channel._read_reply(77)
        assert reply["ok"] is False and reply["error"]["code"] == code
        assert says in reply["error"]["message"]
        PD(ctx).close()  # the channel and the session are fine


def test_a_repeated_key_in_a_version_3_body_keeps_its_last_value(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]], monkeypatch: pytest.MonkeyPatch) -> None:
    """As in version 1 (JSON): the map's last value of the key counts."""
    _, info = serve()
    monkeypatch.setenv(WIRE_VERSION_ENV, str(MSGPACK_VERSION))
    with Context.attach(info, ARENA) as ctx:
        channel = ctx.open_channel()
        assert isinstance(channel, UnixChannel)
        # {"id": 78, "op": "query_port", "args": {"port": 9, "port": 1}}
        body = b"\x83\xa2id\x4e\xa2op\xaaquery_port\xa4args\x82\xa4port\x09\xa4port\x01"
        channel._send(HEADER.pack(MAGIC, MSGPACK_VERSION, 0, len(body)) + body, None)
        reply = channel._read_reply(78)
        assert reply["ok"] is True and reply["result"]["gid_tbl_len"] == 1  # port 9 would have been refused


def _new_fds(before: set[str]) -> set[str]:
    """Descriptors open now that were not before, once vrnicd's threads (in this process) have closed the
    connection they accepted: whatever stays past 5 s was leaked."""
    deadline = time.monotonic() + 5
    while (new := set(os.listdir("/proc/self/fd")) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new


def test_a_guest_connects_before_it_builds_its_arena_and_leaves_nothing_when_either_fails(
        serve: Callable[..., tuple[VerbsDriver, AttachInfo]], tmp_path: Path) -> None:
    """The frontend connects first, so that vrnicd accepts while the guest builds its arena (issue 14): an arena
    it cannot build closes that connection at once, and a vrnicd it cannot reach costs it no arena."""
    drv, info = serve(attach_deadline_s=30)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(InvalidArgument, match="number of pages"):
        Context(info.socket_path or "", info.token or "", arena_bytes=100)
    assert _new_fds(before) == set()  # the guest's socket, and the one vrnicd accepted (closed by the guest)
    # vrnicd may accept the closed connection only now (it waited in the listen backlog): it must drop it at once
    deadline = time.monotonic() + 5
    while drv.server.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drv.server.pending == 0 and _new_fds(before) == set()
    with pytest.raises(VrnicError, match="cannot reach vrnicd"):
        Context(str(tmp_path / "nobody.sock"), info.token or "", arena_bytes=ARENA)
    assert _new_fds(before) == set()
    with Context.attach(info, ARENA) as ctx:  # and a guest that can do both attaches as ever
        assert ctx.vrnic_id == info.vrnic_id
