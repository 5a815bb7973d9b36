"""`vrnic hook install|uninstall`: idempotent, and a hook that was there before keeps running first."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from vrnic.cli.main import app
from vrnic.vm.hook import MARKER

runner = CliRunner()


def _install(hooks: Path) -> str:
    result = runner.invoke(app, ["hook", "install", "--hooks-dir", str(hooks), "--api-url", "http://127.0.0.1:1",
                                 "--token-file", "/var/lib/vrnic/operator-token", "--log", "/run/hook.log"])
    assert result.exit_code == 0, result.output
    return result.output


def test_install_is_idempotent_and_uninstall_removes_it(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    assert "installed" in _install(hooks)
    text = (hooks / "qemu").read_text()
    assert MARKER in text and "-m vrnic.vm.hook" in text and "VRNIC_API_URL=http://127.0.0.1:1" in text
    assert (hooks / "qemu").stat().st_mode & 0o111
    assert "up to date" in _install(hooks)
    assert (hooks / "qemu").read_text() == text
    assert sorted(p.name for p in hooks.iterdir()) == ["qemu"]
    assert "removed" in runner.invoke(app, ["hook", "uninstall", "--hooks-dir", str(hooks)]).output
    assert not (hooks / "qemu").exists()


def test_a_foreign_hook_is_chained_and_restored(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    foreign = "#!/bin/sh\nexit 0\n"
    (hooks / "qemu").write_text(foreign)
    assert "kept the existing hook" in _install(hooks)
    assert (hooks / "qemu.vrnic-chained").read_text() == foreign
    assert str(hooks / "qemu.vrnic-chained") in (hooks / "qemu").read_text()
    again = _install(hooks)  # ours is recognised: the chained one is not wrapped twice
    assert "up to date" in again and (hooks / "qemu.vrnic-chained").read_text() == foreign
    assert "restored" in runner.invoke(app, ["hook", "uninstall", "--hooks-dir", str(hooks)]).output
    assert (hooks / "qemu").read_text() == foreign and not (hooks / "qemu.vrnic-chained").exists()
    assert "not vrnic's" in runner.invoke(app, ["hook", "uninstall", "--hooks-dir", str(hooks)]).output
