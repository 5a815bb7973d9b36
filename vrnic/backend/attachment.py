"""What the guest channel needs from an attached session, and nothing more.

The channel (vrnic.backend.channel) frames messages and guards the socket; the
paravirtual driver composes sessions. This module is the seam between them, so
neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vrnic.core.verb_args import Attach, VmAttach


@dataclass(frozen=True)
class PeerCred:
    """The connecting process as the kernel reports it (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


class AttachedSession(Protocol):
    """One guest's session, as the channel sees it."""

    vrnic_id: str

    def handle(self, op: str, raw_args: dict[str, Any]) -> dict[str, Any]:
        """Run one request; raises a VrnicError for anything the guest should see."""

    def after_reply(self) -> None:
        """Work the guest need not wait for (the data path's thread, after a first QP), run once a reply is out."""

    def attach_result(self) -> dict[str, Any]:
        """The body of the reply to a successful attach."""

    def attach_fds(self) -> list[int]:
        """Descriptors sent back with that reply (the session keeps its own; the channel sends copies)."""

    def close(self) -> None:
        """Release every kernel object of the session; safe to call twice."""


class VmAttachedSession(AttachedSession, Protocol):
    """A VM guest's session: its doorbell arrives as a message on the channel."""

    def ring_doorbell(self) -> None:
        """Wake the data-path engine: the guest posted work."""


Disconnect = Callable[[], None]
"""Ends the guest's connection at once (the engine calls it when the data path fails)."""

SessionOpener = Callable[[Attach, list[int], PeerCred, Disconnect], AttachedSession]
"""Open a session for a validated attach request. It owns the fds passed in: it keeps or closes every one,
also when it raises."""

OpensQuickly = Callable[[Attach], bool]
"""Whether opening the session for this attach does no device I/O (nothing that could block), so that the
channel's selector thread may open it and answer the attach itself. False is always safe."""

VmSessionOpener = Callable[[VmAttach, Disconnect], VmAttachedSession]
"""Open a session for the guest of a bound VM channel (memory and identity come from the binding)."""
