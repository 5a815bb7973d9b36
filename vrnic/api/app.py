"""The FastAPI application factory: settings + a BackendService in, an ASGI app out.

The daemon and the tests build the app the same way; tests can pass their own engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Engine

from vrnic import __version__
from vrnic.api import agent, fast_routes, problems
from vrnic.api.agent_handover import router as agent_handover_router
from vrnic.api.agent_peers import router as agent_peers_router
from vrnic.api.controlplane import ControlPlane
from vrnic.api.routes import metrics_router, router
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.db.engine import make_engine
from vrnic.db.schema import check_schema
from vrnic.errors import InvalidArgument, VrnicError

log = logging.getLogger(__name__)


async def _reconcile_qos(backend: BackendService, interval: float) -> None:
    """Put back QoS classes and filters that drifted in the kernel (someone ran tc by hand)."""
    while True:
        await asyncio.sleep(interval)
        try:
            fixed = await run_in_threadpool(backend.reconcile_qos)
        except Exception:  # keep the loop: try again next time
            log.exception("QoS reconcile pass failed")
            continue
        if fixed:
            log.warning("QoS reconcile: %d correction(s)", fixed)


async def _beat(cp: ControlPlane, interval: float) -> None:
    """The heartbeat: this host is alive; other hosts silent too long are marked down; and what this host's
    backend observes (guests attached or gone) is in the database, for API servers on other hosts."""
    while True:
        await asyncio.sleep(interval)
        try:
            await cp.write(cp.inventory.heartbeat)
            down = await cp.write(cp.inventory.sweep)
            if down:
                log.warning("host(s) marked down (no heartbeat): %s", ", ".join(down))
            await cp.write(cp.vrnics.record_observed)
        except Exception as exc:  # the database may be restarting: beat again next time
            log.warning("heartbeat failed (next try in %.1f s): %s", interval, exc)


def create_app(settings: DaemonSettings, backend: BackendService, *, engine: Engine | None = None,
               api_url: str | None = None) -> FastAPI:
    """The API app. Refuses (SchemaOutOfDate) a database whose schema is not at head.

    On startup (lifespan) this host registers itself (api_url, else settings.advertise_url, is where other hosts
    reach its agent routes) and records the devices the backend sees; then it beats every
    settings.heartbeat_interval_s. With the SR-IOV mode on, desired VF state (database) is reconciled with the
    kernel then and every settings.sriov_reconcile_interval seconds.
    """
    if settings.operator_token is None:
        raise InvalidArgument("no operator token: set VRNIC_OPERATOR_TOKEN (the daemon generates one)")
    owns_engine = engine is None
    engine = engine or make_engine(settings.database, background_checkpoints=True)
    check_schema(engine)
    operator_token = settings.operator_token.get_secret_value()
    agent_token = settings.agent_secret or operator_token
    cp = ControlPlane(engine, backend, host_name=settings.host_name, operator_token=operator_token,
                      api_url=api_url or settings.advertise_url, agent_token=agent_token,
                      device_max_vrnics=settings.device_max_vrnics, down_after_s=settings.down_after_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Off the event loop: drivers may block, and pyroute2 (the SR-IOV driver's netlink) cannot run its own
        # loop inside a thread whose loop is already running.
        await run_in_threadpool(cp.inventory.register_host)
        # crash recovery: what the previous vrnicd held is held again (same tokens); attached ones are lost
        await cp.write(cp.vrnics.recover)
        changed = await cp.write(cp.vrnics.record_observed)
        if changed:
            log.info("attach state of %d vRNIC(s) changed while the daemon was down", changed)
        orphans = cp.vrnics.orphaned()
        if orphans:
            log.warning("%d live vRNIC(s) in the database have no backend state on this host "
                        "(released on DELETE): %s", len(orphans), ", ".join(orphans[:5]))
        reconciler: asyncio.Task[None] | None = None
        if backend.has_mode(VrnicMode.SRIOV):
            try:
                done = await cp.write(cp.sriov.reconcile_as_daemon)
                log.info("SR-IOV reconcile at startup: %d correction(s)", len(done.events))
            except VrnicError as exc:
                log.error("SR-IOV reconcile at startup failed: %s", exc)
            if settings.sriov_reconcile_interval > 0:
                reconciler = asyncio.create_task(cp.sriov.reconcile_periodically(settings.sriov_reconcile_interval))
        qos: asyncio.Task[None] | None = None
        if settings.qos_reconcile_interval > 0:
            qos = asyncio.create_task(_reconcile_qos(backend, settings.qos_reconcile_interval))
        beat = asyncio.create_task(_beat(cp, settings.heartbeat_interval_s))
        yield
        for task in (reconciler, qos, beat):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        cp.close()
        if owns_engine:
            engine.dispose()  # its last WAL checkpoint, too

    app = FastAPI(title="vrnic", version=__version__, lifespan=lifespan,
                  description="Virtual RDMA NICs for VMs and containers: tenants, vRNICs, devices, hosts, events.")
    app.state.control_plane = cp
    app.state.agent_token = agent_token
    app.state.libvirt_uri = settings.libvirt_uri
    problems.install(app)
    app.include_router(router)
    app.include_router(metrics_router)
    app.include_router(agent.router)
    app.include_router(agent_peers_router)
    app.include_router(agent_handover_router)
    fast_routes.install(app)  # in front of the middleware: they pass on what they do not serve
    return app
