"""A benchmark's vrnicd child runs the vrnic its parent runs, not a `vrnic` package in the child's working
directory (which `python -m` would put first on sys.path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import vrnic
from vrnic.lab.latency import this_code_env

pytestmark = pytest.mark.unit

WHICH = "import vrnic; print(vrnic.__file__)"


@pytest.fixture
def other_tree(tmp_path: Path) -> Path:
    """A working directory holding another `vrnic` package."""
    (tmp_path / "vrnic").mkdir()
    (tmp_path / "vrnic" / "__init__.py").write_text("")
    return tmp_path


def _child_imports(cwd: Path, env: dict[str, str] | None) -> Path:
    out = subprocess.run([sys.executable, "-c", WHICH], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).resolve()


def test_a_child_left_alone_imports_the_vrnic_of_its_working_directory(other_tree: Path) -> None:
    """The hazard itself, so the test below proves something."""
    assert _child_imports(other_tree, None) == (other_tree / "vrnic" / "__init__.py").resolve()


def test_this_code_env_makes_the_child_import_this_process_vrnic(other_tree: Path) -> None:
    assert _child_imports(other_tree, this_code_env()) == Path(vrnic.__file__).resolve()


def test_this_code_env_keeps_the_callers_pythonpath_after_this_tree() -> None:
    env = this_code_env({"PYTHONPATH": "/somewhere/else", "HOME": "/root"})
    root = str(Path(vrnic.__file__).resolve().parent.parent)
    assert env["PYTHONPATH"].split(":") == [root, "/somewhere/else"]
    assert env["PYTHONSAFEPATH"] == "1"
    assert env["HOME"] == "/root"
