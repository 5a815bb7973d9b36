"""Plain data of the SR-IOV mode: VF configuration, PFs and VFs as discovered, allocations, events."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum, StrEnum

from vrnic.errors import InvalidArgument

ZERO_MAC = "00:00:00:00:00:00"
MAX_VLAN = 4094  # 0 = untagged; 4095 is reserved by 802.1Q
MAX_QOS = 7  # 802.1p priority
_MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


class LinkState(IntEnum):
    """IFLA_VF_LINK_STATE values."""

    AUTO = 0  # follow the PF's link
    ENABLE = 1
    DISABLE = 2


class PfKind(StrEnum):
    PCI = "pci"
    NETDEVSIM = "netdevsim"  # the kernel's simulated device: VF config through netlink, no VF netdevs, no PCI


@dataclass(frozen=True)
class VfConfig:
    """Everything vrnic sets on a VF through netlink (rates in Mbit/s, 0 = none)."""

    mac: str = ZERO_MAC
    vlan: int = 0
    qos: int = 0
    max_tx_rate: int = 0
    min_tx_rate: int = 0
    spoofchk: bool = True
    trust: bool = False
    link_state: LinkState = LinkState.AUTO

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(VfConfig))

    def facts(self) -> frozenset[tuple[str, object]]:
        """The configuration as a set of (field, value): reconciliation is a difference of such sets."""
        return frozenset((name, getattr(self, name)) for name in self.field_names())


# The state a released VF is left in: nothing of the previous tenant survives. Spoof checking stays on so an
# unassigned VF cannot send with a forged source address either.
CLEAN_VF = VfConfig()


@dataclass(frozen=True)
class VfAddress:
    pf: str  # the PF netdev name
    index: int

    def __str__(self) -> str:
        return f"{self.pf}/vf{self.index}"


@dataclass(frozen=True)
class VfInfo:
    """A VF as discovered: its observed netlink configuration plus what sysfs says about it."""

    index: int
    config: VfConfig
    pci_address: str | None = None  # None on netdevsim
    netdev: str | None = None  # the VF's own netdev, when its driver is bound (never on netdevsim)
    rdma_device: str | None = None  # e.g. mlx5_3 for a RoCE VF


@dataclass(frozen=True)
class PfInfo:
    name: str  # PF netdev
    kind: PfKind
    bus_id: str  # PCI address (0000:03:00.0) or netdevsim device (netdevsim10)
    driver: str
    num_vfs: int
    total_vfs: int | None  # None when the device does not say (netdevsim without debugfs)
    eswitch_mode: str | None = None  # legacy / switchdev, through devlink where available
    rdma_device: str | None = None
    vfs: tuple[VfInfo, ...] = ()

    def vf(self, index: int) -> VfInfo | None:
        return next((v for v in self.vfs if v.index == index), None)


@dataclass(frozen=True)
class VfRequest:
    """What a tenant asks for; becomes a VfConfig once a MAC is chosen."""

    vlan: int = 0
    qos: int = 0
    max_tx_rate: int = 0
    min_tx_rate: int = 0
    mac: str | None = None  # None: generated from the vRNIC id
    link_state: LinkState = LinkState.AUTO

    def config(self, vrnic_id: str) -> VfConfig:
        mac = normalize_mac(self.mac) if self.mac is not None else generated_mac(vrnic_id)
        return VfConfig(mac=mac, vlan=self.vlan, qos=self.qos, max_tx_rate=self.max_tx_rate,
                        min_tx_rate=self.min_tx_rate, spoofchk=True, trust=False, link_state=self.link_state)


@dataclass(frozen=True)
class Allocation:
    """Desired state of one allocated VF (what the store persists)."""

    vrnic_id: str
    tenant: str
    address: VfAddress
    config: VfConfig
    netns: str | None = None  # the container namespace its netdev was moved into
    vanished: bool = False  # the VF disappeared in a forced VF-count change

    def with_config(self, config: VfConfig) -> Allocation:
        return replace(self, config=config)


class EventKind(StrEnum):
    ALLOCATED = "vf_allocated"
    RELEASED = "vf_released"
    DRIFT_CORRECTED = "vf_drift_corrected"
    VANISHED = "vf_vanished"
    REAPPLIED = "vf_reapplied"
    RESET = "vf_reset"
    NUM_VFS_CHANGED = "pf_num_vfs_changed"
    NETNS_MOVED = "vf_netns_moved"
    NETNS_RETURNED = "vf_netns_returned"
    RECONCILE_FAILED = "vf_reconcile_failed"
    UNOWNED_DIRTY = "vf_unowned_dirty"  # a VF nobody allocated carries tenant state and would not reset


@dataclass(frozen=True)
class VfEvent:
    kind: EventKind
    pf: str
    vf: int | None = None
    vrnic_id: str | None = None
    detail: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        where = self.pf if self.vf is None else f"{self.pf}/vf{self.vf}"
        extra = ", ".join(f"{k}={v}" for k, v in sorted(self.detail.items()))
        return f"{self.kind} {where}" + (f" ({self.vrnic_id})" if self.vrnic_id else "") + \
            (f": {extra}" if extra else "")


def normalize_mac(mac: str) -> str:
    value = mac.strip().lower().replace("-", ":")
    if not _MAC_RE.match(value):
        raise InvalidArgument(f"MAC {mac!r} is not of the form 02:00:00:00:00:01")
    return value


def generated_mac(vrnic_id: str) -> str:
    """A stable locally administered unicast MAC for a vRNIC (02:xx:..): the same id gets the same MAC."""
    digest = hashlib.sha256(vrnic_id.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def validate_tenant_config(config: VfConfig) -> None:
    """Reject what the kernel would refuse or what would break isolation, before touching anything."""
    mac = normalize_mac(config.mac)
    first = int(mac[:2], 16)
    if mac == ZERO_MAC:
        raise InvalidArgument("a tenant VF needs a MAC (00:00:00:00:00:00 is the released state)")
    if first & 1:
        raise InvalidArgument(f"MAC {config.mac} is a multicast address; a VF needs a unicast MAC")
    validate_config(config)


def validate_config(config: VfConfig) -> None:
    if not 0 <= config.vlan <= MAX_VLAN:
        raise InvalidArgument(f"VLAN {config.vlan} is out of range (0..{MAX_VLAN}, 0 = untagged)")
    if not 0 <= config.qos <= MAX_QOS:
        raise InvalidArgument(f"VLAN priority (qos) {config.qos} is out of range (0..{MAX_QOS})")
    if config.qos and not config.vlan:
        raise InvalidArgument("a VLAN priority (qos) needs a VLAN")
    if config.max_tx_rate < 0 or config.min_tx_rate < 0:
        raise InvalidArgument("tx rates are Mbit/s and cannot be negative")
    if config.max_tx_rate and config.min_tx_rate > config.max_tx_rate:
        raise InvalidArgument(f"min_tx_rate {config.min_tx_rate} Mbit/s (guarantee) exceeds "
                              f"max_tx_rate {config.max_tx_rate} Mbit/s (cap)")
