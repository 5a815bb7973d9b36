"""The RoCEv2 packet guard of the direct data path: which RC flows a guarded local IP may send (pure, no I/O).

A guest that holds its vRNIC's uverbs fd can modify its QPs to any destination. vrnicd therefore
programs an nftables table at connect time: RoCEv2 packets (UDP dport 4791) leaving a guarded local
IPv4 address pass only if (ip saddr, udp sport, ip daddr, BTH destination QPN) is an allowed flow.
The guard filters and never rewrites: rxe computes the ICRC before the packet reaches netfilter.

What the wire carries (Linux 6.1, drivers/infiniband/sw/rxe and include/rdma/ib_verbs.h):

- The BTH follows the 8-byte UDP header; its destination QPN is bytes 5..7 of the BTH, so nftables
  reads it as ``@th,104,24`` (th = the UDP header; 64 + 40 bits in, 24 bits long).
- The source QPN of an RC QP is not on the wire, but the UDP source port stands in for it. rxe sets
  ``0xC000 + hash_32(qpn, 14)`` when the QP is created (rxe_qp_init_req), and *overwrites* it when a
  modify carries an address vector with a GRH, which every RoCE AV has (rxe_modify_qp):
  ``rdma_get_udp_sport(flow_label, qpn, dest_qpn)``. With flow label 0 that folds
  ``rdma_calc_flow_label(qpn, dest_qpn)``, a symmetric function of both QPNs, so the requester's
  packets and its peer's ACKs carry the same port. The create-time hash is what UD QPs keep.
- Only 14 bits of port for 24 + 24 bits of QPNs: different flows can share a port. And the flow label
  is the caller's to choose (any 14-bit port value is reachable with one), so the port pins honest
  traffic exactly but is no proof of the source QP against a holder of the fd; see
  kernel/roce_guard/README.md.

Denied packets go to an nfqueue nobody listens on (``queue to 4791``, no ``bypass``): the kernel frees
them and reports success to the sender (net/netfilter/nf_queue.c, "QUEUE == DROP if no one is waiting").
A plain ``drop`` makes ip_local_out fail, and rxe then rolls the WQE back and reschedules its
requester at once, forever (rxe_req.c, -EAGAIN): a busy loop in softirq instead of a retry-exceeded
completion, and the WQE goes out as soon as the drop is lifted. The kernel test shows both.

IPv4 only: vrnic uses IPv4-mapped GIDs. IPv6 RoCEv2 egress (every rxe device has fe80:: GIDs) is denied
as a whole while the guard is installed.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vrnic.errors import InvalidArgument

ROCE_V2_UDP_DPORT = 4791
TABLE = "vrnic_guard"
FLOWS_SET = "flows"
GUARDED_SET = "guarded"
DENY_QUEUE = 4791  # an nfqueue that must have no listener: queued to nobody = freed, sender sees success

GOLDEN_RATIO_32 = 0x61C88647  # include/linux/hash.h
RXE_ROCE_V2_SPORT = 0xC000  # drivers/infiniband/sw/rxe/rxe.h; also IB_ROCE_UDP_ENCAP_VALID_PORT_MIN
QPN_MASK = 0xFFFFFF
FLOW_LABEL_MASK = 0xFFFFF  # IB_GRH_FLOWLABEL_MASK

BTH_DEST_QPN = "@th,104,24"  # UDP header (64 bits) + opcode, flags, P_Key, reserved (40 bits)
FLOW_KEY = f"ip saddr . udp sport . ip daddr . {BTH_DEST_QPN}"
# BTH opcodes of UD SEND_ONLY and SEND_ONLY_WITH_IMMEDIATE. UD QPs exist only on the shared-ring engine, where
# vrnicd resolves every datagram's destination itself; a direct guest has RC QPs only (and, contained, cannot
# create any), and an RC QP never emits UD opcodes.
BTH_OPCODE = "@th,64,8"
UD_OPCODES = "{ 0x64, 0x65 }"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_VRNIC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


# --- the kernel's arithmetic ---------------------------------------------------------------------

def hash_32(value: int, bits: int) -> int:
    """include/linux/hash.h, generic version (x86 has no arch-specific one)."""
    return ((value * GOLDEN_RATIO_32) & 0xFFFFFFFF) >> (32 - bits)


def rxe_create_sport(qpn: int) -> int:
    """The port rxe gives a QP at creation (rxe_qp_init_req); kept by QPs never given an AV (UD)."""
    return RXE_ROCE_V2_SPORT + (hash_32(_qpn(qpn), 14) & 0x3FFF)


def rdma_calc_flow_label(lqpn: int, rqpn: int) -> int:
    """include/rdma/ib_verbs.h: a 20-bit label, symmetric in the two QPNs."""
    v = (_qpn(lqpn) * _qpn(rqpn)) & 0xFFFFFFFFFFFFFFFF
    v ^= v >> 20
    v ^= v >> 40
    return v & FLOW_LABEL_MASK


def rdma_flow_label_to_udp_sport(flow_label: int) -> int:
    """include/rdma/ib_verbs.h: fold the 20-bit label into 14 bits, in the dynamic port range."""
    low, high = flow_label & 0x3FFF, flow_label & 0xFC000
    return (low ^ (high >> 14)) | RXE_ROCE_V2_SPORT


def rxe_udp_sport(qpn: int, dest_qpn: int, flow_label: int = 0) -> int:
    """The UDP source port of an RC/UC QP after its RTR modify (rxe_modify_qp -> rdma_get_udp_sport).

    This, not the create-time hash, is what a connected QP's packets carry: RoCE AVs always have a GRH.
    """
    if not 0 <= flow_label <= FLOW_LABEL_MASK:
        raise InvalidArgument(f"flow label must be 20 bits, not {flow_label:#x}")
    label = flow_label or rdma_calc_flow_label(qpn, dest_qpn)
    return rdma_flow_label_to_udp_sport(label)


def _qpn(value: int) -> int:
    if not 0 <= value <= QPN_MASK:
        raise InvalidArgument(f"a QPN is 24 bits, not {value:#x}")
    return value


def _ipv4(text: str, what: str) -> str:
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what} must be an IPv4 address (the guard is IPv4 only), not {text!r}") from exc
    if str(address) != text:
        raise InvalidArgument(f"{what} must be written canonically: {address}, not {text!r}")
    return text


# --- flows ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GuardFlow:
    """One RC connection a vRNIC may use: its QP src_qpn on src_ip towards dst_qpn on dst_ip."""

    vrnic_id: str
    src_ip: str
    src_qpn: int
    dst_ip: str
    dst_qpn: int
    flow_label: int = 0  # as programmed at RTR; 0 lets the kernel derive it from both QPNs

    def __post_init__(self) -> None:
        if not _VRNIC_ID.fullmatch(self.vrnic_id):
            raise InvalidArgument(f"vRNIC id {self.vrnic_id!r} is not usable in a guard comment")
        _ipv4(self.src_ip, "src_ip")
        _ipv4(self.dst_ip, "dst_ip")
        _qpn(self.src_qpn)
        _qpn(self.dst_qpn)
        if not 0 <= self.flow_label <= FLOW_LABEL_MASK:
            raise InvalidArgument(f"flow label must be 20 bits, not {self.flow_label:#x}")

    @property
    def sport(self) -> int:
        return rxe_udp_sport(self.src_qpn, self.dst_qpn, self.flow_label)

    @property
    def key(self) -> tuple[str, int, str, int]:
        """What the packet shows: (ip saddr, udp sport, ip daddr, BTH destination QPN)."""
        return (self.src_ip, self.sport, self.dst_ip, self.dst_qpn)


def element(flow: GuardFlow) -> str:
    """The set element of a flow: its key, and a comment that names the owner and the source QPN."""
    return f"{_key_text(flow.key)} comment \"{_comment(flow)}\""


def _key_text(key: tuple[str, int, str, int]) -> str:
    src_ip, sport, dst_ip, dst_qpn = key
    return f"{src_ip} . {sport} . {dst_ip} . {dst_qpn:#x}"


def _comment(flow: GuardFlow) -> str:
    text = f"vrnic={flow.vrnic_id} qpn={flow.src_qpn:#x}"
    return text + (f" fl={flow.flow_label:#x}" if flow.flow_label else "")


# --- scripts for `nft -f -` ------------------------------------------------------------------------

def table_name(table: str) -> str:
    """The table name, if it is a plain identifier (it goes into nft scripts verbatim)."""
    if not _NAME.fullmatch(table):
        raise InvalidArgument(f"nft table name {table!r} is not a plain identifier")
    return table


def base_ruleset(table: str = TABLE) -> str:
    """The guard's table: what kernel/roce_guard/vrnic_guard.nft holds (for the default name)."""
    table_name(table)
    deny = f"counter queue to {DENY_QUEUE}"
    return f"""table inet {table} {{
	set {GUARDED_SET} {{
		type ipv4_addr
	}}

	set {FLOWS_SET} {{
		typeof {FLOW_KEY}
	}}

	chain output {{
		type filter hook output priority filter; policy accept;
		udp dport {ROCE_V2_UDP_DPORT} ip saddr @{GUARDED_SET} jump roce
		meta nfproto ipv6 udp dport {ROCE_V2_UDP_DPORT} {deny}
	}}

	chain roce {{
		{FLOW_KEY} @{FLOWS_SET} accept
		{BTH_OPCODE} {UD_OPCODES} accept
		{deny}
	}}
}}
"""


def install_script(local_ips: Sequence[str], table: str = TABLE) -> str:
    """Create the table, or converge an existing one, in one transaction; allowed flows survive.

    The empty declarations make the flushes valid on a first install; the flushes make a repeated
    install replace the rules and the guarded addresses instead of appending to them.
    """
    ips = sorted({_ipv4(ip, "a guarded local IP") for ip in local_ips}, key=ipaddress.IPv4Address)
    if not ips:
        raise InvalidArgument("the guard needs at least one local IP to guard")
    table_name(table)
    skeleton = f"""table inet {table} {{
	set {GUARDED_SET} {{
		type ipv4_addr
	}}
	set {FLOWS_SET} {{
		typeof {FLOW_KEY}
	}}
	chain output {{
		type filter hook output priority filter; policy accept;
	}}
	chain roce {{
	}}
}}
flush chain inet {table} output
flush chain inet {table} roce
flush set inet {table} {GUARDED_SET}
"""
    return skeleton + base_ruleset(table) + f"add element inet {table} {GUARDED_SET} {{ {', '.join(ips)} }}\n"


def allow_script(flows: Iterable[GuardFlow], table: str = TABLE) -> str:
    elements = [element(flow) for flow in flows]
    if not elements:
        return ""
    return f"add element inet {table_name(table)} {FLOWS_SET} {{ {', '.join(elements)} }}\n"


def revoke_script(vrnic_id: str, present: Iterable[GuardFlow], table: str = TABLE) -> str:
    """Delete every present flow of one vRNIC (all or nothing); empty when it has none."""
    keys = sorted({flow.key for flow in present if flow.vrnic_id == vrnic_id})
    if not keys:
        return ""
    return f"delete element inet {table_name(table)} {FLOWS_SET} {{ {', '.join(_key_text(k) for k in keys)} }}\n"


def drop_script(flows: Iterable[GuardFlow], table: str = TABLE) -> str:
    """Delete these flows' elements (those present: nft refuses to delete a missing element)."""
    keys = sorted({flow.key for flow in flows})
    if not keys:
        return ""
    return f"delete element inet {table_name(table)} {FLOWS_SET} {{ {', '.join(_key_text(k) for k in keys)} }}\n"


def remove_script(table: str = TABLE) -> str:
    """Delete the table; declaring it first makes this succeed when it is already gone."""
    table_name(table)
    return f"table inet {table} {{\n}}\ndelete table inet {table}\n"


# --- reading back `nft -j list table inet <table>` ---------------------------------------------------

def parse_flows(listing: Mapping[str, Any], table: str = TABLE) -> list[GuardFlow]:
    """The allowed flows of `nft -j list table` output, checked against their own comments.

    ValueError for an element this module did not write (no comment, or a port its comment does not
    give): the edge reports it; silently skipping it would hide a rule nobody owns.
    """
    flows: list[GuardFlow] = []
    for item in listing.get("nftables", []):
        found = item.get("set") if isinstance(item, dict) else None
        if not found or found.get("table") != table or found.get("name") != FLOWS_SET:
            continue
        for entry in found.get("elem", []):
            flows.append(_parse_element(entry))
    return sorted(flows, key=lambda f: (f.vrnic_id, f.key))


def parse_guarded(listing: Mapping[str, Any], table: str = TABLE) -> list[str]:
    """The guarded local IPs of `nft -j list table` output."""
    for item in listing.get("nftables", []):
        found = item.get("set") if isinstance(item, dict) else None
        if found and found.get("table") == table and found.get("name") == GUARDED_SET:
            return sorted((str(ip) for ip in found.get("elem", [])), key=ipaddress.IPv4Address)
    return []


def _parse_element(entry: Any) -> GuardFlow:
    inner = entry.get("elem") if isinstance(entry, dict) else None
    comment = inner.get("comment", "") if isinstance(inner, dict) else ""
    value = inner.get("val") if isinstance(inner, dict) else entry
    parts = value.get("concat") if isinstance(value, dict) else None
    if not isinstance(parts, list) or len(parts) != 4:
        raise ValueError(f"not a flow element: {entry!r}")
    fields = dict(word.split("=", 1) for word in str(comment).split() if "=" in word)
    try:
        flow = GuardFlow(vrnic_id=fields["vrnic"], src_ip=str(parts[0]), src_qpn=int(fields["qpn"], 0),
                         dst_ip=str(parts[2]), dst_qpn=int(parts[3]), flow_label=int(fields.get("fl", "0"), 0))
    except (KeyError, ValueError, TypeError, InvalidArgument) as exc:
        raise ValueError(f"flow element without a usable comment: {entry!r}") from exc
    if flow.sport != int(parts[1]):
        raise ValueError(f"flow element whose port {parts[1]} is not its comment's ({flow.sport}): {entry!r}")
    return flow
