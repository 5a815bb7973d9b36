"""The two-hosts rig's control server and client over real TCP on 127.0.0.1, with real child programs
(what host a asks of host b in the lab; here both ends are this process)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from vrnic.errors import LabError
from vrnic.lab.two_hosts.control import ControlClient, HostControl, _Server

ECHO = [sys.executable, "-c", "import sys\nfor line in sys.stdin: print(line.strip().upper(), flush=True)"]


@pytest.fixture
def control() -> Iterator[tuple[HostControl, ControlClient]]:
    host = HostControl()
    server = _Server(("127.0.0.1", 0), host)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = ControlClient.connect("127.0.0.1", server.server_address[1], wait_s=10)
    yield host, client
    client.close()
    server.shutdown()
    server.server_close()
    host.close()


def test_a_line_driven_program_answers_line_by_line(control: tuple[HostControl, ControlClient]) -> None:
    _, client = control
    child = client.call("spawn", argv=ECHO, stdin=True)["id"]
    client.call("write", id=child, text="hello\n")
    assert client.call("readline", id=child, timeout=30)["line"] == "HELLO\n"
    client.call("write", id=child, text="again\n")
    assert client.call("readline", id=child, timeout=30)["line"] == "AGAIN\n"
    client.call("signal", id=child, signal=15)
    ended = client.call("wait", id=child, timeout=30)
    assert ended["running"] is False and ended["rc"] == -15
    with pytest.raises(LabError, match="no child"):
        client.call("readline", id=child)


def test_run_returns_output_and_kills_what_overstays(control: tuple[HostControl, ControlClient]) -> None:
    _, client = control
    done = client.call("run", argv=[sys.executable, "-c", "print('out'); import sys; sys.exit(3)"], timeout=30)
    assert (done["rc"], done["stdout"]) == (3, "out\n")
    slow = client.call("run", argv=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert slow["timed_out"] is True and slow["rc"] == -9


def test_errors_come_back_as_lab_errors_and_done_sets_the_exit_code(
        control: tuple[HostControl, ControlClient]) -> None:
    host, client = control
    with pytest.raises(LabError, match="unknown op 'reboot'"):
        client.call("reboot")
    with pytest.raises(LabError, match="FileNotFoundError"):
        client.call("spawn", argv=["/nonexistent/program"])
    assert client.call("agent.status")["running"] is False  # no agent started: nothing to report
    client.call("done", rc=7)
    assert host.finished.is_set() and host.rc == 7
