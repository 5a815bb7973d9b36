"""The two floors under REST allocate (issue 14), measured in the same run as `cp.rest.*`.

- The HTTP stack's: `python -m bench.rest_floor PORT` serves POST /api/v1/vrnics as the daemon does (the fast
  route in front of the middleware, `vrnic.api.fast_routes`, and behind it the real route's FastAPI shape: the
  router's query check, the bearer token and caller dependencies, the Idempotency-Key header, the `VrnicCreate`
  body, the `VrnicOut` response, the problem handlers; the hop to one writer thread) under the daemon's uvicorn
  settings, and does no work: the writer returns one prepared `VrnicOut`.
- The control plane's: `allocate_cpu_ms` calls `Vrnics.allocate` directly (no HTTP) on a SQLite file with the
  fake driver, as the daemon's writer thread does.

Each allocation through the daemon costs about the sum of the two in server CPU, and one core of it runs under
one GIL, so 1000 / (the sum in ms) allocations/s is the most this stack can reach, however the clients come.
"""

# No `from __future__ import annotations`: FastAPI reads the route's annotations, whose types are local to
# floor_app (imported there, so that importing this module does not load FastAPI).
import asyncio
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

T = TypeVar("T")
FLOOR_TOKEN = "vrt_floor"


def floor_app() -> Any:
    from fastapi import APIRouter, Depends, FastAPI, Header, Response, status

    from vrnic.api import fast_routes, problems
    from vrnic.api.auth import Principal
    from vrnic.api.routes import CP, IDEMPOTENCY_KEY_MAX, Caller, Printable, answer_allocation, known_query_only
    from vrnic.api.schemas import VrnicCreate, VrnicOut
    from vrnic.core.lifecycle import VrnicState
    from vrnic.core.specs import AttachInfo, DataEngine, QosPolicy, Quota, VrnicMode
    from vrnic.core.vaddr import make_virtual_gid
    from vrnic.errors import Unauthenticated

    now, vrnic_id, gid = datetime.now(UTC), "vr-" + "0" * 32, make_virtual_gid(1, 1)
    prepared = VrnicOut(id=vrnic_id, tenant="bench", mode=VrnicMode.PARAVIRTUAL, engine=DataEngine.RING,
                        state=VrnicState.ALLOCATED, host="floor", device="fake0", virtual_gid=gid,
                        virtual_ip="10.0.0.2", quota=Quota(), qos=QosPolicy(), created_at=now, updated_at=now,
                        attach=AttachInfo(vrnic_id=vrnic_id, mode=VrnicMode.PARAVIRTUAL, device="fake0",
                                          virtual_gid=gid, socket_path="/run/vrnicd.sock", token="vra_" + "0" * 43))
    principal = Principal.tenant(1, "bench")

    class Tenants:
        @staticmethod
        def cached_principal(token: str | None) -> Principal | None:
            return principal if token == FLOOR_TOKEN else None

        @staticmethod
        def authenticate(_token: str | None) -> Principal:
            raise Unauthenticated("the floor server knows one token")

    class Vrnics:
        @staticmethod
        def allocate(_who: Principal, _body: VrnicCreate, _key: str | None) -> tuple[VrnicOut, bool]:
            return prepared, False

    class NoWorkControlPlane:
        """What the routes read of the ControlPlane; writes hop to one thread, as on SQLite
        (Transactions.run_write), and do nothing there."""

        tenants = Tenants()
        vrnics = Vrnics()

        def __init__(self) -> None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="floor-writer")

        async def write(self, operation: Callable[..., T], *args: Any) -> T:
            return await asyncio.get_running_loop().run_in_executor(self._writer, operation, *args)

    router = APIRouter(prefix="/api/v1", responses=problems.RESPONSES, dependencies=[Depends(known_query_only)])

    @router.post("/vrnics", status_code=status.HTTP_201_CREATED)
    async def allocate_vrnic(body: VrnicCreate, cp: CP, who: Caller, response: Response,
                             idempotency_key: Annotated[str | None, Header(min_length=1, max_length=IDEMPOTENCY_KEY_MAX,
                                                                           pattern=Printable)] = None) -> VrnicOut:
        out, replayed = await cp.write(cp.vrnics.allocate, who, body, idempotency_key)
        answer_allocation(response, out, replayed)
        return out

    app = FastAPI()
    app.state.control_plane = NoWorkControlPlane()
    problems.install(app)
    app.include_router(router)
    fast_routes.install(app, [fast_routes.FastAllocateRoute()])  # as the daemon (it has no DELETE here)
    return app


def serve(port: int) -> None:
    import uvicorn

    app = floor_app()
    gc.collect()
    gc.freeze()  # as the daemon does
    uvicorn.run(app, host="127.0.0.1", port=port, ws="none", log_level="warning", access_log=False)


def allocate_cpu_ms(count: int) -> float:
    """CPU time (ms) of one `Vrnics.allocate` called directly: a fresh SQLite file (WAL, as the daemon's), the
    fake driver, one tenant, count allocations after a warm-up."""
    from vrnic.api.auth import OPERATOR
    from vrnic.api.controlplane import ControlPlane
    from vrnic.api.schemas import TenantCreate, VrnicCreate
    from vrnic.backend.driver import load_driver
    from vrnic.backend.service import BackendService
    from vrnic.core.specs import VrnicMode
    from vrnic.db.engine import make_engine
    from vrnic.db.migrate import upgrade

    with tempfile.TemporaryDirectory(prefix="vrnic-bench-floor-") as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'vrnic.db'}", background_checkpoints=True)
        upgrade(engine)
        backend = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake")})
        cp = ControlPlane(engine, backend, host_name="floor", operator_token="vro_floor")
        try:
            cp.inventory.register_host()
            token = cp.tenants.create_tenant(OPERATOR, TenantCreate(name="bench")).token
            who = cp.tenants.authenticate(token)
            body, warm_up = VrnicCreate(), min(count, 100)
            for _ in range(warm_up):
                cp.vrnics.allocate(who, body)
            started = time.process_time()
            for _ in range(count):
                cp.vrnics.allocate(who, body)
            spent = time.process_time() - started
            held = len(backend.vrnic_ids())
            if held != warm_up + count:
                raise RuntimeError(f"the backend holds {held} vRNICs after {warm_up + count} allocations")
            return spent / count * 1e3
        finally:
            cp.close()
            backend.close()
            engine.dispose()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
