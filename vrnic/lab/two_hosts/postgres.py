"""A real PostgreSQL server on a lab host, reachable from the other host (trust auth on the lab subnet).

There is no init system in the lab guest: initdb and pg_ctl run by hand, as the postgres user (PostgreSQL
refuses root). The data lives on the guest's tmpfs; fsync is off (a throw-away cluster).
"""

from __future__ import annotations

import glob
import ipaddress
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

from vrnic.errors import LabError

DEFAULT_PORT = 5432


def pg_bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise LabError("PostgreSQL is not installed (/usr/lib/postgresql/*/bin); `make setup` installs it")
    return Path(found[-1]).parent


class LabPostgres:
    """initdb + pg_ctl in root (a fresh dir), listening on addr:port and on a unix socket in root."""

    def __init__(self, addr: str, root: Path, port: int = DEFAULT_PORT, subnet_prefix: int = 24) -> None:
        self.addr, self.port, self.root = addr, port, root
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.subnet = ipaddress.ip_network(f"{addr}/{subnet_prefix}", strict=False)
        self.bin = pg_bin_dir()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *argv: str, timeout: float = 120) -> str:
        result = subprocess.run([*self.as_user, *argv], capture_output=True, text=True, timeout=timeout,
                                check=False)
        if result.returncode != 0:
            raise LabError(f"{Path(argv[0]).name} failed (exit {result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-800:]}\n{self.log_tail()}")
        return result.stdout

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def _options(self) -> str:
        # fsync off: a test cluster; max_connections: two agents' pools, the tests' engines, the racers.
        return (f"-p {self.port} -k {self.root} -c listen_addresses='{self.addr}' -c fsync=off"
                f" -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.as_user:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync",
                  "-E", "UTF8", "--locale=C")
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.subnet} trust  # the lab's hosts\n")
        self._pg_ctl("start")

    def _pg_ctl(self, action: str, *extra: str) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "90",
                  "-o", self._options, *extra, action)

    def restart(self, mode: Literal["smart", "fast", "immediate"] = "fast") -> float:
        """pg_ctl restart -m mode: every client connection is cut. Returns the seconds it took."""
        started = time.monotonic()
        self._pg_ctl("restart", "-m", mode)
        return time.monotonic() - started

    def stop(self, mode: Literal["smart", "fast", "immediate"] = "fast") -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
                       capture_output=True, timeout=90, check=False)

    def create_database(self, name: str) -> str:
        """CREATE DATABASE name; returns its URL for the other hosts (SQLAlchemy, psycopg 3)."""
        self._run(str(self.bin / "createdb"), "-h", str(self.root), "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@{self.addr}:{self.port}/{database}"
