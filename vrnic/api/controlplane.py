"""The control plane: database state plus the backend, behind the REST routes; a thin façade over its parts.

It reaches this host's backend only through BackendService (the service boundary), and another host's through
that host's agent (Backends: a RemoteBackend per host). Every operation runs in one unit of work and raises
only VrnicErrors; an allocation whose database commit fails releases its backend state again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine

from vrnic.api.backends import Backends
from vrnic.api.inventory import Inventory
from vrnic.api.security_rules import SecurityRules
from vrnic.api.sriov import Sriov, database_vf_store
from vrnic.api.tenants import Tenants
from vrnic.api.transactions import Transactions
from vrnic.api.vms import Vms
from vrnic.api.vrnics import Vrnics
from vrnic.backend.service import BackendService
from vrnic.db.unit_of_work import Database

T = TypeVar("T")


class ControlPlane:
    def __init__(self, engine: Engine, backend: BackendService, *, host_name: str,
                 operator_token: str, api_url: str | None = None, agent_token: str | None = None,
                 device_max_vrnics: int | None = None, down_after_s: float = 6.0) -> None:
        """agent_token: what this host presents to other hosts' agents (default: the operator token)."""
        db = Database(engine)
        self.backend = backend
        self.host_name = host_name
        self.tx = Transactions(db, database_vf_store(backend, engine))
        self.inventory = Inventory(db, backend, host_name=host_name, api_url=api_url,
                                   device_max_vrnics=device_max_vrnics, down_after_s=down_after_s)
        self.tenants = Tenants(db, operator_token)
        self.backends = Backends(backend, host_name, agent_token or operator_token)
        self.vrnics = Vrnics(self.tx, backend, self.inventory, self.backends)
        self.security_rules = SecurityRules(db)
        self.sriov = Sriov(self.tx, backend)
        self.vms = Vms(self.tx, backend, self.inventory, agent_token or operator_token)

    async def write(self, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a state-changing operation off the event loop (on SQLite: queued for the one writer thread)."""
        return await self.tx.run_write(operation, *args, **kwargs)

    def close(self) -> None:
        self.backends.close()
        self.tx.close()
