"""QoS for paravirtual vRNICs, the pure parts: what each vRNIC's share of the link is, who is admitted, which
shaper objects should exist, and how the observed ones differ from that. No I/O here.

The policy is per vRNIC (vrnic.core.specs.QosPolicy): a cap (Mbit/s), a guarantee (Mbit/s), and a weight
for the fair share of what is left. The mechanism on rxe (vrnic.backend.qos_shaper) is HTB on the RNIC's
uplink netdev: one class per vRNIC with rate = its guarantee, or its weight's share of what no guarantee
holds, and ceil = its cap, or the link. HTB lends unused rate in proportion to the classes' rates, which
is the weighted fair share. Each connected QP's RoCEv2 packets are put in their vRNIC's class by a u32
filter on the UDP source port, which rxe derives from the QP numbers (vrnic.core.roce_guard.rxe_udp_sport),
and, for an RC QP, the BTH destination QPN (two connections can hash to one port; never to one port and
one destination QP).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vrnic.core.specs import QosPolicy
from vrnic.errors import Conflict, InvalidArgument

ROCE_V2_PORT = 4791
ROOT_HANDLE = 0x7672 << 16  # 7672: ("vr"), the HTB qdisc: a handle of its own marks it as vrnic's
PARENT_MINOR = 1  # 1:1, under which every vRNIC's class hangs (it holds the link's rate)
FIRST_MINOR = 0x10  # vRNIC classes are 1:10 and up
MAX_MINOR = 0x7FFE  # so that a class's leaf qdisc major (LEAF_MAJOR + minor) stays below ffff:, ingress's
FILTER_PRIO = 10
MIN_RATE_KBIT = 8  # HTB needs a rate; a class with no guarantee and weight 0 gets this floor


# Each class's queue (a pfifo leaf) holds this many packets. HTB's own leaf holds the netdev's txqueuelen (1000 on
# veth), which 16 RC QPs of a class sending at once (65 packets in flight each, RXE_PACKETS_IN_FLIGHT) overflow: in
# the lab, 20 QPs writing 8 x 64 KiB each at 24 Mbit/s lost 21,419 packets there (169,693 at 8 Mbit/s, for 10,485
# delivered), each rebuilt and sent again by rxe after a sequence NAK. With this, 1024 QPs of a class can all send at
# once and nothing drops; the queue only ever holds what its QPs have in flight, so its size costs nothing until
# they send. A longer queue is a longer wait: the RC timeout rules below cover it.
LEAF_PACKETS = 65 * 1024
LEAF_MAJOR = 0x8000  # a class 1:minor's leaf qdisc is (LEAF_MAJOR + minor):


@dataclass(frozen=True)
class HtbClass:
    minor: int  # the class is 1:minor
    rate_kbit: int
    ceil_kbit: int
    leaf_packets: int = LEAF_PACKETS  # its queue's limit (observed: 0 when the leaf is not ours)

    @property
    def classid(self) -> int:
        return ROOT_HANDLE | self.minor

    @property
    def leaf_handle(self) -> int:
        return (LEAF_MAJOR + self.minor) << 16


@dataclass(frozen=True)
class Shaped:
    """One vRNIC under QoS: its policy and the class minor it was given (stable for its lifetime)."""

    vrnic_id: str
    policy: QosPolicy
    minor: int


def check_policy(policy: QosPolicy, link_mbps: int | None) -> None:
    """A policy this link can honour by itself (the guarantee-below-cap rule is the policy's own)."""
    for what, value in (("cap", policy.rate_cap_mbps), ("guarantee", policy.guarantee_mbps)):
        if value is not None and link_mbps is not None and value > link_mbps:
            raise InvalidArgument(f"a {what} of {value} Mbit/s exceeds the link's {link_mbps} Mbit/s")


def admit(link_mbps: int | None, others: Iterable[QosPolicy], policy: QosPolicy) -> None:
    """Refuse a guarantee the link cannot give next to the guarantees it already gives (numbers in the error)."""
    check_policy(policy, link_mbps)
    if policy.guarantee_mbps is None:
        return
    if link_mbps is None:
        raise Conflict("a guarantee needs the link's speed, and this device's link has none "
                       "(set VRNIC_QOS_LINK_MBPS)", current_state="unknown_link")
    given = sum(p.guarantee_mbps or 0 for p in others)
    if given + policy.guarantee_mbps > link_mbps:
        raise Conflict(f"guarantees would sum to {given + policy.guarantee_mbps} Mbit/s "
                       f"({given} given + {policy.guarantee_mbps} asked) on a {link_mbps} Mbit/s link",
                       current_state="oversubscribed")


def next_minor(taken: Iterable[int]) -> int:
    used = set(taken)
    for minor in range(FIRST_MINOR, MAX_MINOR + 1):
        if minor not in used:
            return minor
    raise Conflict("no HTB class ids left on this link")


def plan_classes(link_mbps: int, shaped: Iterable[Shaped]) -> dict[str, HtbClass]:
    """Each vRNIC's HTB class: rate = its guarantee, or its weight's share of the rate no guarantee holds;
    ceil = its cap, or the link."""
    items = list(shaped)
    link_kbit = link_mbps * 1000
    guaranteed = sum((s.policy.guarantee_mbps or 0) * 1000 for s in items)
    spare = max(link_kbit - guaranteed, 0)
    weights = sum(s.policy.weight for s in items if s.policy.guarantee_mbps is None)
    plan = {}
    for s in items:
        ceil = (s.policy.rate_cap_mbps or link_mbps) * 1000
        if s.policy.guarantee_mbps is not None:
            rate = s.policy.guarantee_mbps * 1000
        else:
            rate = spare * s.policy.weight // weights if weights else 0
        rate = min(max(rate, MIN_RATE_KBIT), ceil)
        plan[s.vrnic_id] = HtbClass(s.minor, rate, ceil)
    return plan


# How long an RC QP's packets can wait in its class's queue, and the RC timeout that outlasts it. rxe (Linux 6.1)
# retransmits from the last acknowledged PSN when no ACK came for `timeout` (4.096 us * 2^timeout; the guest
# library's 14 is 67 ms), while the originals still wait in the qdisc; a second timeout during that retry can
# restart the message at a PSN past its end (req_retry() in rxe_req.c counts the PSNs already acknowledged
# into the head WQE even when ACKs of the originals took it past its last), and the responder then NAKs
# "invalid request" (IBV_WC_REM_INV_REQ_ERR at the requester). So no shaped RC QP may time out on queueing:
# vrnicd raises a QP's timeout at RTS, and refuses what would later make the queue outlast it (RTS->RTS cannot
# change a timeout): a policy that slows its class (seen in the lab as a live 8 Mbit/s cap on a QP connected at 14),
# and a connect that adds a QP's packets to the queue (seen as two of 20 QPs broken at 8 Mbit/s).
RXE_PACKETS_IN_FLIGHT = 65  # rxe stops a QP's requester once more than 64 of its packets are not yet freed
ROCE_V2_OVERHEAD = 94  # wire bytes around a payload: Ethernet 14, IPv6 40 (IPv4 20), UDP 8, BTH 12, RETH 16, ICRC 4
# The class's rate may fall to a quarter of its share at connect (guarantees admitted later), or emulation stall
# the ACKs as long; more would only slow the recovery of a packet lost twice (the timer's job then).
RC_TIMEOUT_MARGIN = 4
RC_TIMEOUT_UNIT_S = 4.096e-6
RC_TIMEOUT_MAX = 31
MAX_PATH_MTU = 4096  # the largest path MTU a QP may be given (verb_args.ModifyQp)


def queue_wait_s(path_mtu: int, qps: int, drain_kbit: int) -> float:
    """The longest a packet can wait in a class that qps RC QPs send into: all their packets in flight ahead of
    it, drained at the class's guaranteed rate (HTB never gives a class less than its rate)."""
    return qps * RXE_PACKETS_IN_FLIGHT * (path_mtu + ROCE_V2_OVERHEAD) * 8 / (max(drain_kbit, MIN_RATE_KBIT) * 1000)


def rc_timeout_s(timeout: int) -> float:
    """An RC timeout exponent's time: 4.096 us * 2^timeout."""
    return RC_TIMEOUT_UNIT_S * (1 << timeout)


def rc_timeout_outlasts(timeout: int, wait_s: float) -> bool:
    """Whether an RC timeout exponent (0: none) outlasts a wait of wait_s in the queue."""
    return timeout == 0 or rc_timeout_s(timeout) >= wait_s


@functools.lru_cache(maxsize=4096)  # every RTS asks, with a few distinct arguments
def rc_timeout_floor(path_mtu: int, qps: int, drain_kbit: int, margin: float = RC_TIMEOUT_MARGIN) -> int:
    """The smallest RC timeout exponent whose time (4.096 us * 2^t) is at least margin times queue_wait_s (31 at
    most: 2.4 hours)."""
    wait = margin * queue_wait_s(path_mtu, qps, drain_kbit)
    # From the logarithm, then settled on the exact comparison (log2 may round either way): every RTS computes
    # this, and counting up from 0 was sixteen-odd calls under TCG.
    floor = min(max(math.ceil(math.log2(wait / RC_TIMEOUT_UNIT_S)), 0), RC_TIMEOUT_MAX) if wait > 0 else 0
    while floor > 0 and rc_timeout_s(floor - 1) >= wait:
        floor -= 1
    while floor < RC_TIMEOUT_MAX and rc_timeout_s(floor) < wait:
        floor += 1
    return floor


def rc_timeout(asked: int, floor: int) -> int:
    """The timeout a QP gets: the one asked for, raised to the floor (0, no timeout at all, stays)."""
    return asked if asked == 0 or asked >= floor else floor


@dataclass
class TimedSenders:
    """The connected RC QPs sending into one class whose timeouts the NIC holds, as a join needs to see them: how
    many, and the one a longer queue outlasts first. A queue's wait grows with the senders alike for all of them,
    so the QP with the least timeout per wire byte of a packet fails first, and if it holds, all do. Kept
    through a batch of connects, a join costs O(1) instead of a walk over every QP (that walk made connecting N
    QPs O(N^2); issue 14)."""

    count: int = 0
    tightest: tuple[int, int] | None = None  # (timeout exponent, path MTU); None: no sender has a timeout

    def add(self, timeout: int, path_mtu: int) -> None:
        self.count += 1
        if timeout == 0:  # no timeout: nothing outlasts it
            return
        if self.tightest is None or _timeout_per_byte(timeout, path_mtu) < _timeout_per_byte(*self.tightest):
            self.tightest = (timeout, path_mtu)

    def outlasted_by_one_more(self, drain_kbit: int) -> bool:
        """Whether one more sender would make the class's queue outlast a timeout the NIC holds."""
        if self.tightest is None:
            return False
        timeout, path_mtu = self.tightest
        return not rc_timeout_outlasts(timeout, queue_wait_s(path_mtu, self.count + 1, drain_kbit))


def _timeout_per_byte(timeout: int, path_mtu: int) -> float:
    return rc_timeout_s(timeout) / (path_mtu + ROCE_V2_OVERHEAD)


def drain_kbit(link_mbps: int, policies: Mapping[str, QosPolicy], vrnic_id: str) -> int:
    """The rate of vrnic_id's class with every vRNIC on the device shaped by its policy (QoS on a device gives
    each of them a class as soon as any asks for it), whether or not the device shapes now."""
    everyone = dict(policies)
    everyone.setdefault(vrnic_id, QosPolicy())
    return drain_rates(link_mbps, everyone)[vrnic_id]


def drain_rates(link_mbps: int, policies: Mapping[str, QosPolicy]) -> dict[str, int]:
    """drain_kbit of every vRNIC in policies, from one plan."""
    shaped = [Shaped(i, p, FIRST_MINOR + n) for n, (i, p) in enumerate(sorted(policies.items()))]
    return {i: c.rate_kbit for i, c in plan_classes(link_mbps, shaped).items()}


FlowKey = tuple[int, int | None]  # (UDP source port, BTH destination QPN or None for UD)


def u32_keys(key: FlowKey) -> list[str]:
    """pyroute2 u32 keys ("value/mask+offset", 32-bit words) for IPv4 UDP from the source port to the RoCEv2
    port (and to the destination QP in the BTH). Offsets assume a 20-byte IPv4 header: rxe sends no IP options."""
    sport, dest_qpn = key
    keys = ["0x00110000/0x00ff0000+8",  # protocol UDP (byte 9)
            f"{(sport << 16) | ROCE_V2_PORT:#010x}/0xffffffff+20"]  # UDP source port . destination port
    if dest_qpn is not None:
        keys.append(f"{dest_qpn:#010x}/0x00ffffff+32")  # BTH: reserved byte . destination QPN
    return keys


def _match_bytes(matches: Iterable[tuple[int, int, int]]) -> tuple[dict[int, int], dict[int, int]]:
    """(mask, value) per packet byte offset of u32 (mask, value, offset) matches.

    Read byte by byte: pyroute2 re-cuts the words it is given (it moves a key so that its mask starts
    with a non-zero byte), so the words read back need not be the words written."""
    masks: dict[int, int] = {}
    values: dict[int, int] = {}
    for mask, value, off in matches:
        for i in range(4):
            shift = 24 - 8 * i
            if (mask >> shift) & 0xFF:
                masks[off + i], values[off + i] = (mask >> shift) & 0xFF, (value >> shift) & 0xFF
    return masks, values


def key_of(matches: Iterable[tuple[int, int, int]]) -> FlowKey | None:
    """The flow key a filter of ours matches, from its (mask, value, offset) matches; None if not ours."""
    masks, values = _match_bytes(matches)

    def whole(start: int, size: int) -> int | None:
        if any(masks.get(start + i) != 0xFF for i in range(size)):
            return None
        return int.from_bytes(bytes(values[start + i] for i in range(size)), "big")

    if whole(9, 1) != 17 or whole(22, 2) != ROCE_V2_PORT:  # UDP to the RoCEv2 port
        return None
    sport = whole(20, 2)
    return None if sport is None else (sport, whole(33, 3))


def rx_u32_keys(qpn: int) -> list[str]:
    """pyroute2 u32 keys for IPv4 RoCEv2 packets arriving for local QP qpn (the BTH's destination QPN)."""
    return ["0x00110000/0x00ff0000+8",  # protocol UDP (byte 9)
            f"{ROCE_V2_PORT:#010x}/0x0000ffff+20",  # UDP destination port: RoCEv2
            f"{qpn:#010x}/0x00ffffff+32"]  # BTH: reserved byte . destination QPN


def rx_qpn_of(matches: Iterable[tuple[int, int, int]]) -> int | None:
    """The local QPN a receive-counting filter of ours matches (no source port in it); None if not ours."""
    masks, values = _match_bytes(matches)
    if any(masks.get(b) != 0xFF for b in (9, 22, 23, 33, 34, 35)) or 20 in masks or 21 in masks:
        return None
    if values[9] != 17 or (values[22] << 8 | values[23]) != ROCE_V2_PORT:
        return None
    return int.from_bytes(bytes(values[b] for b in (33, 34, 35)), "big")


@dataclass(frozen=True)
class Filter:
    """One QP's packets into its vRNIC's class."""

    key: FlowKey
    minor: int


@dataclass(frozen=True)
class Drift:
    """What to do so that the observed shaper matches the plan (Neutron-style set differences)."""

    add_classes: tuple[HtbClass, ...]
    change_classes: tuple[HtbClass, ...]
    remove_classes: tuple[int, ...]  # minors
    add_filters: tuple[Filter, ...]
    remove_filters: tuple[Filter, ...]
    add_rx: tuple[int, ...] = ()  # local QPNs whose arrivals are not counted but should be
    remove_rx: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.fixes

    @property
    def fixes(self) -> int:
        return (len(self.add_classes) + len(self.change_classes) + len(self.remove_classes) + len(self.add_filters)
                + len(self.remove_filters) + len(self.add_rx) + len(self.remove_rx))


def drift(desired_classes: Mapping[int, HtbClass], observed_classes: Mapping[int, HtbClass],
          desired_filters: Iterable[Filter], observed_filters: Iterable[Filter]) -> Drift:
    """Classes by minor and filters as (sport, minor): what is missing, what differs, what is extra."""
    want_f, have_f = set(desired_filters), set(observed_filters)
    return Drift(
        add_classes=tuple(c for m, c in sorted(desired_classes.items()) if m not in observed_classes),
        change_classes=tuple(c for m, c in sorted(desired_classes.items())
                             if m in observed_classes and not _close(observed_classes[m], c)),
        remove_classes=tuple(sorted(m for m in observed_classes if m not in desired_classes)),
        add_filters=tuple(sorted(want_f - have_f, key=_order)),
        remove_filters=tuple(sorted(have_f - want_f, key=_order)),
    )


def _order(f: Filter) -> tuple[int, int, int]:
    return f.minor, f.key[0], -1 if f.key[1] is None else f.key[1]


def _close(observed: HtbClass, desired: HtbClass) -> bool:
    """The kernel stores rates in bytes per second, so kbit values come back rounded: within 1 %. The queue's
    limit comes back as it was set."""
    return observed.leaf_packets == desired.leaf_packets and all(
        abs(a - b) <= max(1, b // 100) for a, b in ((observed.rate_kbit, desired.rate_kbit),
                                                    (observed.ceil_kbit, desired.ceil_kbit)))


def jain_index(rates: Iterable[float]) -> float:
    """Jain's fairness index: 1 when every share is equal, 1/n when one takes all."""
    values = list(rates)
    if not values or not any(values):
        return 0.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


class RateMeter:
    """Rates from counters read now and then: bits per second since the previous reading of the same
    counter (0 at the first). The clock is passed in, so this stays pure."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}

    def read(self, key: str, total_bytes: int, now: float) -> float:
        previous = self._last.get(key)
        self._last[key] = (now, total_bytes)
        if previous is None or now <= previous[0] or total_bytes < previous[1]:
            return 0.0
        return (total_bytes - previous[1]) * 8 / (now - previous[0])
