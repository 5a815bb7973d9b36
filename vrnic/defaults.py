"""Defaults shared by the daemon's settings, the CLI's client and the libvirt hook's client.

A leaf module with no imports beyond the standard library: the hook's client
reads it without importing pydantic, and the CLI's client without the hook.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_API_URL = "http://127.0.0.1:8470"
DEFAULT_API_TIMEOUT_S = 30.0
DEFAULT_STATE_DIR = Path("/var/lib/vrnic")
