"""One open device context per idle shared-ring vRNIC, for its next guest (issue 14's pre-setup).

Opening a device (`ibv_open_device`, with rdma-core's device discovery before it) was the largest step of an
attach: 2-3 ms of the guest thread's CPU under the lab's TCG. The context is opened when the vRNIC is admitted,
taken by the attach, and given back by a clean detach. Only the vRNIC's own guests use it: the same tenant, and
a shared-ring guest never holds the context's descriptor. A context is kept only while it says it can be
reused (every object in it destroyed, no descriptor handed out), so the direct engine always opens its own.
An idle context holds two descriptors (the command and the async-event file), so at most `limit` are kept: past
that, vRNICs open their device at attach as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vrnic.backend.registry import VirtualRnic
from vrnic.backend.rnic_edge import DeviceContext
from vrnic.errors import VrnicError

log = logging.getLogger(__name__)


DEFAULT_LIMIT = 64  # 128 descriptors, under a tenth of the usual soft limit of 1024


class IdleContexts:
    def __init__(self, open_device: Callable[[str], DeviceContext], still_holds: Callable[[VirtualRnic], bool],
                 limit: int = DEFAULT_LIMIT) -> None:
        """still_holds: is this vRNIC still registered (Registry.still_holds); asked under the lock that drop()
        takes after the vRNIC left, so a context given back as its vRNIC goes is closed, not kept."""
        self._open_device = open_device
        self._still_holds = still_holds
        self.limit = limit
        self._lock = threading.Lock()
        self._idle: dict[str, DeviceContext] = {}  # vRNIC id -> the context its next guest gets

    def prime(self, vrnic: VirtualRnic) -> None:
        """Open one now, if fewer than the limit wait; a failure is only logged, as the attach opens its own and
        reports what fails then."""
        if not self.has_room():
            return
        try:
            context = self._open_device(vrnic.device)
        except VrnicError as exc:
            log.warning("vRNIC %s: could not open %s ahead of its guest: %s", vrnic.spec.id, vrnic.device, exc)
            return
        self.give_back(vrnic, context)

    def take(self, vrnic: VirtualRnic) -> DeviceContext:
        """The vRNIC's idle context, or a new one."""
        with self._lock:
            context = self._idle.pop(vrnic.spec.id, None)
        return context if context is not None else self._open_device(vrnic.device)

    def give_back(self, vrnic: VirtualRnic, context: DeviceContext) -> None:
        """Keep it for the vRNIC's next guest if it can be reused, the vRNIC is still here and it has none;
        close it otherwise."""
        context.release_spares()  # while it is still this caller's alone
        with self._lock:
            keep = (vrnic.spec.id not in self._idle and len(self._idle) < self.limit and context.reusable()
                    and self._still_holds(vrnic))
            if keep:
                self._idle[vrnic.spec.id] = context
        if not keep:
            context.close()

    def drop(self, vrnic_id: str) -> None:
        """Close its idle context: call it after the vRNIC left the registry."""
        with self._lock:
            context = self._idle.pop(vrnic_id, None)
        if context is not None:
            context.close()

    def holds(self, vrnic_id: str) -> bool:
        """Whether the vRNIC's next guest finds a context here (an attach that opens no device)."""
        with self._lock:
            return vrnic_id in self._idle

    def has_room(self) -> bool:
        return self.count() < self.limit

    def count(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        with self._lock:
            contexts, self._idle = list(self._idle.values()), {}
        for context in contexts:
            context.close()
