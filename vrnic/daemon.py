"""`vrnic daemon`: one process per host running the backend (vrnicd) and the REST API.

The API reaches this host's backend only through BackendService, built here from drivers loaded by name
(entry points), and other hosts' backends through their agents' /agent/v1 routes (vrnic.backend.remote).
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import SecretStr

from vrnic.backend.channel import ChannelLimits, group_id
from vrnic.backend.descriptors import raise_descriptor_limit
from vrnic.backend.driver import RnicDriver, driver_class, load_driver
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.errors import VrnicError

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("vrnic.daemon")


def build_backend(settings: DaemonSettings) -> BackendService:
    """A BackendService with the configured driver per mode; a mode whose driver is missing is left out."""
    drivers: dict[VrnicMode, RnicDriver] = {}
    wanted = ((VrnicMode.PARAVIRTUAL, settings.paravirtual_driver, settings.paravirtual_driver_options),
              (VrnicMode.SRIOV, settings.sriov_driver, settings.sriov_driver_options))
    for mode, name, options in wanted:
        if not name:
            log.info("mode %s: disabled (no driver configured)", mode)
            continue
        if mode is VrnicMode.PARAVIRTUAL and name == "verbs":
            options = {"channel": channel_limits(settings), "direct_containment": settings.direct_containment,
                       "packet_guard": settings.packet_guard, "strict_isolation": settings.strict_isolation,
                       "qos_link_mbps": settings.qos_link_mbps, **multi_host_options(settings, name),
                       **options}
        try:
            driver = build_sriov_driver(settings, options) if mode is VrnicMode.SRIOV and name == "sriov" \
                else load_driver(name, **options)
        except (VrnicError, ImportError, OSError) as exc:
            log.warning("mode %s: driver %r unavailable, mode disabled: %s", mode, name, exc)
            continue
        if mode not in driver.modes:
            log.warning("mode %s: driver %r does not serve this mode (it serves %s), mode disabled",
                        mode, name, ", ".join(sorted(driver.modes)))
            driver.close()
            continue
        log.info("mode %s: driver %s, devices: %s", mode, name,
                 ", ".join(d.name for d in driver.devices()) or "none")
        drivers[mode] = driver
    return BackendService(drivers)


def multi_host_options(settings: DaemonSettings, name: str) -> dict[str, Any]:
    """What a driver needs to reach vRNICs on other hosts, for the options its constructor takes: `locator` (the
    shared database, vrnic.db.locator.DbLocator) and `agent_token` (for other hosts' /agent/v1 routes)."""
    try:
        accepted = inspect.signature(driver_class(name)).parameters
    except (VrnicError, ImportError, OSError, TypeError, ValueError):
        return {}  # load_driver reports a missing driver
    options: dict[str, Any] = {}
    if "locator" in accepted:
        from vrnic.db.engine import make_engine
        from vrnic.db.locator import DbLocator

        options["locator"] = DbLocator(make_engine(settings.database))
    if "agent_token" in accepted:
        options["agent_token"] = settings.agent_secret
    return options


def channel_limits(settings: DaemonSettings) -> ChannelLimits:
    """The guest channel's socket permissions and caps from the settings; an unknown group is an error."""
    return ChannelLimits(attach_deadline_s=settings.channel_attach_deadline_s,
                         max_pending_per_uid=settings.channel_max_pending_per_uid,
                         max_pending_total=settings.channel_max_pending_total,
                         max_sessions=settings.channel_max_sessions, socket_mode=settings.channel_socket_mode,
                         socket_gid=group_id(settings.channel_socket_group))


def build_sriov_driver(settings: DaemonSettings, options: dict[str, Any]) -> RnicDriver:
    """The sriov driver with its desired state in the database (sriov_vfs) and its events in the audit log.

    No reconcile thread of its own: the API runs the passes (at startup and every
    settings.sriov_reconcile_interval seconds) inside its write transactions, so they queue behind other
    writes instead of contending for the database (SQLite has one writer) while holding the VF lock.
    """
    from vrnic.backend.drivers.sriov import SriovDriver
    from vrnic.db.engine import make_engine
    from vrnic.db.vf_store import DbVfEventLog, DbVfStateStore
    from vrnic.sriov.manager import SriovManager

    unknown = set(options) - {"release_on_close", "reconcile_interval"}
    if unknown:
        raise VrnicError(f"unknown sriov driver option(s): {', '.join(sorted(unknown))}")
    if "reconcile_interval" in options:
        log.warning("sriov driver option reconcile_interval is ignored: set VRNIC_SRIOV_RECONCILE_INTERVAL")
    engine = make_engine(settings.database)
    store = DbVfStateStore(engine, settings.host_name)
    manager = SriovManager(store=store, on_event=DbVfEventLog(store))
    return SriovDriver(manager=manager, release_on_close=bool(options.get("release_on_close", False)))


def with_operator_token(settings: DaemonSettings) -> DaemonSettings:
    """settings with an operator token: the configured one, else one kept in state_dir/operator-token."""
    if settings.operator_token is not None:
        return settings
    path = settings.operator_token_file
    if path.exists():
        token = path.read_text().strip()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        token = "vro_" + secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        log.info("generated the operator token into %s", path)
    return settings.model_copy(update={"operator_token": SecretStr(token)})


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its shutdown, killing the process before the backend is torn
    down; here a signal only asks the server to stop, and run() returns normally."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def build_app(settings: DaemonSettings, backend: BackendService) -> FastAPI:
    from vrnic.api.app import create_app  # FastAPI and SQLAlchemy load only when the API is wanted

    return create_app(settings, backend, api_url=settings.api_url)


def run(settings: DaemonSettings) -> None:
    """Serve until SIGINT/SIGTERM; SchemaOutOfDate (naming `vrnic db upgrade`) before anything starts."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_descriptor_limit()
    settings = with_operator_token(settings)
    from vrnic.db.engine import make_engine
    from vrnic.db.schema import check_schema

    checked = make_engine(settings.database)
    try:
        check_schema(checked)  # before any driver touches a device
    finally:
        checked.dispose()
    backend = build_backend(settings)
    try:
        app = build_app(settings, backend)
        log.info("API on http://%s:%d/api/v1 (database %s)", settings.listen_host, settings.listen_port,
                 settings.database.split("@")[-1])
        # Startup objects (FastAPI, pydantic and SQLAlchemy structures) never die: keep them out of the
        # cyclic GC, whose full collections otherwise stalled every request for ~100 ms now and then. No
        # collection first: one here found nothing to free and took 88 ms on the host, seconds under TCG.
        gc.freeze()
        signal.signal(signal.SIGUSR1, _debug_dump)
        # ws="none": the API has no WebSocket route, and loading a WebSocket implementation costs start-up time
        _Server(uvicorn.Config(app, host=settings.listen_host, port=settings.listen_port, ws="none",
                               log_level=settings.log_level, access_log=False)).run()
    finally:
        held = len(backend.vrnic_ids())
        backend.close()  # backend state lives in this process: tear it down rather than leak it
        log.info("stopped; released the backend state of %d vRNIC(s)", held)


def _debug_dump(*_: object) -> None:
    """SIGUSR1: every thread's stack and every guest session's engine and QPs, into the log (a stalled data
    path is looked at from outside, e.g. by bench.multihost)."""
    import faulthandler
    import json
    import sys

    from vrnic.backend.session import LIVE_SESSIONS

    sys.stderr.write(f"---- debug dump (SIGUSR1) at {time.ctime()}\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    for session in list(LIVE_SESSIONS):
        log.warning("debug dump: session %s", json.dumps(session.debug_state(), default=str))


@contextmanager
def serve_in_process(settings: DaemonSettings, backend: BackendService, *, migrate: bool = True) -> Iterator[str]:
    """The daemon's API inside this process (tests, e.g. the kernel tier with a real driver).

    Migrates the database to head when migrate is true, serves over HTTP on a free port of
    settings.listen_host, yields the base URL (".../api/v1" is the API); the backend stays the caller's.
    """
    from vrnic.api.app import create_app
    from vrnic.db.engine import make_engine
    from vrnic.db.migrate import upgrade

    settings = with_operator_token(settings)
    engine = make_engine(settings.database, background_checkpoints=True)
    try:
        if migrate:
            upgrade(engine)
        with serve_in_thread(create_app(settings, backend, engine=engine), host=settings.listen_host) as url:
            yield url
    finally:
        engine.dispose()


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 15.0) -> Iterator[str]:
    """Serve app from a thread of this process (tests); yields the base URL, stops on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="vrnic-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the API server did not start")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout)
