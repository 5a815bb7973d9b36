"""What the resource commands share: the REST client (URL and token from env or config), output, errors.

The CLI only ever talks to the REST API, never to the database.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.table import Table

from vrnic.config import DaemonSettings
from vrnic.defaults import DEFAULT_API_TIMEOUT_S, DEFAULT_API_URL
from vrnic.errors import ApiError


class _DaemonStateDir(BaseSettings):
    """The daemon's state dir as the daemon reads it (VRNIC_STATE_DIR, or state_dir in VRNIC_CONFIG)."""

    model_config = SettingsConfigDict(env_prefix="VRNIC_", env_file=os.environ.get("VRNIC_CONFIG"), extra="ignore")

    state_dir: Path = DaemonSettings.model_fields["state_dir"].default


class ClientSettings(BaseSettings):
    """VRNIC_API_URL, VRNIC_API_TOKEN (or the daemon's generated operator token file), VRNIC_CONFIG."""

    model_config = SettingsConfigDict(env_prefix="VRNIC_API_", env_file=os.environ.get("VRNIC_CONFIG"),
                                      extra="ignore")

    url: str = DEFAULT_API_URL
    token: SecretStr | None = None
    # written by `vrnic daemon` when none is set, in its state dir (VRNIC_STATE_DIR, as the daemon reads it)
    token_file: Path = Field(default_factory=lambda: _DaemonStateDir().state_dir / "operator-token")
    timeout: float = DEFAULT_API_TIMEOUT_S


def _raise_for_problem(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise ApiError.from_answer(response.status_code, response.text, response.reason_phrase)


class ApiClient:
    def __init__(self, settings: ClientSettings | None = None, transport: httpx.BaseTransport | None = None) -> None:
        self.settings = settings or ClientSettings()
        token = self.settings.token.get_secret_value() if self.settings.token else self._token_from_file()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.settings.url.rstrip("/") + "/api/v1", headers=headers,
                                  timeout=self.settings.timeout, transport=transport)

    def _token_from_file(self) -> str | None:
        try:
            return self.settings.token_file.read_text().strip() or None
        except OSError:
            return None

    def request(self, method: str, path: str, *, json_body: Any = None, params: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        response = self._http.request(method, path, json=json_body, params=query, headers=headers)
        _raise_for_problem(response)
        return None if response.status_code == 204 or not response.content else response.json()

    def request_text(self, method: str, path: str, *, params: dict[str, Any] | None = None) -> str:
        """A request whose answer is not JSON (e.g. libvirt XML)."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        response = self._http.request(method, path, params=query)
        _raise_for_problem(response)
        return response.text

    def pages(self, path: str, params: dict[str, Any], limit: int, follow: bool) -> Iterator[dict[str, Any]]:
        """Items of a paginated list: one page of `limit`, or every page when follow."""
        cursor = params.pop("cursor", None)
        while True:
            page = self.request("GET", path, params={**params, "limit": limit, "cursor": cursor})
            yield from page["items"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return
            if not follow:
                typer.secho(f"(more: --cursor {cursor}, or --all)", err=True, dim=True)
                return


JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
LimitOpt = Annotated[int, typer.Option(min=1, max=500, help="Items per page.")]
AllOpt = Annotated[bool, typer.Option("--all", help="Follow every page.")]
CursorOpt = Annotated[str | None, typer.Option(help="Continue a list from this cursor.")]


@contextmanager
def api() -> Iterator[ApiClient]:
    """An ApiClient; any failure becomes one line on stderr and exit status 1."""
    try:
        yield ApiClient()
    except ApiError as exc:
        fail(str(exc))
    except httpx.HTTPError as exc:
        fail(f"cannot reach the vrnic API at {ClientSettings().url}: {exc} (is `vrnic daemon` running? "
             "set VRNIC_API_URL)")


def fail(message: str) -> None:
    typer.secho(f"vrnic: {message}", err=True, fg="red")
    raise typer.Exit(1)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def show(data: Any, as_json: bool, columns: Sequence[str | tuple[str, Callable[[dict[str, Any]], Any]]]) -> None:
    """Print a list (or one object) as a table of columns, or as JSON."""
    if as_json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    rows = data if isinstance(data, list) else [data]
    table = Table(*[c if isinstance(c, str) else c[0] for c in columns])
    for row in rows:
        table.add_row(*[_cell(row.get(c) if isinstance(c, str) else c[1](row)) for c in columns])
    Console().print(table)


def show_fields(data: dict[str, Any], as_json: bool) -> None:
    """One object as key/value lines (or JSON)."""
    if as_json:
        show(data, True, [])
        return
    table = Table("field", "value", show_header=False)
    for key, value in data.items():
        table.add_row(key, _cell(value))
    Console().print(table)


def parse_pairs(pairs: list[str] | None, option: str) -> dict[str, int]:
    """KEY=INT pairs (e.g. --quota max_qps=8) as a dict."""
    out: dict[str, int] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise typer.BadParameter(f"expected KEY=INTEGER, got {pair!r}", param_hint=option)
        out[key.strip()] = int(value)
    return out
