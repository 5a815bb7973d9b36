"""Which Debian kernel the lab boots, and which module files a set of modules needs."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from vrnic.errors import LabError

BOOT = Path("/boot")
MODULES = Path("/lib/modules")
# 6.1 is proven for rxe and the netdevsim build; pick it explicitly so an
# installed 6.12 from bookworm-security does not change the lab under us.
PREFERRED_SERIES = "6.1."


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def choose_kernel(installed: Iterable[str], wanted: str | None = None) -> str:
    """The configured version if installed, else the newest 6.1, else the newest of any."""
    versions = sorted(installed, key=_version_key)
    if wanted:
        if wanted not in versions:
            raise LabError(f"kernel {wanted} is not installed (have: {', '.join(versions) or 'none'})")
        return wanted
    if not versions:
        raise LabError("no Debian kernel with modules is installed; run `make setup` "
                       "(apt install linux-image-amd64)")
    preferred = [v for v in versions if v.startswith(PREFERRED_SERIES)]
    return (preferred or versions)[-1]


def installed_kernels() -> list[str]:
    return [p.name.removeprefix("vmlinuz-") for p in BOOT.glob("vmlinuz-*")
            if (MODULES / p.name.removeprefix("vmlinuz-") / "modules.dep").exists()]


def kernel_image(version: str) -> Path:
    return BOOT / f"vmlinuz-{version}"


def parse_show_depends(text: str) -> list[Path]:
    """Module files from `modprobe --show-depends` output, in load order; builtins skipped."""
    return [Path(line.split()[1]) for line in text.splitlines() if line.startswith("insmod ")]


def module_files(version: str, names: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for name in names:
        result = subprocess.run(["modprobe", "-S", version, "--show-depends", name],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise LabError(f"module {name} not found for kernel {version}: {result.stderr.strip()}")
        files += [f for f in parse_show_depends(result.stdout) if f not in files]
    return files
