"""vrnic.lab.qemu_vm's pure parts (the QEMU command line, QEMU's migration numbers) and the migratable guest's
pure helpers in vrnic.lab.vm_guest (ldd output, which files go into the image)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vrnic.errors import InvalidArgument
from vrnic.lab.qemu import TCG_CPU
from vrnic.lab.qemu_vm import MigrationStats, QemuVmSpec, migration_stats, qemu_argv
from vrnic.lab.vm_guest import GUEST_PREFIX, guest_python_files, migratable_vm_spec, parse_ldd

pytestmark = pytest.mark.unit
W = Path("/w")
SPEC = QemuVmSpec(name="src", kernel=Path("/boot/vmlinuz"), initrd=W / "i.gz", cmdline="console=ttyS0 quiet",
                  ram_path=W / "src.ram", qmp_path=W / "src.qmp", console_log=W / "src.log",
                  channels=(("org.vrnic.0", W / "v.sock"), ("org.vrnic.ctl", W / "c.sock")))


def test_qemu_argv_source() -> None:
    assert qemu_argv(SPEC) == [
        "qemu-system-x86_64", "-name", "src",
        "-machine", "q35,memory-backend=mem",
        "-accel", "kvm", "-cpu", "host", "-smp", "1", "-m", "256M",
        "-object", "memory-backend-file,id=mem,size=256M,mem-path=/w/src.ram,share=on",
        "-bios", "/usr/share/qemu/qboot.rom",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
        "-kernel", "/boot/vmlinuz", "-initrd", "/w/i.gz", "-append", "console=ttyS0 quiet",
        "-chardev", "file,id=console,path=/w/src.log", "-serial", "chardev:console",
        "-qmp", "unix:/w/src.qmp,server=on,wait=off",
        "-device", "virtio-serial-pci,id=vser0",
        "-chardev", "socket,id=ch0,path=/w/v.sock,server=on,wait=off",
        "-device", "virtserialport,bus=vser0.0,nr=1,chardev=ch0,id=port0,name=org.vrnic.0",
        "-chardev", "socket,id=ch1,path=/w/c.sock,server=on,wait=off",
        "-device", "virtserialport,bus=vser0.0,nr=2,chardev=ch1,id=port1,name=org.vrnic.ctl",
    ]


def test_qemu_argv_destination_tcg_no_channels() -> None:
    argv = qemu_argv(replace(SPEC, accel="tcg", channels=(), incoming="unix:/w/mig.sock", bios=None,
                             memory_mib=512))
    assert argv[argv.index("-accel"):argv.index("-accel") + 4] == ["-accel", "tcg", "-cpu", TCG_CPU]
    assert "size=512M" in argv[argv.index("-object") + 1]
    assert "-bios" not in argv and "virtio-serial-pci,id=vser0" not in argv
    assert argv[-3:] == ["-incoming", "unix:/w/mig.sock", "-S"]


@pytest.mark.parametrize("change", [{"memory_mib": 32}, {"accel": "hvf"},
                                    {"channels": (("a", W / "1"), ("a", W / "2"))}])
def test_spec_rejects(change: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        replace(SPEC, **change)  # type: ignore[arg-type]


@pytest.mark.parametrize("change", [{"ram_path": Path("rel.ram")}, {"qmp_path": Path("/w/a,b")}])
def test_argv_rejects_paths_qemu_would_misread(change: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        qemu_argv(replace(SPEC, **change))  # type: ignore[arg-type]


def test_migration_stats_from_query_migrate() -> None:
    info = {"status": "completed", "setup-time": 14, "downtime": 73, "total-time": 8231,
            "ram": {"transferred": 103614447, "total": 268771328}}
    stats = migration_stats(info, MigrationStats(issued_at=10.0, completed_at=18.5))
    assert (stats.total_ms, stats.downtime_ms, stats.setup_ms, stats.ram_transferred) == (8231, 73, 14, 103614447)
    assert stats.wall_ms == 8500
    assert migration_stats({"status": "failed"}, MigrationStats()).total_ms is None


def test_migratable_specs_differ_only_in_their_own_files() -> None:
    src = migratable_vm_spec("src", W, W / "i.gz")
    dst = migratable_vm_spec("dst", W, W / "i.gz", incoming="unix:/w/mig.sock")
    assert [name for name, _ in src.channels] == [name for name, _ in dst.channels] == ["org.vrnic.0",
                                                                                        "org.vrnic.ctl"]
    assert src.ram_path != dst.ram_path and set(src.sockets).isdisjoint(dst.sockets)
    assert qemu_argv(replace(dst, name="src", ram_path=src.ram_path, qmp_path=src.qmp_path,
                             console_log=src.console_log, channels=src.channels, incoming=None)) == qemu_argv(src)


def test_parse_ldd() -> None:
    text = ("\tlinux-vdso.so.1 (0x00007ffd)\n"
            "\tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x00007f54)\n"
            "\tlibgone.so.1 => not found\n"
            "\t/lib64/ld-linux-x86-64.so.2 (0x00007f54)\n"
            "\tstatically linked\n")
    assert parse_ldd(text) == [Path("/lib/x86_64-linux-gnu/libm.so.6"), Path("/lib64/ld-linux-x86-64.so.2")]


def test_guest_python_files(tmp_path: Path) -> None:
    stdlib = tmp_path / "usr/lib/python3.11"
    (stdlib / "__pycache__").mkdir(parents=True)
    (stdlib / "__pycache__/os.cpython-311.pyc").touch()
    project = tmp_path / "proj"
    compiled = tmp_path / "compiled"
    loaded = [f"{stdlib}/os.py", f"{stdlib}/site.py", f"{stdlib}/lib-dynload/mmap.so",
              f"{stdlib}/lib-dynload/_hashlib.cpython-311-x86_64-linux-gnu.so",
              f"{project}/vrnic/errors.py", "/usr/lib/python3/dist-packages/_distutils_hack/__init__.py"]
    copies = guest_python_files(loaded, stdlib, project, compiled, "cpython-311")
    image = GUEST_PREFIX.lstrip("/")
    root = str(stdlib).lstrip("/")
    assert copies == {
        f"{root}/os.py": stdlib / "os.py",
        f"{root}/__pycache__/os.cpython-311.pyc": stdlib / "__pycache__/os.cpython-311.pyc",
        f"{root}/site.py": stdlib / "site.py",  # no .pyc on the host: none in the image
        f"{root}/lib-dynload/mmap.so": stdlib / "lib-dynload/mmap.so",
        f"{image}/vrnic/errors.py": project / "vrnic/errors.py",
        f"{image}/vrnic/__pycache__/errors.cpython-311.pyc": compiled / "vrnic/errors.pyc",
    }
