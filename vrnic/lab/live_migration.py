"""Live-migrate a raw-QEMU VM with a vRNIC between two QEMU processes on this host, driving vrnicd alongside.

The order (vrnic.backend.vm_migration says what vrnicd does at each step):
1. the destination QEMU runs, paused, incoming; vrnicd prepares (a refusal stops here: nothing started);
2. QEMU migrates (pre-copy, then stop-and-copy);
3. QEMU completed, the destination is paused: vrnicd switches over, then the destination runs (`cont`);
4. on any failure: vrnicd aborts, the destination goes, and the source runs on (`cont` if it was stopped).

`vrnicd` is anything with prepare_vm_migration/complete_vm_migration/abort_vm_migration: the in-process
driver, the BackendService, or ApiMigration (the REST API, operator token).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from vrnic.core.specs import VmBinding
from vrnic.errors import LabError
from vrnic.lab.qemu_vm import MigrationStats, QemuVm, migrate

log = logging.getLogger(__name__)


class MigrationBackend(Protocol):
    def prepare_vm_migration(self, domain: str, target: VmBinding) -> dict[str, Any]: ...

    def complete_vm_migration(self, domain: str) -> dict[str, Any]: ...

    def abort_vm_migration(self, domain: str) -> bool: ...


class ApiMigration:
    """The three steps through the REST API (vrnic.cli.client.ApiClient or anything with .request)."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def prepare_vm_migration(self, domain: str, target: VmBinding) -> dict[str, Any]:
        result: dict[str, Any] = self.api.request("POST", f"/vms/{domain}/migration",
                                                  json_body=target.model_dump(mode="json"))
        return result

    def complete_vm_migration(self, domain: str) -> dict[str, Any]:
        result: dict[str, Any] = self.api.request("POST", f"/vms/{domain}/migration/switchover")
        return result

    def abort_vm_migration(self, domain: str) -> bool:
        return bool(self.api.request("DELETE", f"/vms/{domain}/migration").get("aborted"))


@dataclass
class LiveMigration:
    stats: MigrationStats
    prepared: dict[str, Any]
    switchover: dict[str, Any] = field(default_factory=dict)
    prepare_ms: float = 0.0
    total_ms: float = 0.0  # from vrnicd's prepare to the destination running


def migrate_vm(vrnicd: MigrationBackend, domain: str, source: QemuVm, dest: QemuVm, target: VmBinding, uri: str,
               *, timeout: float = 300.0, cancel_after: float | None = None,
               parameters: dict[str, Any] | None = None) -> LiveMigration:
    """Run the four steps above. Raises LabError (QEMU) or the backend's error; the VM then runs on the source
    with its vRNIC as it was, and the destination QEMU is stopped."""
    t0 = time.monotonic()
    prepared = vrnicd.prepare_vm_migration(domain, target)  # a refusal: nothing to undo
    result = LiveMigration(MigrationStats(), prepared, prepare_ms=(time.monotonic() - t0) * 1000)

    def switch() -> None:
        result.switchover = vrnicd.complete_vm_migration(domain)

    try:
        result.stats = migrate(source, dest, uri, before_resume=switch, parameters=parameters,
                               cancel_after=cancel_after, timeout=timeout)
    except BaseException:
        if not result.switchover:
            with contextlib.suppress(Exception):
                vrnicd.abort_vm_migration(domain)
            _run_on_source(source)
        with contextlib.suppress(Exception):
            dest.stop()
        raise
    result.total_ms = (time.monotonic() - t0) * 1000
    return result


def _run_on_source(source: QemuVm) -> None:
    """After a failed or cancelled migration QEMU leaves the source running, or paused once it completed."""
    try:
        status = source.qmp.execute("query-status")
        if not status.get("running"):
            source.qmp.execute("cont")
    except LabError as exc:
        log.error("the source VM %s could not be resumed: %s", source.spec.name, exc)
