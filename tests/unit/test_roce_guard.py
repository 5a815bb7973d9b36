"""The RoCEv2 packet guard's pure part: rxe's UDP source port, flows, and the nft scripts (vrnic.core.roce_guard)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vrnic.core import roce_guard as rg
from vrnic.core.roce_guard import GuardFlow
from vrnic.errors import InvalidArgument

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# Golden values printed by a C program built from the kernel's own functions, copied verbatim out of
# Linux 6.1 (include/linux/hash.h: hash_32; include/rdma/ib_verbs.h: rdma_calc_flow_label,
# rdma_flow_label_to_udp_sport, rdma_get_udp_sport; rxe_qp.c: RXE_ROCE_V2_SPORT + (hash_32(qpn, 14) & 0x3fff)).
# Columns: qpn, dest qpn, flow label, create-time port, derived flow label, port after RTR.
KERNEL_GOLDEN = [
    (0x11, 0x12, 0, 0xDF94, 0x132, 0xC132),
    (0x12, 0x11, 0, 0xF806, 0x132, 0xC132),
    (0x1A2B3C, 0x4D5E6F, 0, 0xCF30, 0xA4D87, 0xCDAE),
    (0xFFFFFF, 0xFFFFFF, 0, 0xF94D, 0xFFF1E, 0xFF21),
    (0x11, 0x12, 0x12345, 0xDF94, 0x132, 0xE341),
    (0, 0, 0, 0xC000, 0, 0xC000),
    (1, 0, 0, 0xD872, 0, 0xC000),
    (0x28, 0x29, 0xFFFFF, 0xD1D5, 0x668, 0xFFC0),
]


@pytest.mark.parametrize(("qpn", "dest", "label", "create_port", "derived", "port"), KERNEL_GOLDEN)
def test_ports_are_the_kernels(qpn: int, dest: int, label: int, create_port: int, derived: int, port: int) -> None:
    assert rg.rxe_create_sport(qpn) == create_port
    assert rg.rdma_calc_flow_label(qpn, dest) == derived
    assert rg.rxe_udp_sport(qpn, dest, label) == port


def test_hash_32_is_the_golden_ratio_multiply() -> None:
    assert rg.hash_32(1, 14) == 0x61C88647 >> 18
    assert rg.hash_32(0x11, 32) == (0x11 * 0x61C88647) & 0xFFFFFFFF


def test_a_connected_qp_and_its_peer_share_a_port() -> None:
    # The label derived from both QPNs is symmetric: requests and the peer's ACKs carry the same port.
    for a, b in [(17, 18), (0x123, 0x4567), (0xABCDEF, 0x12)]:
        assert rg.rxe_udp_sport(a, b) == rg.rxe_udp_sport(b, a)


def test_ports_stay_in_the_dynamic_range_and_any_label_can_pick_one() -> None:
    for qpn in range(0, 1 << 24, 4099):
        assert 0xC000 <= rg.rxe_create_sport(qpn) <= 0xFFFF
        assert 0xC000 <= rg.rxe_udp_sport(qpn, qpn ^ 0x5A5A5A) <= 0xFFFF
    # A label below 2**14 is its own port: whoever sets the label sets the port.
    assert {rg.rdma_flow_label_to_udp_sport(label) for label in range(1, 1 << 14)} == set(range(0xC001, 0x10000))


def test_qpns_and_labels_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        rg.rxe_create_sport(1 << 24)
    with pytest.raises(InvalidArgument):
        rg.rxe_udp_sport(1, -1)
    with pytest.raises(InvalidArgument):
        rg.rxe_udp_sport(1, 2, 1 << 20)


def test_a_flow_knows_its_packet_key() -> None:
    flow = GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.2", 0x12)
    assert flow.sport == 0xC132
    assert flow.key == ("10.0.0.1", 0xC132, "10.0.0.2", 0x12)
    assert GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.2", 0x12, flow_label=0x12345).sport == 0xE341


@pytest.mark.parametrize("bad", [
    dict(vrnic_id='v"1'), dict(vrnic_id="v 1"), dict(vrnic_id=""), dict(src_ip="fe80::1"),
    dict(dst_ip="10.0.0.02"), dict(dst_ip="host"), dict(src_qpn=1 << 24), dict(dst_qpn=-1),
    dict(flow_label=1 << 20),
])
def test_flows_refuse_what_the_table_cannot_hold(bad: dict[str, object]) -> None:
    fields: dict[str, object] = dict(vrnic_id="vr-0123", src_ip="10.0.0.1", src_qpn=17, dst_ip="10.0.0.2",
                                     dst_qpn=18)
    with pytest.raises(InvalidArgument):
        GuardFlow(**{**fields, **bad})  # type: ignore[arg-type]


BASE = """table inet vrnic_guard {
	set guarded {
		type ipv4_addr
	}

	set flows {
		typeof ip saddr . udp sport . ip daddr . @th,104,24
	}

	chain output {
		type filter hook output priority filter; policy accept;
		udp dport 4791 ip saddr @guarded jump roce
		meta nfproto ipv6 udp dport 4791 counter queue to 4791
	}

	chain roce {
		ip saddr . udp sport . ip daddr . @th,104,24 @flows accept
		@th,64,8 { 0x64, 0x65 } accept
		counter queue to 4791
	}
}
"""


def test_base_ruleset() -> None:
    assert rg.base_ruleset() == BASE


def test_the_shipped_nft_file_is_the_base_ruleset() -> None:
    text = (REPO / "kernel" / "roce_guard" / "vrnic_guard.nft").read_text()
    body = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#")).lstrip("\n")
    assert body == rg.base_ruleset()


def test_install_declares_flushes_then_loads_in_one_script() -> None:
    script = rg.install_script(["10.77.1.2", "10.77.1.1", "10.77.1.2"])
    declare, rest = script.split("flush chain inet vrnic_guard output\n")
    assert declare == """table inet vrnic_guard {
	set guarded {
		type ipv4_addr
	}
	set flows {
		typeof ip saddr . udp sport . ip daddr . @th,104,24
	}
	chain output {
		type filter hook output priority filter; policy accept;
	}
	chain roce {
	}
}
"""
    # The flows set is declared but never flushed: a repeated install keeps the allowed flows.
    assert rest == ("flush chain inet vrnic_guard roce\n"
                    "flush set inet vrnic_guard guarded\n"
                    + BASE + "add element inet vrnic_guard guarded { 10.77.1.1, 10.77.1.2 }\n")


def test_install_needs_ipv4_addresses() -> None:
    with pytest.raises(InvalidArgument):
        rg.install_script([])
    with pytest.raises(InvalidArgument, match="IPv4 only"):
        rg.install_script(["fd00::1"])


def test_allow_adds_commented_elements() -> None:
    flows = [GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.2", 0x12),
             GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.3", 0x12, flow_label=0x12345)]
    assert rg.allow_script(flows) == (
        "add element inet vrnic_guard flows { "
        '10.0.0.1 . 49458 . 10.0.0.2 . 0x12 comment "vrnic=v1 qpn=0x11", '
        '10.0.0.1 . 58177 . 10.0.0.3 . 0x12 comment "vrnic=v1 qpn=0x11 fl=0x12345" }\n')
    assert rg.allow_script([]) == ""


def test_revoke_deletes_one_vrnics_keys() -> None:
    present = [GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.2", 0x12),
               GuardFlow("v2", "10.0.0.1", 0x13, "10.0.0.2", 0x14),
               GuardFlow("v1", "10.0.0.1", 0x15, "10.0.0.4", 0x16)]
    assert rg.revoke_script("v1", present, table="t") == (
        "delete element inet t flows { 10.0.0.1 . 49458 . 10.0.0.2 . 0x12, "
        f"10.0.0.1 . {rg.rxe_udp_sport(0x15, 0x16)} . 10.0.0.4 . 0x16 }}\n")
    assert rg.revoke_script("v3", present) == ""


def test_remove_is_idempotent_by_declaring_first() -> None:
    assert rg.remove_script("t") == "table inet t {\n}\ndelete table inet t\n"


def test_table_names_are_plain_identifiers() -> None:
    for bad in ("", "a b", "x;flush ruleset", "1abc"):
        with pytest.raises(InvalidArgument):
            rg.remove_script(bad)
    assert "table inet vrnic_guard_test {" in rg.base_ruleset("vrnic_guard_test")


# What nft 1.0.6 prints for `nft -j list table inet vrnic_guard` (captured, elements trimmed to three).
LISTING = {"nftables": [
    {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}},
    {"table": {"family": "inet", "name": "vrnic_guard", "handle": 1}},
    {"set": {"family": "inet", "name": "guarded", "table": "vrnic_guard", "type": "ipv4_addr", "handle": 1,
             "elem": ["10.0.0.3", "10.0.0.1"]}},
    {"set": {"family": "inet", "name": "flows", "table": "vrnic_guard",
             "type": ["ipv4_addr", "inet_service", "ipv4_addr", "integer"], "handle": 2,
             "elem": [{"elem": {"val": {"concat": ["10.0.0.1", 49458, "10.0.0.2", 18]},
                                "comment": "vrnic=v1 qpn=0x11"}},
                      {"elem": {"val": {"concat": ["10.0.0.1", 58177, "10.0.0.2", 20]},
                                "comment": "vrnic=v1 qpn=0x13 fl=0x12345"}},
                      {"elem": {"val": {"concat": ["10.0.0.3", 49614, "10.0.0.2", 22]},
                                "comment": "vrnic=v2 qpn=0x15"}}]}},
    {"chain": {"family": "inet", "table": "vrnic_guard", "name": "output", "handle": 3, "type": "filter",
               "hook": "output", "prio": 0, "policy": "accept"}},
]}


def test_flows_are_parsed_back_from_the_listing() -> None:
    assert rg.parse_flows(LISTING) == [
        GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.2", 0x12),
        GuardFlow("v1", "10.0.0.1", 0x13, "10.0.0.2", 0x14, flow_label=0x12345),
        GuardFlow("v2", "10.0.0.3", 0x15, "10.0.0.2", 0x16),
    ]
    assert rg.parse_guarded(LISTING) == ["10.0.0.1", "10.0.0.3"]
    assert rg.parse_flows(LISTING, table="other") == [] and rg.parse_flows({}) == []


@pytest.mark.parametrize("elem", [
    {"concat": ["10.0.0.1", 49458, "10.0.0.2", 18]},  # added by hand, no comment
    {"elem": {"val": {"concat": ["10.0.0.1", 49459, "10.0.0.2", 18]}, "comment": "vrnic=v1 qpn=0x11"}},  # port
    {"elem": {"val": {"concat": ["10.0.0.1", 49458, "10.0.0.2"]}, "comment": "vrnic=v1 qpn=0x11"}},
    {"elem": {"val": {"concat": ["10.0.0.1", 49458, "10.0.0.2", 18]}, "comment": "qpn=0x11"}},
])
def test_elements_vrnic_did_not_write_are_reported(elem: object) -> None:
    listing = {"nftables": [{"set": {"name": "flows", "table": "vrnic_guard", "elem": [elem]}}]}
    with pytest.raises(ValueError):
        rg.parse_flows(listing)


def test_drop_script_deletes_exactly_the_given_flows() -> None:
    a = rg.GuardFlow("v1", "10.0.0.1", 0x11, "10.0.0.2", 0x12)
    b = rg.GuardFlow("v1", "10.0.0.1", 0x13, "10.0.0.2", 0x14)
    script = rg.drop_script([b, a, a])
    assert script.startswith("delete element inet vrnic_guard flows { ")
    assert script.count("10.0.0.1 . ") == 2 and "0x12" in script and "0x14" in script
    assert rg.drop_script([]) == ""
