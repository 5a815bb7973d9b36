"""Live migration of a VM's vRNIC, the pure parts: the NIC's dirty log, the phases, the report.

QEMU's dirty tracking sees what the guest's vCPUs write, never what the NIC or
vrnicd write into the shared RAM file (../shared/FACTS.md: proven). So while a VM
migrates, vrnicd logs every guest range the NIC may write (receive buffers, the
local buffers of READs and atomics, peers' RDMA WRITEs and atomics into its MRs)
and the rings vrnicd itself writes, and copies exactly those pages from the
source RAM to the destination RAM after QEMU's last pass, before the guest runs
again. No I/O here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from vrnic.errors import Conflict

PAGE = 4096


class DirtyLog:
    """Pages of guest memory (by guest address) the NIC or vrnicd wrote since the log started.

    mark() is called from several engine threads (the VM's own, and its peers' for their RDMA WRITEs).
    """

    def __init__(self) -> None:
        self._pages: set[int] = set()
        self._lock = threading.Lock()

    def mark(self, address: int, length: int) -> None:
        if length <= 0:
            return
        first, last = address // PAGE, (address + length - 1) // PAGE
        with self._lock:
            self._pages.update(range(first, last + 1))

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)

    def ranges(self) -> list[tuple[int, int]]:
        """The dirty pages as (guest address, length), coalesced and in address order."""
        with self._lock:
            pages = sorted(self._pages)
        return coalesce(pages)


def coalesce(pages: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted page numbers -> (address, length) runs."""
    runs: list[tuple[int, int]] = []
    start = prev = None
    for page in pages:
        if start is None:
            start = prev = page
        elif page == prev + 1:  # type: ignore[operator]
            prev = page
        else:
            runs.append((start * PAGE, (prev - start + 1) * PAGE))  # type: ignore[operator]
            start = prev = page
    if start is not None:
        runs.append((start * PAGE, (prev - start + 1) * PAGE))  # type: ignore[operator]
    return runs


class MigrationPhase(StrEnum):
    PREPARED = "prepared"  # destination RAM mapped, its MRs pre-registered, the dirty log running
    SWITCHING = "switching"  # peers held, in-flight work drained, state moving
    DONE = "done"  # the destination serves the VM; nothing of it is left on the source
    ABORTED = "aborted"  # the source serves the VM as before; the pre-setup is gone


_NEXT = {MigrationPhase.PREPARED: {MigrationPhase.SWITCHING, MigrationPhase.ABORTED},
         MigrationPhase.SWITCHING: {MigrationPhase.DONE, MigrationPhase.ABORTED}}


def advance(current: MigrationPhase, to: MigrationPhase) -> MigrationPhase:
    if to not in _NEXT.get(current, set()):
        raise Conflict(f"a migration that is {current} cannot become {to}", current_state=str(current))
    return to


@dataclass
class SwitchoverReport:
    """What the switchover did and how long each part took (milliseconds)."""

    vrnics: list[str] = field(default_factory=list)
    qps: int = 0
    peers_repointed: int = 0
    preconnected: int = 0  # of them, on QPs connected ahead at prepare (no modify at the switchover)
    mrs_presetup: int = 0  # registered at prepare and kept
    mrs_registered: int = 0  # registered during the switchover (new since prepare)
    dirty_pages: int = 0
    copied_bytes: int = 0
    recvs_reposted: int = 0
    sends_carried: int = 0  # WRs the NIC had not taken (not yet posted, or a SEND waiting for a receive): again
    broken_qps: int = 0  # QPs whose peer is gone: left in ERR (their WRs flush with an error)
    hold_ms: float = 0.0
    drain_ms: float = 0.0
    copy_ms: float = 0.0
    rebuild_ms: float = 0.0
    connect_ms: float = 0.0
    release_ms: float = 0.0
    total_ms: float = 0.0
