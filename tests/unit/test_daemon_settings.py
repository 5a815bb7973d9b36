"""Daemon wiring: drivers by name with fallback, the operator token, CLI helpers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import typer
from pydantic import SecretStr, ValidationError

from vrnic.cli.client import ApiError, parse_pairs
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import build_backend, with_operator_token
from vrnic.errors import NotSupported


def test_backend_with_the_fake_driver_and_a_missing_one(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    settings = DaemonSettings(state_dir=tmp_path, paravirtual_driver="fake", sriov_driver="no-such-driver")
    with caplog.at_level(logging.INFO, logger="vrnic.daemon"):
        backend = build_backend(settings)
    assert backend.driver(VrnicMode.PARAVIRTUAL).name == "fake"
    with pytest.raises(NotSupported):
        backend.driver(VrnicMode.SRIOV)
    assert "mode sriov: driver 'no-such-driver' unavailable, mode disabled" in caplog.text
    assert "no RNIC driver 'no-such-driver'" in caplog.text


def test_a_driver_that_does_not_serve_the_mode_is_refused(caplog: pytest.LogCaptureFixture,
                                                          tmp_path: Path) -> None:
    settings = DaemonSettings(state_dir=tmp_path, paravirtual_driver=None, sriov_driver="fake")
    with caplog.at_level(logging.INFO, logger="vrnic.daemon"):
        backend = build_backend(settings)
    assert backend.devices() == []
    assert "mode sriov: driver 'fake' does not serve this mode" in caplog.text
    assert "mode paravirtual: disabled (no driver configured)" in caplog.text


def test_driver_options_reach_the_driver(tmp_path: Path) -> None:
    settings = DaemonSettings(state_dir=tmp_path, paravirtual_driver="fake", sriov_driver=None,
                              paravirtual_driver_options={"device_count": 3})
    assert [d.name for d in build_backend(settings).devices()] == ["fake0", "fake1", "fake2"]


def test_operator_token_is_generated_once_private_and_reused(tmp_path: Path) -> None:
    settings = DaemonSettings(state_dir=tmp_path / "state")
    first = with_operator_token(settings)
    assert first.operator_token is not None
    token = first.operator_token.get_secret_value()
    assert token.startswith("vro_")
    assert settings.operator_token_file.stat().st_mode & 0o777 == 0o600
    assert with_operator_token(settings).operator_token == first.operator_token
    configured = DaemonSettings(state_dir=tmp_path / "other", operator_token=SecretStr("mine"))
    assert with_operator_token(configured) is configured
    assert not (tmp_path / "other").exists()


def test_daemon_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VRNIC_PARAVIRTUAL_DRIVER", "fake")
    monkeypatch.setenv("VRNIC_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("VRNIC_LISTEN_PORT", "9999")
    settings = DaemonSettings()
    assert (settings.paravirtual_driver, settings.listen_port) == ("fake", 9999)
    assert settings.database == f"sqlite:///{tmp_path / 'vrnic.db'}"
    assert DaemonSettings(paravirtual_driver="x").sriov_driver == "sriov"


def test_cli_pairs_and_api_errors() -> None:
    assert parse_pairs(["max_qps=8", "max_mrs = 16"], "--quota") == {"max_qps": 8, "max_mrs": 16}
    with pytest.raises(typer.BadParameter):
        parse_pairs(["max_qps"], "--quota")
    with pytest.raises(typer.BadParameter):
        parse_pairs(["max_qps=lots"], "--quota")
    error = ApiError(409, {"code": "conflict", "detail": "cannot release", "current_state": "attached"})
    assert str(error) == "409 conflict: cannot release (current state: attached)"
    assert str(ApiError(502, {"detail": "Bad Gateway"})) == "502 error: Bad Gateway"


def test_daemon_settings_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VRNIC_DATABASE_URL", "VRNIC_PARAVIRTUAL_DRIVER", "VRNIC_LISTEN_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "vrnic.env"
    config.write_text("VRNIC_DATABASE_URL=postgresql+psycopg://vrnic@db/vrnic\nVRNIC_PARAVIRTUAL_DRIVER=fake\n"
                      "VRNIC_LISTEN_PORT=8555\n")
    settings = DaemonSettings(_env_file=config)  # what VRNIC_CONFIG=<file> selects
    assert settings.database == "postgresql+psycopg://vrnic@db/vrnic"
    assert (settings.paravirtual_driver, settings.listen_port) == ("fake", 8555)


def test_multi_host_settings_default_from_the_listen_address_and_the_operator_token(tmp_path: Path) -> None:
    settings = DaemonSettings(state_dir=tmp_path, listen_host="10.0.2.15", listen_port=9000,
                              operator_token=SecretStr("vro_op"), heartbeat_interval_s=0.5)
    assert settings.api_url == "http://10.0.2.15:9000"
    assert settings.agent_secret == "vro_op" and settings.down_after_s == 1.5
    advertised = settings.model_copy(update={"advertise_url": "http://node-a:8470/", "host_down_after_s": 4.0,
                                             "agent_token": SecretStr("vra_shared")})
    assert advertised.api_url == "http://node-a:8470" and advertised.down_after_s == 4.0
    assert advertised.agent_secret == "vra_shared"


def test_the_locator_and_agent_token_go_only_to_a_driver_that_takes_them(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import vrnic.daemon as daemon
    from vrnic.backend.drivers.fake import FakeDriver
    from vrnic.db.locator import DbLocator

    settings = DaemonSettings(state_dir=tmp_path, operator_token=SecretStr("vro_op"))
    assert daemon.multi_host_options(settings, "fake") == {}
    assert daemon.multi_host_options(settings, "no-such-driver") == {}

    class PeeringDriver(FakeDriver):
        def __init__(self, locator: object = None, agent_token: str | None = None) -> None:
            super().__init__()

    monkeypatch.setattr(daemon, "driver_class", lambda name: PeeringDriver)
    options = daemon.multi_host_options(settings, "verbs")
    assert set(options) == {"locator", "agent_token"} and options["agent_token"] == "vro_op"
    assert isinstance(options["locator"], DbLocator)
    options["locator"].db.engine.dispose()


@pytest.mark.parametrize("name", ["", "-a", "a%C0", "a/b", "a b", "a?b", "é"])
def test_a_host_name_that_would_not_survive_a_url_path_is_refused(tmp_path: Path, name: str) -> None:
    # GET /hosts/{name} takes the same pattern: a name with '%' would arrive decoded as another string.
    with pytest.raises(ValidationError, match="host_name"):
        DaemonSettings(state_dir=tmp_path, host_name=name)
    assert DaemonSettings(state_dir=tmp_path, host_name="lab_a.example-1").host_name == "lab_a.example-1"


def test_the_daemon_names_the_variable_of_a_bad_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from vrnic.cli.main import app

    monkeypatch.setenv("VRNIC_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("VRNIC_HOST_NAME", "(none)")  # what gethostname() gives on a machine never named
    for command in (["daemon"], ["db", "upgrade"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "VRNIC_HOST_NAME: String should match pattern" in result.output
        assert "(got '(none)')" in result.output
