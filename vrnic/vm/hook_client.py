"""The libvirt hook's REST client: one request per call, on the standard library's http.client.

libvirtd waits for the hook at every op of every domain, and each call is a new Python process. The CLI's client
(httpx, pydantic-settings, typer and rich) took a tenth of that process's start on a host, and most of a
12-34 s hook call in the lab's TCG guests, where `virsh start` and `virsh migrate` wait for several calls in a row.
So the hook takes what the wrapper script hands it (VRNIC_API_URL, VRNIC_API_TOKEN or VRNIC_API_TOKEN_FILE,
VRNIC_API_TIMEOUT) and speaks HTTP/1.1 with JSON bodies itself; answers are read as the CLI's client reads
them (vrnic.cli.client). With VRNIC_CONFIG set, it resolves those settings as the CLI does.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vrnic.defaults import DEFAULT_API_TIMEOUT_S, DEFAULT_API_URL, DEFAULT_STATE_DIR
from vrnic.errors import ApiError, InvalidArgument, Unavailable


@dataclass(frozen=True)
class HookClientSettings:
    url: str
    token: str | None
    timeout: float

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> HookClientSettings:
        """What ClientSettings would resolve from the same environment (without an env file)."""
        if environ.get("VRNIC_CONFIG"):
            return cls._from_client_settings()
        token = environ.get("VRNIC_API_TOKEN") or None
        if token is None:
            state_dir = Path(environ.get("VRNIC_STATE_DIR") or DEFAULT_STATE_DIR)
            token = _read_token(Path(environ.get("VRNIC_API_TOKEN_FILE") or state_dir / "operator-token"))
        try:
            timeout = float(environ.get("VRNIC_API_TIMEOUT") or DEFAULT_API_TIMEOUT_S)
        except ValueError as exc:
            raise InvalidArgument(f"VRNIC_API_TIMEOUT is not a number: {environ['VRNIC_API_TIMEOUT']!r}") from exc
        return cls(url=environ.get("VRNIC_API_URL") or DEFAULT_API_URL, token=token, timeout=timeout)

    @classmethod
    def _from_client_settings(cls) -> HookClientSettings:
        from vrnic.cli.client import ClientSettings  # an env file: read it the one way the CLI does

        settings = ClientSettings()
        token = settings.token.get_secret_value() if settings.token else _read_token(settings.token_file)
        return cls(url=settings.url, token=token, timeout=settings.timeout)


def _read_token(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class HookClient:
    """request(method, path, json_body=) -> the answer's JSON (None for 204 or an empty body), as ApiClient.

    An answer >= 400 raises ApiError; a failure to reach the API (refused, reset, timed out, a broken answer)
    raises Unavailable."""

    def __init__(self, settings: HookClientSettings) -> None:
        parts = urlsplit(settings.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(f"the API URL must be http(s)://host[:port][/prefix], not {settings.url!r}")
        self.settings = settings
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/") + "/api/v1"
        self._headers = {"Accept": "application/json"}
        if settings.token:
            self._headers["Authorization"] = f"Bearer {settings.token}"

    def with_url(self, url: str) -> HookClient:
        """The same token and timeout against another host's API."""
        return HookClient(HookClientSettings(url=url, token=self.settings.token, timeout=self.settings.timeout))

    def request(self, method: str, path: str, *, json_body: Any = None) -> Any:
        headers = dict(self._headers)
        body = None
        if json_body is not None:
            body = json.dumps(json_body).encode()
            headers["Content-Type"] = "application/json"
        connection = self._connection()
        try:
            connection.request(method, self._prefix + path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:  # OSError covers refused, reset and timed out
            raise Unavailable(f"{method} {self.settings.url}{self._prefix}{path}: {exc or type(exc).__name__}") from exc
        finally:
            connection.close()
        if response.status >= 400:
            raise ApiError.from_answer(response.status, data.decode(errors="replace"), response.reason)
        return None if response.status == 204 or not data else json.loads(data)

    def _connection(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self.settings.timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=self.settings.timeout)
