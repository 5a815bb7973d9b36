"""Settings from environment variables (VRNIC_*) and an optional file (VRNIC_CONFIG)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from vrnic.core.specs import HOST_NAME_PATTERN
from vrnic.defaults import DEFAULT_STATE_DIR

PROJECT_DIR = Path(__file__).resolve().parents[1]
# Set inside a lab guest: the lab's writable output dir (<work_dir>/.lab), which both guests of two-hosts see.
LAB_OUTPUT_DIR_ENV = "VRNIC_LAB_OUTPUT_DIR"


def lab_output_dir(*parts: str) -> Path:
    """A path under the lab's output dir. Inside a guest the project dir is writable only if it is the lab's
    work dir (the code may be imported from a checkout the guest sees on its read-only root)."""
    base = os.environ.get(LAB_OUTPUT_DIR_ENV)
    return Path(base, *parts) if base else PROJECT_DIR.joinpath(".lab", *parts)


class LabSettings(BaseSettings):
    """The lab: a throw-away QEMU (TCG) guest running Debian's kernel with Soft-RoCE."""

    model_config = SettingsConfigDict(env_prefix="VRNIC_LAB_", env_file=os.environ.get("VRNIC_CONFIG"),
                                      extra="ignore")

    kernel_version: str | None = None  # default: the newest installed 6.1 kernel with modules
    work_dir: Path = PROJECT_DIR  # shared read-write into the guest at the same path
    venv: Path = Path("/opt/vrnic/venv")  # must live outside work_dir (9p imports are slow)
    cache_dir: Path = Path("/var/cache/vrnic")
    qemu: str = "qemu-system-x86_64"
    # QEMU >= 8.0 for --sriov-nic (igb); make setup unpacks bookworm-backports' QEMU 10 here
    # (VRNIC_LAB_SRIOV_QEMU_DIR, the same variable setup.sh reads).
    sriov_qemu_dir: Path = Path("/opt/vrnic/qemu10")
    memory_mb: int = 2048
    cpus: int = 2
    two_hosts_cpus: int = 1  # per guest of --topology two-hosts; 2 each was no faster on a 2-core host
    netdevsim_vfs: int = 4

    def qemu_for(self, sriov_nic: bool) -> str:
        return str(self.sriov_qemu_dir / "qemu-system-x86_64") if sriov_nic else self.qemu


class DaemonSettings(BaseSettings):
    """`vrnic daemon`: the backend (vrnicd) and the REST API in one process per host."""

    model_config = SettingsConfigDict(env_prefix="VRNIC_", env_file=os.environ.get("VRNIC_CONFIG"),
                                      extra="ignore")

    state_dir: Path = DEFAULT_STATE_DIR
    database_url: str | None = None  # default: SQLite file state_dir/vrnic.db; or postgresql+psycopg://...
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(8470, ge=0, le=65535)
    operator_token: SecretStr | None = None  # unset: generated once into state_dir/operator-token
    # how this host registers itself
    host_name: str = Field(default_factory=socket.gethostname, pattern=HOST_NAME_PATTERN)
    paravirtual_driver: str | None = "verbs"  # RnicDriver entry point; skipped with a log line if absent
    paravirtual_driver_options: dict[str, Any] = {}
    sriov_driver: str | None = "sriov"
    sriov_driver_options: dict[str, Any] = {}
    # The guest channel (paravirtual mode): who may connect, and how much idle clients may hold.
    channel_socket_mode: int = Field(0o660, ge=0, le=0o777)  # e.g. VRNIC_CHANNEL_SOCKET_MODE=432 (0o660)
    channel_socket_group: str | None = None  # a group name or number; unset: vrnicd's own group
    channel_attach_deadline_s: float = Field(5.0, gt=0)
    channel_max_pending_per_uid: int = Field(32, ge=1)
    channel_max_pending_total: int = Field(256, ge=1)
    channel_max_sessions: int = Field(1024, ge=1)
    # The direct engine hands a guest its uverbs fd; "required" refuses guests whose cgroup cannot be limited.
    direct_containment: Literal["required", "best-effort"] = "required"
    # Filter RoCE egress of the served devices to the flows vrnicd connected (nftables; kernel/roce_guard/).
    packet_guard: bool = False
    # Refuse the direct engine where the guard cannot hold: guard off, or a device whose own traffic bypasses it.
    strict_isolation: bool = False
    sriov_reconcile_interval: float = Field(30.0, ge=0)  # seconds between SR-IOV reconcile passes; 0: startup only
    # QoS on paravirtual vRNICs (rxe: HTB on the uplink netdev): the link's speed where sysfs has none (veth,
    # virtio-net), needed for guarantees; and how often drift in the kernel is put back (0: never).
    qos_link_mbps: int | None = Field(None, ge=1, le=10_000_000)
    qos_reconcile_interval: float = Field(30.0, ge=0)
    # Multi-host: what other agents and API servers use to reach this host (default: http://listen_host:port),
    # the token agents present to each other's /agent/v1 routes (default: the operator token), the heartbeat,
    # and the cap of live vRNICs recorded for each device of this host (None: no cap).
    advertise_url: str | None = None
    agent_token: SecretStr | None = None
    heartbeat_interval_s: float = Field(2.0, gt=0)
    host_down_after_s: float | None = Field(None, gt=0)  # default: 3 heartbeats
    device_max_vrnics: int | None = Field(None, ge=0, le=1 << 20)
    # libvirt on this host (e.g. qemu:///system): a domain that arrives paused by `virsh migrate --live --suspend`
    # runs once its vRNICs are handed over here (None: nobody resumes it; the operator does)
    libvirt_uri: str | None = None
    log_level: str = "info"

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{self.state_dir / 'vrnic.db'}"

    @property
    def api_url(self) -> str:
        """Where this host's API and agent routes are reached from other hosts."""
        return (self.advertise_url or f"http://{self.listen_host}:{self.listen_port}").rstrip("/")

    @property
    def down_after_s(self) -> float:
        return self.host_down_after_s if self.host_down_after_s is not None else 3 * self.heartbeat_interval_s

    @property
    def agent_secret(self) -> str | None:
        """The agent token, else the operator token."""
        token = self.agent_token or self.operator_token
        return token.get_secret_value() if token is not None else None

    @property
    def operator_token_file(self) -> Path:
        return self.state_dir / "operator-token"


def settings_problem(exc: ValidationError) -> str:
    """A bad setting as an operator reads it: the variable to change, what is wrong, and the value it had."""
    return "; ".join(f"VRNIC_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']} (got {e['input']!r})"
                     for e in exc.errors())
