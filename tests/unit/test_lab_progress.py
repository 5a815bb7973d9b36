"""Resuming a pytest run after the lab guest died (vrnic/lab/progress.py and the hooks in tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vrnic.lab import guest_faults, hang_watch, progress
from vrnic.lab.guest import EXIT_GUEST_LOST

ROOT = Path(__file__).resolve().parents[2]


def test_parse_keeps_outcomes_and_the_test_that_was_running() -> None:
    text = "\n".join([
        "start a.py::t1", "passed a.py::t1",
        "start a.py::t2", "failed a.py::t2", "passed a.py::t2",  # a teardown after a failed call: still failed
        "start a.py::t3", "skipped a.py::t3",
        "start a.py::t4", "passed a.py::",  # the guest died while writing; t4 had no outcome
    ])
    p = progress.Progress.parse(text)
    assert p.outcomes == {"a.py::t1": "passed", "a.py::t2": "failed", "a.py::t3": "skipped"}
    assert p.failed == ["a.py::t2"]
    assert p.running == "a.py::t4"
    assert p.hung == []
    assert progress.Progress.parse("start a.py::t1\nhung a.py::t1\n").hung == ["a.py::t1"]


def test_summary_names_the_running_test_and_the_failures() -> None:
    p = progress.Progress.parse("start a.py::t1\nfailed a.py::t1\nstart a.py::t2\n")
    assert p.summary("when the lab timed out") == (
        "when the lab timed out, a.py::t2 was running; 1 test(s) had an outcome, 1 failed: a.py::t1")
    assert progress.Progress().summary("then") == "then, no test was running; 0 test(s) had an outcome, 0 failed"


def test_outcome_of_phases() -> None:
    assert progress.outcome_of("setup", "passed") is None
    assert progress.outcome_of("call", "passed") == "passed"
    assert progress.outcome_of("teardown", "passed") is None
    assert progress.outcome_of("setup", "skipped") == "skipped"
    assert progress.outcome_of("teardown", "failed") == "failed"


def test_a_second_run_skips_what_the_first_decided(tmp_path: Path) -> None:
    """Two real pytest runs under this repository's conftest: the first 'dies' in the middle (os._exit, as a
    guest that vanishes leaves no session end); the second runs only the test that was running and the rest."""
    tests = ROOT / "tests" / "unit" / f"_resume_probe_{os.getpid()}_test.py"
    marker = tmp_path / "died-once"
    tests.write_text(
        "import os\n"
        "from pathlib import Path\n"
        "def test_a(): pass\n"
        "def test_b(): assert False\n"
        f"def test_c():\n    m = Path({str(marker)!r})\n"
        "    if not m.exists():\n        m.write_text('x'); os._exit(99)\n"
        "def test_d(): pass\n"
    )
    progress_file = tmp_path / "progress.txt"
    env = os.environ | {progress.ENV: str(progress_file), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tests)]
    try:
        first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 99, first.stdout + first.stderr
        after_first = progress.Progress.read(progress_file)
        assert after_first.running is not None and after_first.running.endswith("::test_c")
        assert sorted(n.rsplit("::", 1)[1] for n in after_first.outcomes) == ["test_a", "test_b"]
        # test_b's report was kept when it failed: the first run never reached pytest's summary
        reports = progress.failure_reports(progress_file)
        assert reports.startswith(f"==== {tests.relative_to(ROOT)}::test_b failed in call\n"), reports
        assert "assert False" in reports and "---- what it printed" not in reports

        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "2 passed, 2 deselected" in second.stdout
        assert "resuming after the lab guest died: 2 test(s) already ran (1 failed)" in second.stdout
        final = progress.Progress.read(progress_file)
        assert final.failed == [n for n in final.outcomes if n.endswith("::test_b")]
        assert final.outcomes[after_first.running] == "passed"
    finally:
        tests.unlink(missing_ok=True)


def test_a_hung_test_ends_the_command_as_a_lost_guest_and_runs_again(tmp_path: Path) -> None:
    """The lab's hang watch (vrnic/lab/hang_watch.py) in two real pytest runs: a test that sleeps past the watch
    gets its stack printed, `hung` recorded and the command ended with the lost-guest status; the next run
    (as `vrnic lab run --rerun-on-guest-loss` starts it) runs only that test and what came after it."""
    tests = ROOT / "tests" / "unit" / f"_hang_probe_{os.getpid()}_test.py"
    marker = tmp_path / "hung-once"
    tests.write_text(
        "import time\n"
        "from pathlib import Path\n"
        "def test_a(): pass\n"
        f"def test_stuck_somewhere():\n    m = Path({str(marker)!r})\n"
        "    if not m.exists():\n        m.write_text('x'); print('about to hang'); time.sleep(60)\n"
        "def test_after(): pass\n"
    )
    progress_file = tmp_path / "progress.txt"
    env = os.environ | {progress.ENV: str(progress_file), "PYTHONPATH": str(ROOT), "VRNIC_LAB": "1",
                        "VRNIC_HANG_WATCH_S": "2"}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tests)]
    try:
        first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == EXIT_GUEST_LOST, first.stdout + first.stderr
        assert "test_stuck_somewhere (call) made no progress for 2 s" in first.stderr
        assert "in test_stuck_somewhere" in first.stderr  # the stuck thread's Python stack
        assert "printed before it hung:\nabout to hang" in first.stderr  # what pytest had captured
        assert "[hang-watch] kernel log" in first.stderr or "[hang-watch] dmesg" in first.stderr
        after_first = progress.Progress.read(progress_file)
        assert after_first.running is not None and after_first.running.endswith("::test_stuck_somewhere")
        assert after_first.hung == [after_first.running]
        assert list(after_first.outcomes.values()) == ["passed"]  # test_a

        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "2 passed, 1 deselected" in second.stdout
        assert "[hang-watch]" not in second.stderr  # each phase disarms the watch when it ends
    finally:
        tests.unlink(missing_ok=True)


def test_a_hang_that_holds_the_gil_is_ended_by_the_backstop_process(tmp_path: Path) -> None:
    """A test stuck in a C call that keeps the GIL (ctypes.PyDLL, as pyverbs' calls into the kernel do) stops the
    in-process watch's timer; the backstop process still names it, has it print its Python stack, shows its
    threads' kernel stacks, records `hung` and kills it, and `vrnic lab run` counts that as a lost guest."""
    tests = ROOT / "tests" / "unit" / f"_gil_probe_{os.getpid()}_test.py"
    tests.write_text(
        "import ctypes\n"
        "def test_a(): pass\n"
        # system() waits for its child again after a signal: the dump's signal cannot end this call
        "def test_holds_the_gil():\n    ctypes.PyDLL(None).system(b'exec sleep 60 </dev/null >/dev/null 2>&1')\n"
    )
    progress_file = tmp_path / "progress.txt"
    env = os.environ | {progress.ENV: str(progress_file), "PYTHONPATH": str(ROOT), "VRNIC_LAB": "1",
                        "VRNIC_HANG_WATCH_S": "2", hang_watch.BACKSTOP_GRACE_ENV: "1", "VRNIC_HANG_REBOOT": "0"}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tests)]
    try:
        started = time.monotonic()
        run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
        assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
        assert time.monotonic() - started < 30  # not the 60 s sleep
        assert "test_holds_the_gil (call) made no progress for 3 s and its process runs no Python" in run.stderr
        assert "in test_holds_the_gil" in run.stderr  # the Python stack, printed from the C signal handler
        assert "[hang-watch] thread " in run.stderr and " wchan " in run.stderr
        assert "[hang-watch] killing the test process" in run.stderr
        done = progress.Progress.read(progress_file)
        assert done.running is not None and done.running.endswith("::test_holds_the_gil")
        assert done.hung == [done.running] and list(done.outcomes.values()) == ["passed"]
        assert done.running_hung  # what makes `vrnic lab run` run it once more in a new guest
    finally:
        tests.unlink(missing_ok=True)


def test_the_backstop_is_quiet_while_each_phase_ends_in_time(tmp_path: Path) -> None:
    """Armed and disarmed over its pipe, the backstop never fires, and it ends with the process it watches."""
    progress_file = tmp_path / "progress.txt"
    watcher = subprocess.Popen([sys.executable, "-m", "vrnic.lab.hang_watch", "--pid", str(os.getpid()),
                                "--progress", str(progress_file), "--after", "0.5"],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert watcher.stdin is not None and watcher.stderr is not None
    for phase in ("setup", "call", "teardown"):
        watcher.stdin.write(f"arm {phase} tests/x.py::test_x\n")
        watcher.stdin.flush()
        time.sleep(0.2)
        watcher.stdin.write("disarm\n")
        watcher.stdin.flush()
    time.sleep(0.8)  # past the bound: disarmed, nothing fires
    watcher.stdin.close()
    assert watcher.wait(10) == 0
    assert watcher.stderr.read() == ""
    assert not progress_file.exists()


def test_blocked_tasks_show_the_kernel_stacks_of_tasks_in_d_state(tmp_path: Path) -> None:
    for pid, tid, state in ((10, 10, "S"), (10, 11, "D"), (12, 12, "R")):
        task = tmp_path / str(pid) / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "stat").write_text(f"{tid} (qemu (vcpu) x) {state} 1 2 3\n")
        (task / "stack").write_text(f"[<0>] stack_of_{tid}+0x1/0x2\n")
    shown = hang_watch.blocked_tasks(tmp_path)
    assert shown == "[hang-watch] task 11 (qemu (vcpu) x) in D state:\n[<0>] stack_of_11+0x1/0x2\n"
    assert hang_watch.blocked_tasks(tmp_path / "none") == "[hang-watch] no task in D state\n"


def test_emulator_faults_are_the_kernel_oops_and_qemu_crash_lines_only() -> None:
    kernel = ["[ 12.0] rxe0: added veth0", "[ 50.0] Out of memory: Killed process 900 (qemu-system-x86)",
              "[ 99.1] BUG: TASK stack guard page was hit at 00000000a1 (stack is 00000000b2..00000000c3)",
              "[ 99.2] qemu-system-x86[812]: segfault at 8 ip 000055d5 sp 00007ffd error 4 in qemu-system-x86_64"]
    qemu = {"vm-a.log": "2026-11-24 char device redirected\n2026-11-24 shutting down, reason=destroyed\n",
            "vm-b.log": "KVM internal error. Suberror: 1\n2026-11-24 shutting down, reason=crashed\n"}
    assert guest_faults.faults(kernel, qemu) == [
        "lab kernel: " + kernel[1], "lab kernel: " + kernel[2], "lab kernel: " + kernel[3],
        "vm-b.log: KVM internal error. Suberror: 1", "vm-b.log: 2026-11-24 shutting down, reason=crashed"]
    assert guest_faults.faults(kernel[:1], {"vm-a.log": qemu["vm-a.log"]}) == []  # a destroy is no fault


def test_log_mark_sees_only_what_came_after_it(tmp_path: Path) -> None:
    kernel = ["[1] BUG: soft lockup - CPU#0 stuck for 22s!", "[2] ok"]
    (tmp_path / "old.log").write_text("shutting down, reason=crashed\n")  # a crash before the test: not its
    mark = guest_faults.LogMark.now(lambda: kernel, tmp_path)
    assert mark.faults(lambda: kernel, tmp_path) == []
    with (tmp_path / "old.log").open("a") as log:
        log.write("starting up\n")
    (tmp_path / "new.log").write_text("shutting down, reason=crashed\n")
    assert mark.faults(lambda: [*kernel, "[3] general protection fault, probably for non-canonical address"],
                       tmp_path) == ["lab kernel: [3] general protection fault, probably for non-canonical address",
                                     "new.log: shutting down, reason=crashed"]
    # a kernel ring buffer that wrapped (shorter than the mark): all of it is new
    assert mark.faults(lambda: ["[9] Oops: 0000 [#1] SMP"], tmp_path)[0] == "lab kernel: [9] Oops: 0000 [#1] SMP"


def test_a_nested_guest_console_shows_a_fault_when_its_kernel_stalled_or_oopsed() -> None:
    console = ("[    0.8] Run /init as init process\nvrnic-vm: ready\n"
               "[  212.4] watchdog: BUG: soft lockup - CPU#0 stuck for 134s! [python3:88]\n"
               "[  214.0] rcu: INFO: rcu_sched self-detected stall on CPU\n"
               "[  300.1] INFO: task kworker/0:1:40 blocked for more than 120 seconds.\n")
    assert guest_faults.faults([], {}, {"t0/console.log": console, "t1/vm.console.log": "vrnic-vm: ready\n"}) == [
        "nested console t0/console.log: [  212.4] watchdog: BUG: soft lockup - CPU#0 stuck for 134s! [python3:88]",
        "nested console t0/console.log: [  214.0] rcu: INFO: rcu_sched self-detected stall on CPU",
        "nested console t0/console.log: [  300.1] INFO: task kworker/0:1:40 blocked for more than 120 seconds."]
    # the lab kernel's own RCU stall is the emulator's too
    assert guest_faults.faults(["[9] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:"], {}) == [
        "lab kernel: [9] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:"]


def test_log_mark_reads_only_the_nested_consoles_new_lines(tmp_path: Path) -> None:
    """Consoles anywhere under the root (each test's tmp_path): one that was there keeps its old lines out, one that
    appeared since counts whole; other files are not consoles."""
    logs = tmp_path / "qemu"
    logs.mkdir()
    old = tmp_path / "test_a0" / "console.log"
    old.parent.mkdir()
    old.write_text("[1] BUG: soft lockup - CPU#0 stuck for 30s!\n")  # an earlier test's VM: not this test's
    mark = guest_faults.LogMark.now(lambda: [], logs, console_root=tmp_path)
    assert mark.faults(lambda: [], logs) == []
    with old.open("a") as console:
        console.write("[2] ok\n[3] Kernel panic - not syncing: Fatal exception\n")
    new = tmp_path / "test_b0" / "attempt1" / "vm-b.console.log"
    new.parent.mkdir(parents=True)
    new.write_text("[4] rcu: INFO: rcu_sched detected stalls on CPUs/tasks:\n")
    (tmp_path / "test_b0" / "notes.log").write_text("[5] soft lockup\n")
    assert mark.faults(lambda: [], logs) == [
        "nested console test_a0/console.log: [3] Kernel panic - not syncing: Fatal exception",
        "nested console test_b0/attempt1/vm-b.console.log: [4] rcu: INFO: rcu_sched detected stalls on CPUs/tasks:"]
    assert guest_faults.LogMark.now(lambda: [], logs).faults(lambda: [], logs) == []  # no root: no consoles


def test_a_test_failing_on_an_emulator_fault_ends_the_command_as_a_lost_guest(tmp_path: Path) -> None:
    """Three real pytest runs: a test fails while a nested QEMU's log says it crashed, so its failure is printed,
    `faulted` recorded and the command ended with the lost-guest status; the next run runs it again (it
    passes) and what came after it, where a test fails while a nested guest's console (in its tmp_path) shows a
    soft lockup: the same again. A plain failure, with no fault logged, stays a failure."""
    tests = ROOT / "tests" / "unit" / f"_fault_probe_{os.getpid()}_test.py"
    marker = tmp_path / "crashed-once"
    logs = tmp_path / "qemu-logs"
    logs.mkdir()
    tests.write_text(
        "from pathlib import Path\n"
        "def test_a(): pass\n"
        f"def test_nested_vm():\n    m = Path({str(marker)!r})\n"
        "    if not m.exists():\n        m.write_text('x'); print('the VM went away')\n"
        f"        Path({str(logs / 'vm.log')!r}).write_text('shutting down, reason=crashed\\n')\n"
        "        raise ConnectionError('control port closed')\n"
        f"def test_nested_vm_stalls(tmp_path):\n    m = Path({str(marker)!r} + '-stall')\n"
        "    if not m.exists():\n        m.write_text('x')\n"
        "        lockup = '[99.0] watchdog: BUG: soft lockup - CPU#1 stuck for 130s!\\n'\n"
        "        (tmp_path / 'console.log').write_text(lockup)\n"
        "        raise TimeoutError('no reply from the VM program within 120 s')\n"
        "def test_plain_failure(): assert 1 == 2\n"
    )
    progress_file = tmp_path / "progress.txt"
    env = os.environ | {progress.ENV: str(progress_file), "PYTHONPATH": str(ROOT), "VRNIC_LAB": "1",
                        guest_faults.LOG_DIR_ENV: str(logs)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tests)]
    try:
        first = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == EXIT_GUEST_LOST, first.stdout + first.stderr
        assert "ConnectionError: control port closed" in first.stderr
        assert "what it printed:\nthe VM went away" in first.stderr
        assert "vm.log: shutting down, reason=crashed" in first.stderr
        after_first = progress.Progress.read(progress_file)
        assert after_first.running is not None and after_first.running.endswith("::test_nested_vm")
        assert after_first.faulted == [after_first.running]
        assert list(after_first.outcomes.values()) == ["passed"]  # test_a

        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == EXIT_GUEST_LOST, second.stdout + second.stderr
        assert "TimeoutError: no reply from the VM program" in second.stderr
        assert "console.log: [99.0] watchdog: BUG: soft lockup - CPU#1 stuck for 130s!" in second.stderr
        after_second = progress.Progress.read(progress_file)
        assert after_second.running is not None and after_second.running.endswith("::test_nested_vm_stalls")
        assert after_second.faulted == [after_first.running, after_second.running]

        third = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert third.returncode == 1, third.stdout + third.stderr
        assert "1 failed, 1 passed, 2 deselected" in third.stdout
        assert "[guest-faults]" not in third.stderr
        final = progress.Progress.read(progress_file)
        assert final.outcomes[after_first.running] == "passed"
        assert final.outcomes[after_second.running] == "passed"
        assert [n.rsplit("::", 1)[1] for n in final.failed] == ["test_plain_failure"]
    finally:
        tests.unlink(missing_ok=True)


def test_failure_reports_keep_each_reports_end_and_what_it_printed(tmp_path: Path) -> None:
    path = tmp_path / "progress.txt"
    assert progress.failure_reports(path) == ""
    long_report = "\n".join(f"line {n}" for n in range(100)) + "\nE   assert 1 == 2"
    progress.record_failure(path, "a.py::t1", "call", long_report, "uncapped: 4.2 MB/s\n")
    progress.record_failure(path, "a.py::t2", "teardown", "E   kernel objects leaked", "")
    assert progress.failures_file(path) == tmp_path / "progress.failures.txt"
    reports = progress.failure_reports(path, max_lines=5)
    assert reports.split("\n") == [
        "==== a.py::t1 failed in call", "...", "line 96", "line 97", "line 98", "line 99", "E   assert 1 == 2",
        "==== a.py::t2 failed in teardown", "E   kernel objects leaked"]
    assert progress.failure_reports(path, max_lines=200).split("\n")[:5] == [
        "==== a.py::t1 failed in call", "---- what it printed", "uncapped: 4.2 MB/s", "---- pytest's report", "line 0"]


def test_a_rerun_shows_what_failed_in_the_guest_that_died(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The new guest passes what was left; the run still fails for the test that failed in the first one, and
    that test's report, kept when it failed, is shown (pytest's own summary died with the guest)."""
    from vrnic.cli.lab import _rerun

    class NewGuest:
        panicked = None

        def run(self, request: object) -> int:
            return 0

    path = tmp_path / "progress.txt"
    path.write_text("start a.py::t1\nfailed a.py::t1\nstart a.py::t2\n")
    progress.record_failure(path, "a.py::t1", "call", "E   assert 9 == 0", "uncapped: 4.2 MB/s")
    assert _rerun(NewGuest(), object(), path) == 1  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "1 test(s) failed before the guest died: a.py::t1; as reported then" in err
    assert ("==== a.py::t1 failed in call\n---- what it printed\nuncapped: 4.2 MB/s\n---- pytest's report\n"
            "E   assert 9 == 0") in err


class _GuestsThatDie:
    """A lab runner whose first `deaths` guests die under the command (exit 126) and the next one passes."""
    panicked = None

    def __init__(self, deaths: int) -> None:
        self.deaths, self.runs = deaths, 0

    def run(self, request: object) -> int:
        self.runs += 1
        return 126 if self.runs <= self.deaths else 0


@pytest.mark.parametrize(("deaths", "runs", "rc"), [(0, 1, 0), (1, 2, 0), (2, 3, 0), (3, 3, 126), (9, 3, 126)])
def test_a_lost_guest_gets_at_most_two_new_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 deaths: int, runs: int, rc: int) -> None:
    """Nested KVM has killed two lab guests in a row under one test: the third guest runs it. A command that
    kills every guest fails with the lost guest's exit status after three."""
    from vrnic.cli.lab import GUEST_LOSS_RERUNS, _rerun_on_guest_loss

    assert GUEST_LOSS_RERUNS == 2
    path = tmp_path / "progress.txt"
    path.write_text("start a.py::t1\npassed a.py::t1\nstart a.py::t2\n")
    guests = _GuestsThatDie(deaths)
    assert _rerun_on_guest_loss(guests, object(), path, guests.run(object())) == rc  # type: ignore[arg-type]
    assert guests.runs == runs
    err = capsys.readouterr().err
    assert [f"rerun {n} of 2" in err for n in (1, 2)] == [runs > 1, runs > 2]
