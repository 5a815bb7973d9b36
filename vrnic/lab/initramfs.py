"""A small busybox initramfs that boots Debian's kernel onto the host root over 9p.

Built once per kernel and init script, cached under the lab cache directory.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import shutil
import subprocess
import tempfile
from pathlib import Path

from vrnic.errors import LabError
from vrnic.lab.guest import initramfs_init
from vrnic.lab.kernel import module_files

BUSYBOX = Path("/bin/busybox")
BOOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p")


def _plain_name(module: Path) -> str:
    return module.name.removesuffix(".xz")


def ensure_initramfs(kernel_version: str, cache_dir: Path) -> Path:
    if not BUSYBOX.exists():
        raise LabError("busybox is missing; run `make setup` (apt install busybox-static)")
    modules = module_files(kernel_version, BOOT_MODULES)
    init = initramfs_init([_plain_name(m) for m in modules])
    key = hashlib.sha256("\n".join([init, *map(str, modules)]).encode()).hexdigest()[:12]
    target = cache_dir / kernel_version / f"initramfs-{key}.cpio.gz"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "newroot", "modules"):
            (root / d).mkdir()
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        for module in modules:
            data = module.read_bytes()
            if module.suffix == ".xz":
                data = lzma.decompress(data)
            (root / "modules" / _plain_name(module)).write_bytes(data)
        (root / "init").write_text(init)
        (root / "init").chmod(0o755)
        names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        archive = subprocess.run(["cpio", "--quiet", "-o", "-H", "newc"], cwd=root,
                                 input="\n".join(names).encode(), capture_output=True, check=False)
        if archive.returncode != 0:
            raise LabError(f"cpio failed: {archive.stderr.decode(errors='replace').strip()}")
    partial = target.with_suffix(".tmp")
    partial.write_bytes(gzip.compress(archive.stdout, compresslevel=6))
    partial.replace(target)
    return target
