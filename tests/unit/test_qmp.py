"""vrnic.lab.qmp: QMP message parsing, and the client against a fake QMP server on a Unix socket."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vrnic.errors import LabError
from vrnic.lab.qmp import QmpClient, encode_command, kind, parse_message, result_of, split_lines

pytestmark = pytest.mark.unit


def test_encode_command() -> None:
    assert json.loads(encode_command("query-status", None, 3)) == {"execute": "query-status", "id": 3}
    assert json.loads(encode_command("migrate", {"uri": "unix:/x"}, 4)) == {
        "execute": "migrate", "id": 4, "arguments": {"uri": "unix:/x"}}
    assert encode_command("quit", {}, 1).endswith(b"\n")


def test_split_lines_keeps_the_unfinished_rest() -> None:
    assert split_lines(b'{"a": 1}\r\n{"b": 2}\r\n{"c"') == ([b'{"a": 1}', b'{"b": 2}'], b'{"c"')
    assert split_lines(b"") == ([], b"")


def test_kinds_and_results() -> None:
    assert kind({"QMP": {"version": {}}}) == "greeting"
    assert kind({"event": "STOP", "timestamp": {}}) == "event"
    assert kind({"return": {}, "id": 1}) == "return"
    assert kind({"error": {"class": "GenericError", "desc": "no"}}) == "error"
    with pytest.raises(LabError):
        kind({"what": 1})
    assert result_of("query-status", {"return": {"status": "running"}}) == {"status": "running"}
    with pytest.raises(LabError, match=r"QMP migrate: no route \(GenericError\)"):
        result_of("migrate", {"error": {"class": "GenericError", "desc": "no route"}})


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]"])
def test_parse_message_rejects(line: bytes) -> None:
    with pytest.raises(LabError):
        parse_message(line)


class FakeQmp:
    """Greets, answers qmp_capabilities, query-status (with an event before the reply), fail (an error)."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.commands: list[dict[str, object]] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        conn, _ = self.server.accept()
        with conn, conn.makefile("rwb") as f:
            f.write(b'{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}\r\n')
            f.flush()
            for line in f:
                command = json.loads(line)
                self.commands.append(command)
                name, request_id = command["execute"], command["id"]
                if name == "query-status":
                    # an event and the reply in one write, the reply split mid-object
                    reply = (b'{"event": "MIGRATION", "data": {"status": "setup"}}\r\n'
                             + json.dumps({"return": {"status": "running"}, "id": request_id}).encode() + b"\r\n")
                    f.write(reply[:70])
                    f.flush()
                    f.write(reply[70:])
                elif name == "bye":  # answers, then QEMU ends: its last event is left unread on the socket
                    f.write(json.dumps({"return": {}, "id": request_id}).encode() + b"\r\n"
                            + b'{"event": "SHUTDOWN", "data": {"guest": true, "reason": "guest-reset"}}\r\n')
                    f.flush()
                    return
                elif name == "fail":
                    f.write(json.dumps({"error": {"class": "GenericError", "desc": "nope"},
                                        "id": request_id}).encode() + b"\r\n")
                else:
                    f.write(json.dumps({"return": {}, "id": request_id}).encode() + b"\r\n")
                f.flush()


@pytest.fixture
def qmp(tmp_path: Path) -> Iterator[tuple[QmpClient, FakeQmp]]:
    server = FakeQmp(tmp_path / "qmp.sock")
    client = QmpClient(tmp_path / "qmp.sock", timeout=5)
    yield client, server
    client.close()
    server.server.close()


def test_client_negotiates_executes_and_keeps_events(qmp: tuple[QmpClient, FakeQmp]) -> None:
    client, server = qmp
    assert client.greeting["version"] == {"qemu": {"major": 7}}
    assert client.execute("query-status") == {"status": "running"}
    assert client.events == [{"event": "MIGRATION", "data": {"status": "setup"}}]
    with pytest.raises(LabError, match="nope"):
        client.execute("fail")
    assert client.execute("migrate", uri="unix:/m") == {}
    assert server.commands[0]["execute"] == "qmp_capabilities"
    assert server.commands[-1]["arguments"] == {"uri": "unix:/m"}
    assert client.wait_event("MIGRATION", timeout=1)["data"] == {"status": "setup"}
    assert client.events == []
    with pytest.raises(LabError, match="did not answer"):
        client.wait_event("NEVER", timeout=0.1)


def test_client_commands_from_two_threads_get_their_own_replies(qmp: tuple[QmpClient, FakeQmp]) -> None:
    client, _ = qmp
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.extend(client.execute("query-status") for _ in range(20)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [{"status": "running"}] * 60


def test_client_gives_up_without_a_socket(tmp_path: Path) -> None:
    with pytest.raises(LabError, match="no QMP socket"):
        QmpClient(tmp_path / "absent.sock", connect_timeout=0.1)


def test_drain_reads_the_events_left_after_qemu_ended(qmp: tuple[QmpClient, FakeQmp]) -> None:
    client, server = qmp
    assert client.execute("bye") == {}
    server.thread.join(5)
    shutdown = {"event": "SHUTDOWN", "data": {"guest": True, "reason": "guest-reset"}}
    deadline = time.monotonic() + 5
    while shutdown not in client.drain() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.drain() == [shutdown]  # read once, kept
