"""Settings from environment variables (VRNIC_*) and an optional file (VRNIC_CONFIG)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_DIR = Path(__file__).resolve().parents[1]


class LabSettings(BaseSettings):
    """The bench: a throw-away QEMU (TCG) guest running Debian's kernel with Soft-RoCE."""

    model_config = SettingsConfigDict(env_prefix="VRNIC_LAB_", env_file=os.environ.get("VRNIC_CONFIG"),
                                      extra="ignore")

    kernel_version: str | None = None  # default: the newest installed 6.1 kernel with modules
    work_dir: Path = PROJECT_DIR  # shared read-write into the guest at the same path
    venv: Path = Path("/opt/vrnic/venv")  # must live outside work_dir (9p imports are slow)
    cache_dir: Path = Path("/var/cache/vrnic")
    qemu: str = "qemu-system-x86_64"
    memory_mb: int = 2048
    cpus: int = 2
    netdevsim_vfs: int = 4
