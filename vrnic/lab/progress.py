"""A pytest run's progress, kept in a file so a run can resume after the lab guest under it died.

The lab guest (Debian's kernel under QEMU TCG) running nested KVM sometimes dies under the command: a panic,
a lockup, or the emulator gone. `vrnic lab run --rerun-on-guest-loss` then boots a new guest and runs the
command again; with `VRNIC_TEST_PROGRESS` pointing at this file, that second run skips every test that already
has an outcome. Only the test that was running when the guest died runs twice; a test that failed is never
run again, and its failure still fails the whole run.

A failure's report (pytest's text and what the test printed) goes to a second file beside it (failures_file):
pytest prints its failures at the session's end, which a guest that dies later never reaches.

One line per event: `start <nodeid>`, `<outcome> <nodeid>` (passed, failed, skipped), `hung <nodeid>` when the
lab's hang watch ended the command under it (vrnic/lab/hang_watch.py), or `faulted <nodeid>` when the test failed
while the emulator under it faulted (vrnic/lab/guest_faults.py); a test that hung or faulted has no outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ENV = "VRNIC_TEST_PROGRESS"
OUTCOMES = ("passed", "failed", "skipped")


@dataclass
class Progress:
    outcomes: dict[str, str] = field(default_factory=dict)  # nodeid -> its last outcome
    running: str | None = None  # the test started last and not finished: the one the guest died under
    hung: list[str] = field(default_factory=list)  # tests the hang watch ended the command under
    faulted: list[str] = field(default_factory=list)  # tests that failed while the emulator under them faulted

    @classmethod
    def parse(cls, text: str) -> Progress:
        progress = cls()
        # Whatever follows the last newline is a line the guest's death cut short.
        for line in text.split("\n")[:-1]:
            kind, _, nodeid = line.partition(" ")
            if kind == "start":
                progress.running = nodeid
            elif kind == "hung":
                progress.hung.append(nodeid)
            elif kind == "faulted":
                progress.faulted.append(nodeid)
            elif kind in OUTCOMES:
                # A failure in any phase (setup, call, teardown) sticks; a later "passed" does not clear it.
                if progress.outcomes.get(nodeid) != "failed":
                    progress.outcomes[nodeid] = kind
                if progress.running == nodeid:
                    progress.running = None
        return progress

    @classmethod
    def read(cls, path: Path) -> Progress:
        try:
            return cls.parse(path.read_text())
        except FileNotFoundError:
            return cls()

    @property
    def running_hung(self) -> bool:
        """The hang watch ended the command under the test running last."""
        return bool(self.hung) and self.hung[-1] == self.running

    @property
    def running_faulted(self) -> bool:
        """The test running last failed while the emulator under it faulted."""
        return bool(self.faulted) and self.faulted[-1] == self.running

    def summary(self, when: str) -> str:
        """One line: the test running at that moment and the outcomes so far."""
        failed = self.failed
        line = (f"{when}, {self.running} was running" if self.running else f"{when}, no test was running")
        line += f"; {len(self.outcomes)} test(s) had an outcome, {len(failed)} failed"
        return line + (": " + ", ".join(failed) if failed else "")

    @property
    def failed(self) -> list[str]:
        return [nodeid for nodeid, outcome in self.outcomes.items() if outcome == "failed"]


def outcome_of(when: str, outcome: str) -> str | None:
    """The line to record for one phase's report, or None when the phase says nothing new."""
    if outcome == "failed":
        return "failed"
    if outcome == "skipped":
        return "skipped"
    if when == "call":
        return "passed"
    return None  # a passing setup or teardown


def record(path: Path, kind: str, nodeid: str) -> None:
    # One small append per event; the line is on the host's disk (9p) before the next test starts.
    with path.open("a") as out:
        out.write(f"{kind} {nodeid}\n")


def failures_file(path: Path) -> Path:
    """Where the failures of the run whose progress is at path are reported."""
    return path.with_name(path.stem + ".failures.txt")


def record_failure(path: Path, nodeid: str, when: str, report: str, printed: str) -> None:
    """A failed phase's report, kept at once beside the progress file: what the test printed first, so that a
    report cut to its end (failure_reports) keeps the assertion."""
    with failures_file(path).open("a") as out:
        out.write(f"==== {nodeid} failed in {when}\n")
        if printed.strip():
            out.write(f"---- what it printed\n{printed.rstrip()}\n---- pytest's report\n")
        out.write(f"{report.rstrip()}\n")


def failure_reports(path: Path, max_lines: int = 80) -> str:
    """The failures reported so far, each cut to its last max_lines lines (where the assertion is); empty if none."""
    try:
        text = failures_file(path).read_text()
    except FileNotFoundError:
        return ""
    reports: list[list[str]] = []
    for line in text.rstrip("\n").split("\n"):
        if (line.startswith("==== ") and " failed in " in line) or not reports:
            reports.append([line])
        else:
            reports[-1].append(line)
    cut = [[head, *(body if len(body) <= max_lines else ["...", *body[-max_lines:]])]
           for head, *body in reports]
    return "\n".join(line for report in cut for line in report)
