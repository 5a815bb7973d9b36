"""Where desired VF state lives. The daemon will use a database-backed store (issue 4); this module holds the
protocol and the in-memory store used by the driver until then and by tests."""

from __future__ import annotations

import threading
from typing import Protocol

from vrnic.sriov.vf_types import Allocation


class VfStateStore(Protocol):
    """Desired state: one Allocation per vRNIC id. put() replaces; delete() of an unknown id is a no-op."""

    def list(self) -> list[Allocation]: ...

    def get(self, vrnic_id: str) -> Allocation | None: ...

    def put(self, allocation: Allocation) -> None: ...

    def delete(self, vrnic_id: str) -> None: ...


class InMemoryVfStateStore:
    def __init__(self) -> None:
        self._items: dict[str, Allocation] = {}
        self._lock = threading.Lock()

    def list(self) -> list[Allocation]:
        with self._lock:
            return sorted(self._items.values(), key=lambda a: (a.address.pf, a.address.index))

    def get(self, vrnic_id: str) -> Allocation | None:
        with self._lock:
            return self._items.get(vrnic_id)

    def put(self, allocation: Allocation) -> None:
        with self._lock:
            self._items[allocation.vrnic_id] = allocation

    def delete(self, vrnic_id: str) -> None:
        with self._lock:
            self._items.pop(vrnic_id, None)
