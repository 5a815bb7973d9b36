"""Test tiers: the directory a test lives in is its marker.

unit: pure logic; api: real database; kernel: real RDMA/netlink (inside the
lab); libvirt: a real libvirtd with QEMU on the host; two_hosts: the lab's
two-hosts topology (tests/two_hosts/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Generator
from pathlib import Path

import pytest

from vrnic.lab import hang_watch, progress
from vrnic.lab.guest import EXIT_GUEST_LOST
from vrnic.lab.guest_faults import LogMark
from vrnic.lab.hang_watch import Backstop, HangWatch

TIERS = ("unit", "api", "kernel", "libvirt", "two_hosts")


def _have_rdma() -> bool:
    path = Path("/sys/class/infiniband")
    return path.exists() and any(path.iterdir())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    no_rdma = pytest.mark.skip(reason="needs an RDMA device: runs inside the lab "
                                      "(`vrnic lab run -- pytest -m kernel`, as `make test` does)")
    for item in items:
        tier = item.path.relative_to(root).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "kernel" and not _have_rdma():
            item.add_marker(no_rdma)
    _resume(config, items)


def _progress_file() -> Path | None:
    path = os.environ.get(progress.ENV)
    return Path(path) if path else None


def _resume(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out what an earlier run in a lab guest that died already decided (vrnic/lab/progress.py)."""
    path = _progress_file()
    if path is None:
        return
    done = progress.Progress.read(path)
    if not done.outcomes:
        return
    keep = [item for item in items if item.nodeid not in done.outcomes]
    left_out = [item for item in items if item.nodeid in done.outcomes]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"resuming after the lab guest died: {len(left_out)} test(s) already ran "
                                f"({len(done.failed)} failed), {done.running or 'none'} was running")


_WATCH: HangWatch | None = None  # inside the lab, with a progress file: a test phase that hangs ends the command
_BACKSTOP: Backstop | None = None  # the same from another process, for a hang that holds the GIL
_MARK: LogMark | None = None  # where the lab's kernel and QEMU logs ended when the running test's call began


def pytest_configure(config: pytest.Config) -> None:
    global _WATCH, _BACKSTOP
    path = _progress_file()
    if path is None or os.environ.get("VRNIC_LAB") != "1":
        return

    def uncapture() -> str:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is None:
            return ""
        out, err = capture.read_global_capture()
        capture.suspend_global_capture(in_=False)  # the real stdout and stderr again
        return out + err

    _WATCH = HangWatch(path, uncapture=uncapture)
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        console = os.fdopen(os.dup(2), "w", buffering=1)  # the real stderr, which the backstop writes to
    grace = float(os.environ.get(hang_watch.BACKSTOP_GRACE_ENV, hang_watch.BACKSTOP_GRACE_S))
    _BACKSTOP = Backstop(path, _WATCH.after_s + grace, console, reboot=os.environ.get("VRNIC_HANG_REBOOT") != "0")


def _watched(item: pytest.Item, when: str) -> Generator[None, object, object]:
    if _WATCH is None:
        return (yield)
    _WATCH.arm(item.nodeid, when)
    if _BACKSTOP is not None:
        _BACKSTOP.arm(item.nodeid, when)
    try:
        return (yield)
    finally:
        _WATCH.disarm()
        if _BACKSTOP is not None:
            _BACKSTOP.disarm()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    global _MARK
    _MARK = None
    if _WATCH is not None:
        # The nested guests' consoles are under the session's temporary directory (tmp_path and its factory's).
        factory = getattr(item.config, "_tmp_path_factory", None)
        _MARK = LogMark.now(console_root=factory.getbasetemp() if factory is not None else None)
    return (yield from _watched(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    """Inside the lab: a test that failed while the emulator under it faulted ends the command as a lost guest,
    so that `--rerun-on-guest-loss` runs it once more in a new guest (vrnic/lab/guest_faults.py)."""
    report = yield
    path = _progress_file()
    if (_MARK is None or path is None or call.when != "call" or not isinstance(report, pytest.TestReport)
            or not report.failed):
        return report
    found = _MARK.faults()
    if not found:
        return report
    printed = (_WATCH.uncapture() if _WATCH is not None else "") + report.capstdout + report.capstderr
    err = sys.stderr
    err.write(f"\n[guest-faults] {item.nodeid} failed:\n{report.longreprtext}\n")
    if printed:
        err.write(f"[guest-faults] what it printed:\n{printed}\n")
    err.write("[guest-faults] while it ran, the emulator under it faulted:\n"
              + "".join(f"  {line}\n" for line in found))
    err.write(f"[guest-faults] ending the command as a lost guest (exit {EXIT_GUEST_LOST})\n")
    err.flush()
    progress.record(path, "faulted", item.nodeid)
    os._exit(EXIT_GUEST_LOST)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _watched(item, "teardown"))


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    path = _progress_file()
    if path is not None:
        progress.record(path, "start", nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = _progress_file()
    kind = progress.outcome_of(report.when, report.outcome) if path is not None else None
    if path is not None and kind is not None:
        progress.record(path, kind, report.nodeid)
        if kind == "failed":
            progress.record_failure(path, report.nodeid, report.when, report.longreprtext,
                                    report.capstdout + report.capstderr)


@pytest.fixture
def in_lab() -> bool:
    return os.environ.get("VRNIC_LAB") == "1"
