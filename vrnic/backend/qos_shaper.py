"""QoS mechanisms: how a vRNIC's policy (vrnic.core.qos) is enforced on a device. The seam is QosMechanism; a
second mechanism (a hardware RNIC's per-QP rate limit, or ETS per traffic class) is a new class.

HtbShaper is the mechanism for rxe (and any RoCE device whose packets cross its netdev's egress): an HTB
qdisc on the uplink netdev, one class per vRNIC, one u32 filter per connected QP matching its UDP source
port. It talks netlink through pyroute2 and keeps no state the kernel does not also hold: reconcile()
reads the qdisc back and applies the set difference. Packets rxe loops back between its own QPs on one
netdev never reach the qdisc (../shared/FACTS.md), so QoS covers traffic that leaves the host's netdev.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import struct
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vrnic.core.qos import (
    FILTER_PRIO,
    LEAF_MAJOR,
    PARENT_MINOR,
    ROOT_HANDLE,
    Drift,
    Filter,
    FlowKey,
    HtbClass,
    Shaped,
    admit,
    drift,
    key_of,
    next_minor,
    plan_classes,
    rx_qpn_of,
    rx_u32_keys,
    u32_keys,
)
from vrnic.core.roce_guard import rxe_create_sport, rxe_udp_sport
from vrnic.core.specs import QosPolicy
from vrnic.errors import Conflict, DeviceError, NotSupported

log = logging.getLogger(__name__)
SYS_NET = Path("/sys/class/net")
ETH_P_IP = 0x0800  # pyroute2 puts it in network order itself
INGRESS_HANDLE = 0xFFFF0000  # the ingress qdisc's one handle (ffff:)
TC_H_INGRESS = 0xFFFFFFF1


@dataclass(frozen=True)
class ClassCounters:
    bytes: int
    packets: int


class QosMechanism(ABC):
    """Enforces vRNICs' QoS on one device."""

    link_mbps: int | None

    @abstractmethod
    def set_policy(self, vrnic_id: str, policy: QosPolicy) -> None:
        """Create or change the vRNIC's share (live: its QPs keep their connections). Refuses what it cannot
        enforce (a guarantee the link cannot give) with the numbers."""

    @abstractmethod
    def forget(self, vrnic_id: str) -> None:
        """The vRNIC is gone: its class and every filter into it."""

    @abstractmethod
    def flow_key(self, qpn: int, dest_qpn: int | None) -> FlowKey:
        """What a QP's packets are told apart by, once connected to dest_qpn (None: a UD QP)."""

    @abstractmethod
    def classify(self, vrnic_id: str, key: FlowKey) -> None:
        """A QP of the vRNIC connected: its packets go to the vRNIC's class."""

    @abstractmethod
    def unclassify(self, vrnic_id: str, key: FlowKey) -> None: ...

    def count_received(self, vrnic_id: str, qpn: int) -> None:  # noqa: B027 (optional for a mechanism)
        """Count what arrives for local QP qpn as the vRNIC's (a mechanism that cannot, counts nothing)."""

    def uncount_received(self, vrnic_id: str, qpn: int) -> None:  # noqa: B027
        """The QP no longer counts for the vRNIC (destroyed, reset, or the vRNIC moved off this device)."""

    def received(self) -> dict[str, ClassCounters]:
        """Bytes and packets received per vRNIC whose arrivals this mechanism counts."""
        return {}

    @abstractmethod
    def counters(self) -> dict[str, ClassCounters]:
        """Bytes and packets sent per vRNIC, as the kernel counted them."""

    @abstractmethod
    def reconcile(self) -> Drift:
        """Make the kernel match what vrnicd wants; returns what was wrong."""

    @abstractmethod
    def close(self) -> None:
        """Remove everything this mechanism installed."""


def _first(counts: Counter[Any], key: Any) -> bool:
    """Count one more user of key; True if it is the first (the kernel object is to be made)."""
    counts[key] += 1
    return counts[key] == 1


def _last(counts: Counter[Any] | None, key: Any) -> bool:
    """Count one user of key less; True if that was the last (the kernel object is to go)."""
    if not counts or not counts[key]:
        return False
    counts[key] -= 1
    if counts[key]:
        return False
    del counts[key]
    return True


def _burst(kbit: int) -> int:
    """Bytes a class may send at once: 20 ms at its rate, at least 64 KiB (one 64 KiB WRITE). HTB's default
    (a timer tick's worth) loses rate whenever its timer runs late, as it does under emulation."""
    return max(64 << 10, kbit * 1000 // 8 // 50)


def uplink_netdev(device: str) -> str:
    """The netdev a RoCE device sends through (rxe: the one it was created on)."""
    ndevs = Path(f"/sys/class/infiniband/{device}/ports/1/gid_attrs/ndevs/0")
    try:
        return ndevs.read_text().strip()
    except OSError as exc:
        raise NotSupported(f"{device} has no uplink netdev to shape ({exc.strerror})") from None


def link_speed_mbps(netdev: str) -> int | None:
    """The netdev's speed from sysfs; None when it has none (veth, virtio-net without a speed)."""
    try:
        speed = int((SYS_NET / netdev / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return speed if speed > 0 else None


def decode_u32_keys(keys: list[dict[str, int]]) -> list[tuple[int, int, int]]:
    """(mask, value, offset) of each key as pyroute2 returns them. pyroute2 0.9.7 reads the key array 4 bytes
    early, so each field lands one place later (the first key's mask is then the selector's hmask, 0)."""
    if keys and all(k["key_mask"] and 0 <= k["key_off"] < 256 for k in keys):
        return [(k["key_mask"], k["key_val"], k["key_off"]) for k in keys]
    return [(k["key_val"], int.from_bytes(struct.pack("<i", k["key_off"]), "big"), k["key_offmask"]) for k in keys]


@dataclass
class HtbShaper(QosMechanism):
    """HTB on one netdev. link_mbps: the link's speed (sysfs) or the operator's figure for it."""

    netdev: str
    link_mbps: int | None = None
    _shaped: dict[str, Shaped] = field(default_factory=dict)
    _filters: dict[str, Counter[FlowKey]] = field(default_factory=dict)  # vRNIC -> its QPs' keys, counted
    _rx: dict[str, Counter[int]] = field(default_factory=dict)  # vRNIC -> local QPNs whose arrivals it counts
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.link_mbps = self.link_mbps or link_speed_mbps(self.netdev)
        self._ipr: Any = None
        # Looked up once, not per netlink request (each lookup is a dump: about a tenth of a connect under TCG).
        # A netdev that goes answers ENODEV, and reconcile looks it up again: one recreated under the same name
        # is found there.
        self._index: int | None = None
        self._ingress_ready = False  # the ingress qdisc is there (we put or saw it; reconcile looks again)
        # Our filters' kernel handles as one dump read them, until we next add one (the kernel picks an added
        # filter's handle, and may reuse a freed one): a QP's destroy deletes its filters by handle, where a dump
        # per destroy made destroying N shaped QPs O(N^2) (a third of a second each at 32 QPs under TCG).
        self._filter_handles: dict[FlowKey, list[int]] | None = None
        self._rx_handles: dict[int, int] | None = None
        # classes whose pfifo we put since reconcile last looked: replacing a class keeps its queue, so a policy
        # change (which puts every class again, as shares move) puts each queue only once
        self._leaves: set[int] = set()

    # ----- netlink (the edge) -------------------------------------------------------------------
    @contextlib.contextmanager
    def _netlink(self, what: str) -> Iterator[tuple[Any, int]]:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        if self._ipr is None:
            self._ipr = IPRoute()
        if self._index is None:
            found = self._ipr.link_lookup(ifname=self.netdev)
            if not found:
                raise DeviceError(f"no netdev {self.netdev} to shape", errno.ENODEV)
            self._index = found[0]
        try:
            yield self._ipr, self._index
        except NetlinkError as exc:
            if exc.code == errno.ENODEV:
                self._index = None
            raise DeviceError(f"tc {what} on {self.netdev}: {exc.args[1] if len(exc.args) > 1 else exc}",
                              exc.code) from None

    def _ensure_root(self) -> None:
        if self.link_mbps is None:
            raise NotSupported(f"{self.netdev} has no link speed to share out (set VRNIC_QOS_LINK_MBPS)")
        with self._netlink("qdisc") as (ipr, index):
            root = [q for q in ipr.get_qdiscs(index) if q["parent"] == 0xFFFFFFFF]
            if not (root and root[0].get_attr("TCA_KIND") == "htb" and root[0]["handle"] == ROOT_HANDLE):
                ipr.tc("replace", "htb", index, ROOT_HANDLE, default=0)  # unclassified traffic is not shaped
            rate, burst = f"{self.link_mbps}mbit", _burst(self.link_mbps * 1000)
            ipr.tc("replace-class", "htb", index, ROOT_HANDLE | PARENT_MINOR, parent=ROOT_HANDLE, rate=rate,
                   ceil=rate, burst=burst, cburst=burst)  # the link's class too: a tick's burst cuts lending

    def _put_class(self, htb: HtbClass) -> None:
        with self._netlink("class") as (ipr, index):
            ipr.tc("replace-class", "htb", index, htb.classid, parent=ROOT_HANDLE | PARENT_MINOR,
                   rate=f"{htb.rate_kbit}kbit", ceil=f"{htb.ceil_kbit}kbit", burst=_burst(htb.rate_kbit),
                   cburst=_burst(htb.ceil_kbit))
        if htb.minor in self._leaves:
            return
        with self._netlink("class queue") as (ipr, index):  # a queue its QPs' packets in flight never overflow
            ipr.tc("replace", "pfifo", index, htb.leaf_handle, parent=htb.classid, limit=htb.leaf_packets)
        self._leaves.add(htb.minor)

    def _del_class(self, minor: int) -> None:
        self._leaves.discard(minor)
        with self._netlink("class") as (ipr, index):
            # pyroute2's htb builder wants a rate even to delete; the kernel goes by the class id
            ipr.tc("del-class", "htb", index, ROOT_HANDLE | minor, parent=ROOT_HANDLE | PARENT_MINOR, rate="8kbit")

    def _add_filter(self, f: Filter) -> None:
        self._filter_handles = None
        with self._netlink("filter") as (ipr, index):
            ipr.tc("add-filter", "u32", index, parent=ROOT_HANDLE, prio=FILTER_PRIO, protocol=ETH_P_IP,
                   target=ROOT_HANDLE | f.minor, keys=u32_keys(f.key))

    def _del_filter(self, handle: int) -> None:
        with self._netlink("filter") as (ipr, index):
            # pyroute2's u32 builder wants a target and keys even to delete; the kernel goes by the handle
            ipr.tc("del-filter", "u32", index, handle, parent=ROOT_HANDLE, prio=FILTER_PRIO,
                   protocol=ETH_P_IP, target=0, keys=[])

    def _observed(self, with_leaves: bool = False) \
            -> tuple[dict[int, HtbClass], dict[Filter, int], dict[int, ClassCounters]]:
        """The classes under 1:1 by minor (with their queue limits if asked; else they read 0), our filters (with
        their kernel handles), and each class's counters."""
        classes: dict[int, HtbClass] = {}
        counters: dict[int, ClassCounters] = {}
        filters: dict[Filter, int] = {}
        with self._netlink("dump") as (ipr, index):
            # each class's queue limit, when its leaf is ours: only reconcile compares it (a dump less elsewhere)
            leaves = {q["parent"]: q.get_attr("TCA_OPTIONS")["limit"] for q in ipr.get_qdiscs(index)
                      if q.get_attr("TCA_KIND") == "pfifo" and q["parent"] & 0xFFFF0000 == ROOT_HANDLE
                      and q["handle"] >> 16 == LEAF_MAJOR + (q["parent"] & 0xFFFF)} if with_leaves else {}
            for c in ipr.get_classes(index):
                if c.get_attr("TCA_KIND") != "htb" or c["parent"] != ROOT_HANDLE | PARENT_MINOR:
                    continue
                parms = c.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")
                minor = c["handle"] & 0xFFFF
                classes[minor] = HtbClass(minor, parms["rate"] * 8 // 1000, parms["ceil"] * 8 // 1000,
                                          leaves.get(c["handle"], 0))
                stats = c.get_attr("TCA_STATS2")
                basic = stats.get_attr("TCA_STATS_BASIC") if stats is not None else None
                counters[minor] = ClassCounters(int(basic["bytes"]), int(basic["packets"])) if basic \
                    else ClassCounters(0, 0)
            with contextlib.suppress(Exception):  # no qdisc yet: no filters
                for f in ipr.get_filters(index, parent=ROOT_HANDLE):
                    options = f.get_attr("TCA_OPTIONS")
                    sel = options.get_attr("TCA_U32_SEL") if options else None
                    target = options.get_attr("TCA_U32_CLASSID") if options else None
                    if sel is None or target is None:
                        continue
                    key = key_of(decode_u32_keys(sel["keys"]))
                    if key is not None:
                        filters[Filter(key, target & 0xFFFF)] = f["handle"]
        return classes, filters, counters

    # Arrivals are counted, never shaped: an ingress qdisc, one u32 filter per local QP (its BTH destination
    # QPN) with a pass action whose statistics are the QP's received bytes and packets.
    def _ensure_ingress(self) -> None:
        if self._ingress_ready:
            return
        with self._netlink("ingress qdisc") as (ipr, index):
            if not any(q["parent"] == TC_H_INGRESS for q in ipr.get_qdiscs(index)):
                ipr.tc("add", "ingress", index, INGRESS_HANDLE)
        self._ingress_ready = True

    def _add_rx_filter(self, qpn: int) -> None:
        self._rx_handles = None
        with self._netlink("ingress filter") as (ipr, index):
            ipr.tc("add-filter", "u32", index, parent=INGRESS_HANDLE, prio=FILTER_PRIO, protocol=ETH_P_IP,
                   target=INGRESS_HANDLE | 1, keys=rx_u32_keys(qpn), action={"kind": "gact", "action": "ok"})

    def _del_rx_filter(self, handle: int) -> None:
        with self._netlink("ingress filter") as (ipr, index):
            ipr.tc("del-filter", "u32", index, handle, parent=INGRESS_HANDLE, prio=FILTER_PRIO,
                   protocol=ETH_P_IP, target=0, keys=[])

    def _observed_rx(self) -> dict[int, tuple[int, ClassCounters]]:
        """Our receive-counting filters: local QPN -> (kernel handle, what its action counted)."""
        found: dict[int, tuple[int, ClassCounters]] = {}
        with self._netlink("ingress dump") as (ipr, index):
            if not any(q["parent"] == TC_H_INGRESS for q in ipr.get_qdiscs(index)):
                return found
            for f in ipr.get_filters(index, parent=INGRESS_HANDLE):
                options = f.get_attr("TCA_OPTIONS")
                sel = options.get_attr("TCA_U32_SEL") if options else None
                if sel is None:
                    continue
                qpn = rx_qpn_of(decode_u32_keys(sel["keys"]))
                if qpn is None:
                    continue
                acts = options.get_attr("TCA_U32_ACT")
                first = acts.get_attr("TCA_ACT_PRIO_1") if acts is not None else None
                stats = first.get_attr("TCA_ACT_STATS") if first is not None else None
                basic = stats.get_attr("TCA_STATS_BASIC") if stats is not None else None
                counted = ClassCounters(int(basic["bytes"]), int(basic["packets"])) if basic else ClassCounters(0, 0)
                found[qpn] = (f["handle"], counted)
        return found

    def _drop_rx(self, qpns: Iterable[int], observed: Mapping[int, tuple[int, ClassCounters]]) -> None:
        for qpn in qpns:
            if qpn in observed:
                self._del_rx_filter(observed[qpn][0])

    def count_received(self, vrnic_id: str, qpn: int) -> None:
        with self._lock:
            if vrnic_id not in self._shaped:
                return  # no QoS for this vRNIC: nothing counted, as for what it sends
            if _first(self._rx.setdefault(vrnic_id, Counter()), qpn):
                self._ensure_ingress()
                try:
                    self._add_rx_filter(qpn)
                except DeviceError:  # the ingress qdisc went since (tc by hand): put it back, once
                    self._ingress_ready = False
                    self._ensure_ingress()
                    self._add_rx_filter(qpn)

    def uncount_received(self, vrnic_id: str, qpn: int) -> None:
        with self._lock:
            if not _last(self._rx.get(vrnic_id), qpn):
                return
            if self._rx_handles is None:
                self._rx_handles = {q: handle for q, (handle, _) in self._observed_rx().items()}
            handle = self._rx_handles.pop(qpn, None)
            if handle is not None:
                self._del_gone_or_not(self._del_rx_filter, handle)

    def _remove_rx_all(self) -> int:
        """Every receive-counting filter of ours, and the ingress qdisc when nothing else uses it."""
        observed = self._observed_rx()
        self._drop_rx(observed, observed)
        with self._netlink("ingress qdisc") as (ipr, index):
            if any(q["parent"] == TC_H_INGRESS for q in ipr.get_qdiscs(index)) \
                    and not any(f.get_attr("TCA_OPTIONS") for f in ipr.get_filters(index, parent=INGRESS_HANDLE)):
                ipr.tc("del", "ingress", index, INGRESS_HANDLE)
        self._ingress_ready, self._rx_handles = False, None
        return len(observed)

    def received(self) -> dict[str, ClassCounters]:
        with self._lock:
            observed = self._observed_rx()
            out = {}
            for vrnic_id, qpns in self._rx.items():
                hits = [observed[q][1] for q in qpns if q in observed]
                out[vrnic_id] = ClassCounters(sum(c.bytes for c in hits), sum(c.packets for c in hits))
            return out

    # ----- the policy -------------------------------------------------------------------------
    def flow_key(self, qpn: int, dest_qpn: int | None) -> FlowKey:
        """rxe's UDP source port (from both QPNs after an RC QP's RTR, from its own QPN for UD), and the
        destination QPN for RC."""
        if dest_qpn is None:
            return rxe_create_sport(qpn), None
        return rxe_udp_sport(qpn, dest_qpn), dest_qpn

    def set_policy(self, vrnic_id: str, policy: QosPolicy) -> None:
        with self._lock:
            others = [s.policy for i, s in self._shaped.items() if i != vrnic_id]
            admit(self.link_mbps, others, policy)
            current = self._shaped.get(vrnic_id)
            minor = current.minor if current else next_minor(s.minor for s in self._shaped.values())
            self._shaped[vrnic_id] = Shaped(vrnic_id, policy, minor)
            try:
                self._ensure_root()
                self._apply_classes()
            except BaseException:
                if current is None:
                    self._shaped.pop(vrnic_id)
                else:
                    self._shaped[vrnic_id] = current
                raise
            self._filters.setdefault(vrnic_id, Counter())

    def _apply_classes(self) -> None:
        """Every class again: a new guarantee or weight changes the others' shares too."""
        assert self.link_mbps is not None
        for htb in plan_classes(self.link_mbps, self._shaped.values()).values():
            self._put_class(htb)

    def forget(self, vrnic_id: str) -> None:
        with self._lock:
            shaped = self._shaped.pop(vrnic_id, None)
            keys = self._filters.pop(vrnic_id, Counter())
            received = self._rx.pop(vrnic_id, Counter())
            if shaped is None:
                return
            self._filter_handles, self._rx_handles = None, None  # what this deletes, they may still name
            if received:
                self._drop_rx(received, self._observed_rx())
            _, observed, _ = self._observed()
            for f, handle in observed.items():
                if f.minor == shaped.minor or f.key in keys:
                    self._del_filter(handle)
            with contextlib.suppress(DeviceError):
                self._del_class(shaped.minor)
            if self._shaped:
                self._apply_classes()

    def classify(self, vrnic_id: str, key: FlowKey) -> None:
        with self._lock:
            shaped = self._shaped.get(vrnic_id)
            if shaped is None:
                return  # no QoS for this vRNIC
            for other, keys in self._filters.items():
                if keys[key] and other != vrnic_id:  # a UD QP whose port hashes like another vRNIC's
                    raise Conflict(f"QoS cannot tell this QP's packets (UDP source port {key[0]}) from vRNIC "
                                   f"{other}'s; create another QP", current_state="indistinguishable")
            if _first(self._filters.setdefault(vrnic_id, Counter()), key):
                self._add_filter(Filter(key, shaped.minor))

    def unclassify(self, vrnic_id: str, key: FlowKey) -> None:
        with self._lock:
            if not _last(self._filters.get(vrnic_id), key):
                return  # unknown, or another QP of the vRNIC still sends so
            if self._filter_handles is None:
                _, observed, _ = self._observed()
                self._filter_handles = {}
                for f, handle in observed.items():
                    self._filter_handles.setdefault(f.key, []).append(handle)
            for handle in self._filter_handles.pop(key, []):
                self._del_gone_or_not(self._del_filter, handle)

    @staticmethod
    def _del_gone_or_not(delete: Callable[[int], None], handle: int) -> None:
        """Delete a filter by the handle a dump read; one gone since (tc by hand) is what was wanted."""
        try:
            delete(handle)
        except DeviceError as exc:
            if exc.errno != errno.ENOENT:
                raise

    def counters(self) -> dict[str, ClassCounters]:
        with self._lock:
            _, _, by_minor = self._observed()
            return {i: by_minor.get(s.minor, ClassCounters(0, 0)) for i, s in self._shaped.items()}

    def desired(self) -> tuple[dict[int, HtbClass], set[Filter]]:
        assert self.link_mbps is not None
        plan = plan_classes(self.link_mbps, self._shaped.values())
        classes = {c.minor: c for c in plan.values()}
        filters = {Filter(key, self._shaped[i].minor) for i, keys in self._filters.items() for key in keys}
        return classes, filters

    def reconcile(self) -> Drift:
        with self._lock:
            # looked at again, as drift may have changed them
            self._index, self._ingress_ready, self._filter_handles, self._rx_handles = None, False, None, None
            self._leaves.clear()
            if not self._shaped:
                return Drift((), (), (), (), ())
            self._ensure_root()
            observed_classes, observed_filters, _ = self._observed(with_leaves=True)
            want_classes, want_filters = self.desired()
            found = drift(want_classes, observed_classes, want_filters, observed_filters)
            observed_rx = self._observed_rx()
            want_rx = {q for qpns in self._rx.values() for q in qpns}
            found = dataclasses.replace(found, add_rx=tuple(sorted(want_rx - set(observed_rx))),
                                        remove_rx=tuple(sorted(set(observed_rx) - want_rx)))
            self._drop_rx(found.remove_rx, observed_rx)
            if found.add_rx:
                self._ensure_ingress()
            for qpn in found.add_rx:
                self._add_rx_filter(qpn)
            for f in found.remove_filters:
                self._del_filter(observed_filters[f])
            for minor in found.remove_classes:
                self._del_class(minor)
            for htb in found.add_classes + found.change_classes:
                self._put_class(htb)
            for f in found.add_filters:
                self._add_filter(f)
            self._leaves = set(want_classes)  # each class's queue as observed, or put back above
            if not found.empty:
                log.warning("QoS on %s drifted and was restored: %s", self.netdev, found)
            return found

    def adopt(self, shaped: Mapping[str, QosPolicy], keys: Mapping[str, Iterable[FlowKey]],
              received: Mapping[str, Iterable[int]] | None = None) -> Drift:
        """After a restart: what vrnicd wants now (from its records), then reconcile the kernel to it."""
        with self._lock:
            self._shaped = {}
            for vrnic_id, policy in shaped.items():
                minor = next_minor(s.minor for s in self._shaped.values())
                self._shaped[vrnic_id] = Shaped(vrnic_id, policy, minor)
            self._filters = {i: Counter(keys.get(i, ())) for i in shaped}
            self._rx = {i: Counter((received or {}).get(i, ())) for i in shaped}
        return self.reconcile()

    def sweep(self) -> bool:
        """Remove a qdisc of ours that no vrnicd wants (one killed before it could remove it). True if found."""
        with self._lock, self._netlink("qdisc") as (ipr, index):
            ours = [q for q in ipr.get_qdiscs(index) if q["parent"] == 0xFFFFFFFF and q["handle"] == ROOT_HANDLE]
            if self._shaped:
                return False
            counting = self._remove_rx_all()
            if ours:
                ipr.tc("del", "htb", index, ROOT_HANDLE)
            if ours or counting:
                log.warning("QoS left on %s by an earlier vrnicd removed", self.netdev)
            return bool(ours or counting)

    def close(self) -> None:
        with self._lock:
            if self._ipr is None:
                return
            with contextlib.suppress(Exception), self._netlink("qdisc") as (ipr, index):
                ipr.tc("del", "htb", index, ROOT_HANDLE)
            with contextlib.suppress(Exception):
                self._remove_rx_all()
            self._ipr.close()
            self._ipr, self._index, self._ingress_ready = None, None, False
            self._filter_handles, self._rx_handles = None, None
            self._leaves.clear()
            self._shaped.clear()
            self._filters.clear()
            self._rx.clear()
