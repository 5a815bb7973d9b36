"""Resuming a pytest run after the lab guest died (vrnic/lab/progress.py and the hooks in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vrnic.lab import progress

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

        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "2 passed, 2 deselected" in second.stdout
        assert "resuming after the lab guest died: 2 test(s) already ran (1 failed)" in second.stdout
        final = progress.Progress.read(progress_file)
        assert final.failed == [n for n in final.outcomes if n.endswith("::test_b")]
        assert final.outcomes[after_first.running] == "passed"
    finally:
        tests.unlink(missing_ok=True)
