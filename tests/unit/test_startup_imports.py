"""What the daemon's and the CLI's start import: the lab runs them under TCG, where each big library is seconds.

`vrnic daemon` and every `vrnic ...` call import the top-level command; it loads a command group only when that
group runs. The API checks the schema without Alembic, and documents its problem answers without a validator per
route.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from vrnic.cli.main import SUBCOMMANDS, app
from vrnic.vm.domain_xml import VRNIC_NS

pytestmark = pytest.mark.unit


def modules_after(statement: str) -> set[str]:
    """The top-level packages a fresh interpreter holds after statement."""
    out = subprocess.run([sys.executable, "-c", f"{statement}\nimport json, sys\n"
                          "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_the_top_level_command_loads_no_command_group_and_no_heavy_library() -> None:
    loaded = modules_after("import vrnic.cli.main")
    assert not loaded & {"alembic", "httpx", "fastapi", "pyroute2", "libvirt", "pyverbs", "uvicorn"}


def test_each_command_group_loads_by_name_and_all_are_listed() -> None:
    runner = CliRunner()
    listing = runner.invoke(app, ["--help"], prog_name="vrnic")
    assert listing.exit_code == 0, listing.output
    for name in [*SUBCOMMANDS, "daemon"]:
        assert f" {name} " in listing.output, name
    for name in SUBCOMMANDS:
        result = runner.invoke(app, [name, "--help"], prog_name="vrnic")
        assert result.exit_code == 0, (name, result.output)
        assert f"vrnic {name} [OPTIONS] COMMAND" in " ".join(result.output.split()), (name, result.output)
    unknown = runner.invoke(app, ["no-such-group"])
    assert unknown.exit_code == 2 and "No such command" in unknown.output


def test_the_api_app_and_its_schema_check_do_not_load_alembic_or_httpx() -> None:
    """httpx (and with it its command line's rich) loads when the daemon first reaches another host's agent."""
    loaded = modules_after("import vrnic.api.app\nimport vrnic.db.schema")
    assert not loaded & {"alembic", "httpx"}


@pytest.mark.parametrize(("op", "with_vrnic"), [("start", True), ("restore", True), ("prepare", False)])
def test_a_hook_call_with_nothing_to_do_imports_neither_httpx_nor_pydantic(op: str, with_vrnic: bool) -> None:
    """libvirtd waits for the hook at every op of every domain: start and restore have nothing for vrnic, and
    neither has any op of a domain without vRNICs (stopped and release excepted)."""
    metadata = (f"<metadata><v:vrnics xmlns:v='{VRNIC_NS}'><v:vrnic id='vr-1'/></v:vrnics></metadata>"
                if with_vrnic else "")
    xml = f"<domain type='kvm' id='3'><name>d</name>{metadata}</domain>"
    args = ["d", op, "begin", "-"]
    loaded = modules_after("from vrnic.vm.hook import main, parse_hook_call\n"
                           f"assert len(parse_hook_call({args!r}, {xml!r}).vrnics) == {int(with_vrnic)}\n"
                           f"assert main(['--', *{args!r}], stdin={xml!r}) == 0")
    assert not loaded & {"httpx", "pydantic", "pydantic_core"}
