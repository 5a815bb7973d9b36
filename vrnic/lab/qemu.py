"""QEMU command lines for lab guests, built from plain data with no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vrnic.errors import InvalidArgument

# Proven on this kind of machine: KVM is unusable here, so TCG; quiet console;
# a panic or oops ends the guest instead of hanging it.
KERNEL_ARGS = ("console=ttyS0", "quiet", "loglevel=4", "panic=-1", "oops=panic", "mitigations=off")
NINEP_OPTS = "security_model=none,multidevs=remap"  # without remap the guest lost /proc
# The emulated VT-d for --sriov-nic. It must come before the PCI devices it translates. Under TCG the
# interrupt controller is QEMU's own, so interrupt remapping needs no kernel-irqchip=split.
# iommu=pt: host-owned devices (the PF, virtio) keep identity DMA; only vfio-pci domains translate.
IOMMU_DEVICE = "intel-iommu,intremap=on"
IOMMU_KERNEL_ARGS = ("intel_iommu=on", "iommu=pt")
# The emulated CPU: everything TCG offers (svm and npt for nested KVM) but AVX. With AVX, glibc picks its AVX2
# memcpy, which TCG runs 5-8x slower than the SSE2 one it picks without (a 64 KiB bytearray copy in the lab: 0.96
# and 1.21 s for 3000 against 0.15 and 0.21, four boots in turns); Python, QEMU inside the lab and the data path
# copy all the time.
TCG_CPU = "max,-avx,-avx2,-vaes,-vpclmulqdq"


@dataclass(frozen=True)
class DgramLink:
    """A point-to-point Ethernet link to another guest over UDP on loopback.

    QEMU's socket/stream netdevs leave Nagle on, which makes RC round trips
    about 100x slower; dgram does not.
    """

    local_port: int
    remote_port: int
    mac: str
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class GuestSpec:
    kernel: Path
    initrd: Path
    work_dir: Path
    run_dir: Path
    role: str = "a"  # picks the run's guest script: <run_dir>/guest-<role>.sh
    cpus: int = 2
    memory_mb: int = 2048
    link: DgramLink | None = None
    sriov_nic: bool = False  # an emulated Intel 82576 (igb) with real SR-IOV VFs; needs QEMU >= 8.0
    # With sriov_nic: an emulated Intel IOMMU, so a VF can be bound to vfio-pci and handed to a nested VM.
    sriov_iommu: bool = True
    qemu: str = "qemu-system-x86_64"
    extra_kernel_args: tuple[str, ...] = field(default_factory=tuple)


def _check_path(name: str, path: Path) -> str:
    text = str(path)
    if not path.is_absolute():
        raise InvalidArgument(f"{name} must be an absolute path: {text}")
    # QEMU splits -virtfs options on ',' and the kernel cmdline on spaces.
    if any(c in text for c in " ,\t\n"):
        raise InvalidArgument(f"{name} may not contain spaces or commas: {text!r}")
    return text


def kernel_cmdline(spec: GuestSpec) -> str:
    work = _check_path("work_dir", spec.work_dir)
    run = _check_path("run_dir", spec.run_dir)
    ours = (f"vrnic.work={work}", f"vrnic.run={run}", f"vrnic.role={spec.role}")
    iommu = IOMMU_KERNEL_ARGS if spec.sriov_nic and spec.sriov_iommu else ()
    return " ".join((*KERNEL_ARGS, *iommu, *ours, *spec.extra_kernel_args))


def qemu_argv(spec: GuestSpec) -> list[str]:
    if spec.cpus < 1 or spec.memory_mb < 256:
        raise InvalidArgument(f"guest needs at least 1 CPU and 256 MiB (got {spec.cpus}, {spec.memory_mb})")
    work = _check_path("work_dir", spec.work_dir)
    argv = [
        spec.qemu,
        "-accel", "tcg", "-cpu", TCG_CPU,
        "-smp", str(spec.cpus), "-m", f"{spec.memory_mb}M",
        "-bios", "/usr/share/qemu/qboot.rom",
        "-display", "none", "-no-reboot", "-nodefaults", "-no-user-config",
        "-serial", "stdio",
        "-kernel", _check_path("kernel", spec.kernel),
        "-initrd", _check_path("initrd", spec.initrd),
        "-virtfs", f"local,path=/,mount_tag=hostroot,readonly=on,{NINEP_OPTS}",
        "-virtfs", f"local,path={work},mount_tag=work,{NINEP_OPTS}",
        "-append", kernel_cmdline(spec),
    ]
    if spec.sriov_nic:
        # SR-IOV is a PCIe extended capability: a q35 machine with the NIC behind a root port.
        argv += ["-machine", "q35"]
        if spec.sriov_iommu:
            argv += ["-device", IOMMU_DEVICE]
        argv += ["-device", "pcie-root-port,id=rp0,slot=1", "-device", "igb,bus=rp0,romfile="]
    if spec.link is None:
        argv += ["-nic", "none"]
    else:
        link = spec.link
        argv += [
            "-netdev",
            f"dgram,id=n0,local.type=inet,local.host={link.host},local.port={link.local_port},"
            f"remote.type=inet,remote.host={link.host},remote.port={link.remote_port}",
            "-device", f"virtio-net-pci,netdev=n0,mac={link.mac},romfile=",
        ]
    return argv
