"""The process's descriptor limit: vrnicd holds several descriptors per guest.

Each attached guest costs vrnicd its socket, its arena (or VM RAM) file, one or
two eventfds, a device context (two descriptors) and a completion channel per
CQ; an idle shared-ring vRNIC keeps a device context. The usual soft limit of
1024 runs out near a hundred guests, well under the channel's session cap, so
the daemons raise it to the hard limit at start (what systemd services and most
servers do). Nothing in vrnicd selects on descriptors with select(2), which
cannot watch one numbered 1024 or above.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_descriptor_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a container may refuse it: serve with what there is
        log.warning("could not raise the open-descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard
