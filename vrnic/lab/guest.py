"""Scripts that run inside lab guests, generated from plain data with no I/O.

Two scripts: the initramfs /init (generic, cached per kernel) mounts the host
root read-only over 9p plus the work directory read-write and switches root;
the per-run guest script then builds the topology (Soft-RoCE on veth or on a
virtio NIC, optionally netdevsim VFs) and runs the user's command.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from vrnic.config import LAB_OUTPUT_DIR_ENV
from vrnic.errors import InvalidArgument

MARKER = "@@vrnic-lab:"  # console lines the runner turns into progress
EXIT_BOOT_FAILURE = 125  # the guest never reached the command
EXIT_TIMEOUT = 124  # as timeout(1)
EXIT_GUEST_LOST = 126  # the guest died while the command ran

PAIR_ADDRS = ("10.77.1.1", "10.77.1.2")
PAIR_MACS = ("02:77:01:00:00:01", "02:77:01:00:00:02")
TWO_HOSTS_ADDRS = ("10.77.0.1", "10.77.0.2")
TWO_HOSTS_MACS = ("52:54:00:77:00:01", "52:54:00:77:00:02")
ROLES = ("a", "b")
NETDEVSIM_ID = 10


class Topology(StrEnum):
    SINGLE = "single"  # rxe0 on one end of a veth pair
    PAIR = "pair"  # rxe0 and rxe1 on the two ends of a veth pair, traffic really crosses it
    TWO_HOSTS = "two-hosts"  # two guests wired by a QEMU dgram link, rxe0 in each


@dataclass(frozen=True)
class GuestPlan:
    topology: Topology
    command: Sequence[str]
    cwd: Path
    rc_file: Path
    venv: Path
    role: str = "a"
    netdevsim_ko: Path | None = None
    netdevsim_vfs: int = 4
    sriov_nic: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    # Where the guest's programs write what must outlive the run or be seen by both guests: under the lab's
    # read-write work share (the project dir as this checkout's code sees it may be only on the read-only root).
    output_dir: Path | None = None


HEARTBEAT_S = 5  # how often a guest that runs its command touches its heartbeat file


def heartbeat_script(heartbeat: str, period_s: float = HEARTBEAT_S, fifo_dir: str = "/dev/shm") -> str:
    """The guest's heartbeat, in the background: the host watches the mtime of the file heartbeat (a path quoted
    for the shell; vrnic/lab/runner.py). Each beat needs a task on every CPU to have run: a CPU stuck in nested KVM
    runs nothing while the others carry on, so only a beat that needs all of them stops. A bash subshell pinned to
    each CPU answers each beat through a FIFO. Bash builtins only, once it runs: a process started under TCG costs
    about 0.2 s of CPU, and a beat that started a few took a second of the guest's CPU every 5 s (README)."""
    fifo = f"{fifo_dir}/vrnic-beat"
    return f"""( cpus=$(seq 0 $(($(getconf _NPROCESSORS_ONLN) - 1)))
  mkfifo {fifo}-nap $(for cpu in $cpus; do echo {fifo}-ask-$cpu {fifo}-ack-$cpu; done) || exit 1
  for cpu in $cpus; do
    ( taskset -p -c "$cpu" "$BASHPID" >/dev/null
      exec 3<>{fifo}-ask-$cpu 4<>{fifo}-ack-$cpu
      while read -r -u 3 _; do echo >&4; done ) &
  done
  exec 3<>{fifo}-nap  # nothing writes here: a read of it with a timeout is a sleep that starts no process
  while :; do
    for cpu in $cpus; do echo > {fifo}-ask-$cpu; done
    for cpu in $cpus; do read -r _ < {fifo}-ack-$cpu; done
    echo "$EPOCHSECONDS" > {heartbeat}
    read -r -t {period_s} -u 3 _
  done ) </dev/null >/dev/null 2>&1 &"""


def heartbeat_file(rc_file: Path) -> Path:
    """Where the guest writes its heartbeat while the command runs: next to its rc file, on the work share."""
    return rc_file.with_name(rc_file.name + ".heartbeat")


def ipv4_gid_suffix(addr: str) -> str:
    """The tail of the IPv4-mapped GID sysfs shows for addr ('10.77.1.1' -> 'ffff:0a4d:0101')."""
    packed = ipaddress.IPv4Address(addr).packed
    return f"ffff:{packed[0]:02x}{packed[1]:02x}:{packed[2]:02x}{packed[3]:02x}"


def initramfs_init(module_files: Sequence[str]) -> str:
    """busybox /init: load the 9p stack, mount the host root, switch to the run's guest script."""
    insmods = "\n".join(f"insmod /modules/{name} || fail 'insmod {name}'" for name in module_files)
    return f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
fail() {{ echo "{MARKER}boot-failed $*"; echo b > /proc/sysrq-trigger; sleep 5; }}
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
{insmods}
for word in $(cat /proc/cmdline); do
  case "$word" in vrnic.work=*) work=${{word#vrnic.work=}};; vrnic.run=*) run=${{word#vrnic.run=}};;
    vrnic.role=*) role=${{word#vrnic.role=}};; esac
done
[ -n "$work" ] && [ -n "$run" ] && [ -n "$role" ] || fail "vrnic.work/run/role missing from the kernel command line"
mkdir -p /newroot
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=262144,cache=loose hostroot /newroot \\
  || fail "mount hostroot"
for d in tmp var/tmp run; do mount -t tmpfs -o mode=1777 tmpfs /newroot/$d || fail "tmpfs $d"; done
mkdir -p "/newroot$work" 2>/dev/null  # only possible, and only needed, under the guest's tmpfs
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 work "/newroot$work" || fail "mount work"
for d in dev proc sys; do mount --move /$d /newroot/$d; done
echo "{MARKER}step root filesystem mounted"
exec switch_root /newroot /bin/bash "$run/guest-$role.sh"
"""


def _wait_gid(dev: str, addr: str) -> str:
    suffix = ipv4_gid_suffix(addr)
    return (f"for _ in $(seq 200); do grep -qs '{suffix}' /sys/class/infiniband/{dev}/ports/1/gids/* && break;"
            f" sleep 0.05; done\n"
            f"grep -qs '{suffix}' /sys/class/infiniband/{dev}/ports/1/gids/* || fail 'no GID for {addr} on {dev}'")


def _pair_setup(devices: int) -> list[str]:
    """rxe on both ends of one veth pair, with the routing that makes traffic cross the veth.

    Both addresses are local, so by default the kernel routes via lo and rxe
    hands the packet back to the sender; RTR then fails. Policy routing for
    locally generated packets plus accept_local fixes it (FACTS.md).
    """
    a, b = PAIR_ADDRS
    lines = [
        f"ip link add veth0 address {PAIR_MACS[0]} type veth peer name veth1 address {PAIR_MACS[1]} || fail 'veth'",
        f"ip addr add {a}/24 dev veth0 && ip addr add {b}/24 dev veth1 || fail 'addresses'",
        "for c in all default veth0 veth1; do sysctl -qw net.ipv4.conf.$c.accept_local=1"
        " net.ipv4.conf.$c.rp_filter=0; done",
        "ip link set veth0 up && ip link set veth1 up || fail 'link up'",
        f"ip rule add pref 100 from {a} to {b} iif lo lookup 101",
        f"ip rule add pref 100 from {b} to {a} iif lo lookup 101",
        f"ip route add {b}/32 dev veth0 src {a} table 101",
        f"ip route add {a}/32 dev veth1 src {b} table 101",
        "ip rule add pref 1000 lookup local && ip rule del pref 0 lookup local || fail 'local rule'",
        f"ip neigh replace {b} lladdr {PAIR_MACS[1]} dev veth0 nud permanent",
        f"ip neigh replace {a} lladdr {PAIR_MACS[0]} dev veth1 nud permanent",
    ]
    for index in range(devices):
        lines.append(f"rdma link add rxe{index} type rxe netdev veth{index} || fail 'rdma link add rxe{index}'")
    for index in range(devices):
        lines.append(_wait_gid(f"rxe{index}", PAIR_ADDRS[index]))
    devs = " ".join(f"rxe{i}" for i in range(devices))
    lines.append(f'step "Soft-RoCE ready: {devs} on veth0/veth1"')
    return lines


def _two_hosts_setup(role: str) -> list[str]:
    index = ROLES.index(role)
    addr = TWO_HOSTS_ADDRS[index]
    return [
        "modprobe virtio_net || fail 'modprobe virtio_net'",
        "for _ in $(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.05; done",
        f"ip addr add {addr}/24 dev eth0 && ip link set eth0 up || fail 'eth0'",
        "rdma link add rxe0 type rxe netdev eth0 || fail 'rdma link add rxe0'",
        _wait_gid("rxe0", addr),
        f'step "Soft-RoCE ready: rxe0 on eth0 ({addr})"',
    ]


def _netdevsim_setup(ko: Path, vfs: int) -> list[str]:
    dev = f"/sys/bus/netdevsim/devices/netdevsim{NETDEVSIM_ID}"
    return [
        "modprobe psample || fail 'modprobe psample'",
        f"insmod {shlex.quote(str(ko))} || fail 'insmod netdevsim'",
        f"echo '{NETDEVSIM_ID} 1' > /sys/bus/netdevsim/new_device || fail 'netdevsim new_device'",
        f"for _ in $(seq 100); do ls {dev}/net/ >/dev/null 2>&1 && break; sleep 0.05; done",
        f"echo {vfs} > {dev}/sriov_numvfs || fail 'netdevsim sriov_numvfs'",
        f"export VRNIC_LAB_NETDEVSIM_DEV=netdevsim{NETDEVSIM_ID} VRNIC_LAB_NETDEVSIM_PF=$(ls {dev}/net/)",
        f'step "netdevsim PF $VRNIC_LAB_NETDEVSIM_PF with {vfs} VFs"',
    ]


def _sriov_nic_setup() -> list[str]:
    """The emulated igb PF and the igbvf driver for its VFs (VFs appear when sriov_numvfs is written)."""
    return [
        "modprobe igb && modprobe igbvf || fail 'modprobe igb igbvf'",
        "for _ in $(seq 100); do ls /sys/bus/pci/drivers/igb/*/net/ >/dev/null 2>&1 && break; sleep 0.05; done",
        "export VRNIC_LAB_SRIOV_PF=$(ls /sys/bus/pci/drivers/igb/*/net/ 2>/dev/null | head -1)",
        '[ -n "$VRNIC_LAB_SRIOV_PF" ] || fail "no igb netdev"',
        'step "SR-IOV NIC: igb PF $VRNIC_LAB_SRIOV_PF,'
        ' $(cat /sys/class/net/$VRNIC_LAB_SRIOV_PF/device/sriov_totalvfs) VFs possible"',
    ]


def lab_env(plan: GuestPlan) -> dict[str, str]:
    """What a command learns about its lab from the environment."""
    env = {"VRNIC_LAB": "1", "VRNIC_LAB_TOPOLOGY": str(plan.topology), "VRNIC_LAB_ROLE": plan.role}
    if plan.topology is Topology.TWO_HOSTS:
        index = ROLES.index(plan.role)
        env |= {
            "VRNIC_LAB_ADDR_A": TWO_HOSTS_ADDRS[0], "VRNIC_LAB_ADDR_B": TWO_HOSTS_ADDRS[1],
            "VRNIC_LAB_LOCAL_ADDR": TWO_HOSTS_ADDRS[index], "VRNIC_LAB_PEER_ADDR": TWO_HOSTS_ADDRS[1 - index],
            "VRNIC_LAB_RXE_DEVICES": "rxe0",
        }
    else:
        count = 2 if plan.topology is Topology.PAIR else 1
        env |= {"VRNIC_LAB_ADDR_A": PAIR_ADDRS[0], "VRNIC_LAB_RXE_DEVICES": " ".join(
            f"rxe{i}" for i in range(count))}
        if count == 2:
            env["VRNIC_LAB_ADDR_B"] = PAIR_ADDRS[1]
    if plan.output_dir is not None:
        env[LAB_OUTPUT_DIR_ENV] = str(plan.output_dir)
    return env | dict(plan.env)



def guest_script(plan: GuestPlan) -> str:
    """The bash script the guest runs as PID 1 after switch_root."""
    if not plan.command:
        raise InvalidArgument("no command to run in the guest")
    if plan.role not in ROLES:
        raise InvalidArgument(f"role must be one of {ROLES}, not {plan.role!r}")
    if plan.sriov_nic and plan.topology is Topology.TWO_HOSTS:
        raise InvalidArgument("the SR-IOV NIC is available in the single and pair topologies")
    if plan.netdevsim_ko is not None and not 1 <= plan.netdevsim_vfs <= 64:
        raise InvalidArgument(f"netdevsim VF count must be 1..64, not {plan.netdevsim_vfs}")
    venv = shlex.quote(str(plan.venv))
    rc = shlex.quote(str(plan.rc_file))
    heartbeat = shlex.quote(str(heartbeat_file(plan.rc_file)))
    if plan.topology is Topology.TWO_HOSTS:
        topology = _two_hosts_setup(plan.role)
    else:
        topology = _pair_setup(2 if plan.topology is Topology.PAIR else 1)
    netdevsim = [] if plan.netdevsim_ko is None else _netdevsim_setup(plan.netdevsim_ko, plan.netdevsim_vfs)
    netdevsim += _sriov_nic_setup() if plan.sriov_nic else []
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(lab_env(plan).items()))
    body = "\n".join([*topology, *netdevsim])
    command = " ".join(shlex.quote(arg) for arg in plan.command)
    return f"""#!/bin/bash
# Generated by vrnic.lab.guest; runs as PID 1 inside the lab guest.
set -u
export PATH={venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export VIRTUAL_ENV={venv} HOME=/root TERM=dumb LANG=C.UTF-8 PYTHONUNBUFFERED=1
step() {{ echo "{MARKER}step $*"; }}
finish() {{
  echo "$1" > {rc}.tmp && mv {rc}.tmp {rc}
  sync
  echo "{MARKER}exit $1"
  sleep 0.3  # printk overtakes tty output: let the marker drain before the reset message
  echo b > /proc/sysrq-trigger
  sleep 10
}}
fail() {{ echo "{MARKER}setup-failed $*"; finish {EXIT_BOOT_FAILURE}; }}
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
mount -t cgroup2 cgroup2 /sys/fs/cgroup
dmesg -n 1
ip link set lo up
hostname lab-{plan.role}  # the kernel's default, "(none)", is no host name vrnic accepts
modprobe rdma_rxe || fail 'modprobe rdma_rxe'
{body}
{exports}
echo "{MARKER}ready"
{heartbeat_script(heartbeat)}
cd {shlex.quote(str(plan.cwd))} 2>/dev/null || cd /
{command} </dev/null
finish $?
"""
