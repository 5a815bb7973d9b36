"""Whether a `vrnic daemon` answers: GET /api/v1/health through urllib.

Not httpx: every httpx call outside a kept client builds an SSL context (the certifi bundle parsed: 60 ms on the
host, most of a second under the lab's TCG), even for plain http. Loops polling a restarting daemon that way took
the CPU its start needed: the kill storm's restarts took 100-150 s, and one did not answer within 600 s."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def health(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The health document of the daemon at url, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/api/v1/health", timeout=timeout) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None
