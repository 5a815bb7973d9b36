"""Connection requests between guests, rdma_cm style: a listener per vRNIC and port, requests queued to it.

A connector's request names its QP (virtually) and carries private data; it waits until the listener's
guest accepts (its QP is then connected to the connector's, and its private data goes back) or rejects,
or until its timeout. Requests from other hosts arrive through the owner agent (/agent/v1/cm/connect)
and land in the same queue. Nothing here holds a session's lock: callers wait on this module's condition.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from vrnic.core.peering import Identity
from vrnic.errors import Conflict, NotFound

BACKLOG = 16  # requests queued on one listener and not taken yet (rdma_listen's backlog); more are rejected


@dataclass(eq=False)
class CmRequest:
    id: int
    port: int
    asker: Identity  # the connecting vRNIC
    vqpn: int  # its QP
    private_data: bytes
    accepted: tuple[int, bytes] | None = None  # the listener's (vqpn, private data)
    answered: bool = False
    given_up: bool = False  # the connector stopped waiting: accepting it now fails
    reason: str = ""


@dataclass(eq=False)
class _Listener:
    owner: object  # the session that listens: only it may take requests, its end drops the listener
    queue: deque[CmRequest] = field(default_factory=deque)
    handed: dict[int, CmRequest] = field(default_factory=dict)  # taken by the guest, not answered yet


class ConnectionManager:
    def __init__(self) -> None:
        self._listeners: dict[tuple[str, int], _Listener] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count(secrets.randbelow(1 << 30) + 1)

    def listen(self, vrnic_id: str, port: int, owner: object) -> None:
        with self._cond:
            if (vrnic_id, port) in self._listeners:
                raise Conflict(f"port {port} of this vRNIC already has a listener", current_state="listening")
            self._listeners[(vrnic_id, port)] = _Listener(owner)

    def unlisten(self, vrnic_id: str, port: int, owner: object) -> None:
        with self._cond:
            listener = self._listeners.get((vrnic_id, port))
            if listener is None or listener.owner is not owner:
                raise NotFound(f"no listener on port {port}")
            self._close(vrnic_id, port, listener)

    def drop(self, vrnic_id: str, owner: object) -> None:
        """The session ended: its listeners go, and whoever waits on them hears a rejection."""
        with self._cond:
            for (vid, port), listener in list(self._listeners.items()):
                if vid == vrnic_id and listener.owner is owner:
                    self._close(vid, port, listener)

    def _close(self, vrnic_id: str, port: int, listener: _Listener) -> None:
        del self._listeners[(vrnic_id, port)]
        for request in [*listener.queue, *listener.handed.values()]:
            self._answer(request, None, "the listener went away")
        self._cond.notify_all()

    def listening(self, vrnic_id: str) -> list[int]:
        with self._cond:
            return sorted(p for v, p in self._listeners if v == vrnic_id)

    # ----- the listener's side ---------------------------------------------------------------------
    def get_request(self, vrnic_id: str, port: int, owner: object, timeout: float) -> CmRequest | None:
        """The next request on the listener (it is then the guest's to accept or reject); None at the timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                listener = self._listeners.get((vrnic_id, port))
                if listener is None or listener.owner is not owner:
                    raise NotFound(f"no listener on port {port}")
                while listener.queue:
                    request = listener.queue.popleft()
                    if not request.given_up:
                        listener.handed[request.id] = request
                        return request
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def claim(self, vrnic_id: str, request_id: int, owner: object) -> CmRequest:
        """A request the guest took with get_request, to answer now; Conflict if its connector gave up."""
        with self._cond:
            request = next((lst.handed.pop(request_id) for (v, _), lst in self._listeners.items()
                            if v == vrnic_id and lst.owner is owner and request_id in lst.handed), None)
            if request is None:
                raise NotFound(f"no pending connection request {request_id}")
            if request.given_up:
                raise Conflict("the connecting side stopped waiting", current_state="timeout")
            return request

    def answer(self, request: CmRequest, accepted: tuple[int, bytes] | None, reason: str = "") -> bool:
        """Accept (the listener's vqpn and private data) or reject (None); False if the connector gave up."""
        with self._cond:
            if request.given_up:
                return False
            self._answer(request, accepted, reason)
            self._cond.notify_all()
            return True

    @staticmethod
    def _answer(request: CmRequest, accepted: tuple[int, bytes] | None, reason: str) -> None:
        if not request.answered:
            request.accepted, request.reason, request.answered = accepted, reason, True

    # ----- the connector's side --------------------------------------------------------------------
    def connect(self, asker: Identity, vrnic_id: str, port: int, vqpn: int, private_data: bytes,
                timeout: float) -> tuple[int, bytes]:
        """Queue a request on the listener (vrnic_id, port) and wait for its answer: (its vqpn, private data).

        Conflict "rejected" if nothing listens there or the listener rejects, "timeout" if nobody answers."""
        deadline = time.monotonic() + timeout
        with self._cond:
            listener = self._listeners.get((vrnic_id, port))
            if listener is None:
                raise Conflict(f"connection refused: nothing listens on port {port}", current_state="rejected")
            if len(listener.queue) >= BACKLOG:
                raise Conflict(f"connection refused: the listener on port {port} has {BACKLOG} requests waiting",
                               current_state="rejected")
            request = CmRequest(next(self._ids), port, asker, vqpn, private_data)
            listener.queue.append(request)
            self._cond.notify_all()
            while not request.answered:
                left = deadline - time.monotonic()
                if left <= 0:
                    request.given_up = True
                    if request in listener.queue:
                        listener.queue.remove(request)
                    raise Conflict(f"the listener on port {port} did not answer within {timeout:g} s",
                                   current_state="timeout")
                self._cond.wait(left)
        if request.accepted is None:
            raise Conflict(f"connection rejected: {request.reason or 'by the listener'}", current_state="rejected")
        return request.accepted
