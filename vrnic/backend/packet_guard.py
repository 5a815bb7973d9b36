"""The nftables edge of the RoCEv2 packet guard: runs `nft`, and nothing else does.

Scripts come from vrnic.core.roce_guard and go to `nft -f -` on stdin, one transaction each; state is
read back with `nft -j list table`. Every failure becomes a DeviceError carrying nft's stderr.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from vrnic.core import roce_guard
from vrnic.core.roce_guard import GuardFlow
from vrnic.errors import DeviceError


class PacketGuard:
    """The guard table in the host's nftables (init_net, where rxe's sockets live)."""

    def __init__(self, table: str = roce_guard.TABLE, nft: str = "nft") -> None:
        self.table = roce_guard.table_name(table)
        self._nft = nft

    def install(self, local_ips: list[str]) -> None:
        """Guard RoCE egress from these local IPs; repeatable, and flows already allowed stay."""
        self._apply(roce_guard.install_script(local_ips, self.table), f"install guard for {local_ips}")

    def allow(self, flow: GuardFlow) -> None:
        """Let one flow pass; allowing it again is a no-op, a key another owner holds is an error."""
        for present in self.flows():
            if present.key == flow.key:
                if present == flow:
                    return
                raise DeviceError(f"guard flow {flow} shares its packet key with {present}")
        self._apply(roce_guard.allow_script([flow], self.table), f"allow {flow}")

    def revoke(self, vrnic_id: str) -> None:
        """Drop every flow of one vRNIC, in one transaction; a vRNIC with none is fine."""
        script = roce_guard.revoke_script(vrnic_id, self.flows(), self.table)
        if script:
            self._apply(script, f"revoke guard flows of {vrnic_id}")

    def drop(self, flows: list[GuardFlow]) -> None:
        """Forget these flows (a QP destroyed or reset); flows not present are skipped."""
        present = set(self.flows())
        script = roce_guard.drop_script([f for f in flows if f in present], self.table)
        if script:
            self._apply(script, f"drop guard flows {flows}")

    def flows(self) -> list[GuardFlow]:
        """The allowed flows as the kernel holds them; none when the table is not installed."""
        listing = self._listing()
        try:
            return roce_guard.parse_flows(listing, self.table)
        except ValueError as exc:
            raise DeviceError(f"nft table {self.table}: {exc}") from exc

    def guarded_ips(self) -> list[str]:
        """The local IPs whose RoCE egress is guarded, as the kernel holds them."""
        return roce_guard.parse_guarded(self._listing(), self.table)

    def installed(self) -> bool:
        listing = self._run(["-j", "list", "tables", "inet"], None, "list nft tables")
        return any(item.get("table", {}).get("name") == self.table
                   for item in json.loads(listing or "{}").get("nftables", []))

    def remove(self) -> None:
        """Delete the table with all its flows; removing an absent guard is fine."""
        self._apply(roce_guard.remove_script(self.table), f"remove nft table {self.table}")

    def _listing(self) -> dict[str, Any]:
        if not self.installed():
            return {}
        text = self._run(["-j", "list", "table", "inet", self.table], None, f"list nft table {self.table}")
        try:
            listing: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DeviceError(f"nft -j list table inet {self.table}: not JSON ({exc})") from exc
        return listing

    def _apply(self, script: str, what: str) -> None:
        self._run(["-f", "-"], script, what)

    def _run(self, args: list[str], stdin: str | None, what: str) -> str:
        if shutil.which(self._nft) is None:
            raise DeviceError(f"{what}: the nft command is missing (install the Debian package nftables)")
        try:
            result = subprocess.run([self._nft, *args], input=stdin, capture_output=True, text=True,
                                    check=False, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DeviceError(f"{what}: nft did not run: {exc}") from exc
        if result.returncode != 0:
            raise DeviceError(f"{what}: nft failed: {result.stderr.strip() or f'exit {result.returncode}'}")
        return result.stdout
