"""The HTB shaper on real netlink (vrnic.backend.qos_shaper), read back with iproute2's `tc`.

A veth pair of its own (not the lab's rxe link), so this needs only netlink and sch_htb/cls_u32: classes
and filters appear and go with vRNICs and QPs, each class queues in a pfifo of ours long enough never to drop,
a live policy change rewrites the class in place, drift made by hand (`tc` deleting a class and a filter,
shortening a queue) is restored by reconcile, and close() leaves nothing.

Run: vrnic lab run -e PYTHONPATH=$PWD -- pytest -m kernel tests/kernel/test_qos_shaper.py
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from vrnic.backend.qos_shaper import HtbShaper
from vrnic.core.specs import QosPolicy
from vrnic.errors import Conflict

pytestmark = pytest.mark.kernel
DEV = "vqos0"


def _tc(*args: str) -> str:
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"tc {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def _kbit(text: str) -> int:
    units = {"Gbit": 1_000_000, "Mbit": 1000, "Kbit": 1, "bit": 0.001}
    for unit, scale in units.items():
        if text.endswith(unit):
            return round(float(text[:-len(unit)]) * scale)
    raise ValueError(text)


def _classes() -> dict[str, tuple[int, int]]:
    """classid -> (rate, ceil) in kbit/s of the classes under 1:1, from `tc class show` (htb has no -j)."""
    found = {}
    for line in _tc("class", "show", "dev", DEV).splitlines():
        words = line.split()
        if len(words) > 4 and words[:2] == ["class", "htb"] and words[3:5] == ["parent", "7672:1"]:
            found[words[2]] = (_kbit(words[words.index("rate") + 1]), _kbit(words[words.index("ceil") + 1]))
    return found


def _leaves() -> dict[str, tuple[str, str]]:
    """parent class -> (handle, limit) of the pfifo qdiscs under our classes."""
    found = {}
    for line in _tc("qdisc", "show", "dev", DEV).splitlines():
        words = line.split()
        if words[:2] == ["qdisc", "pfifo"] and words[3] == "parent" and words[4].startswith("7672:"):
            found[words[4]] = (words[2], words[words.index("limit") + 1])
    return found


def _filters() -> dict[str, str]:
    """'match value' -> flowid of the u32 filters on 1:."""
    found = {}
    current = None
    for line in _tc("filter", "show", "dev", DEV, "parent", "7672:").splitlines():
        if "flowid" in line:
            current = line.split("flowid")[1].split()[0]
        if line.strip().startswith("match") and " at 20" in line and current:
            found[line.split()[1].split("/")[0]] = current
    return found


@pytest.fixture
def veth() -> Iterator[str]:
    if os.environ.get("VRNIC_LAB") != "1" and os.geteuid() != 0:
        pytest.skip("needs root and netlink (the lab)")
    made = subprocess.run(["ip", "link", "add", DEV, "type", "veth", "peer", "name", DEV + "p"],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a veth pair here: {made.stderr.strip()}")
    try:
        yield DEV
    finally:
        subprocess.run(["ip", "link", "del", DEV], capture_output=True)


def test_classes_and_filters_follow_vrnics_and_qps_and_drift_is_restored(veth: str) -> None:
    shaper = HtbShaper(veth, link_mbps=100)
    try:
        shaper.set_policy("a", QosPolicy(rate_cap_mbps=50))
        shaper.set_policy("b", QosPolicy(guarantee_mbps=30, rate_cap_mbps=80))
        shaper.set_policy("c", QosPolicy(weight=3))
        # a: weight 1 of the 70 Mbit/s no guarantee holds (17.5), c: weight 3 (52.5); b: its guarantee
        assert _classes() == {"7672:10": (17_500, 50_000), "7672:11": (30_000, 80_000), "7672:12": (52_500, 100_000)}
        # each class queues in a pfifo of its own, long enough for 1024 QPs' packets in flight (never drops)
        assert _leaves() == {f"7672:{m}": (f"80{m}:", "66560p") for m in ("10", "11", "12")}
        with pytest.raises(Conflict, match=r"sum to 110 Mbit/s \(30 given \+ 80 asked\) on a 100 Mbit/s link"):
            shaper.set_policy("d", QosPolicy(guarantee_mbps=80))
        assert "7672:13" not in _classes()  # nothing was installed for the refused one
        shaper.classify("a", (0xC123, 0x11))
        shaper.classify("a", (0xC124, 0x12))
        shaper.classify("a", (0xC124, 0x12))  # two QPs with one key: one filter, counted twice
        shaper.classify("b", (0xC456, None))
        assert _filters() == {"c12312b7": "7672:10", "c12412b7": "7672:10", "c45612b7": "7672:11"}
        with pytest.raises(Conflict, match="cannot tell this QP's packets"):
            shaper.classify("b", (0xC123, 0x11))
        shaper.unclassify("a", (0xC124, 0x12))
        assert _filters() == {"c12312b7": "7672:10", "c12412b7": "7672:10", "c45612b7": "7672:11"}
        shaper.unclassify("a", (0xC124, 0x12))
        assert _filters() == {"c12312b7": "7672:10", "c45612b7": "7672:11"}
        # live change: the class is rewritten in place, its filters stay
        shaper.set_policy("a", QosPolicy(rate_cap_mbps=20))
        assert _classes()["7672:10"][1] == 20_000 and _filters()["c12312b7"] == "7672:10"
        # drift by hand, restored by reconcile (a set difference, both ways)
        _tc("class", "del", "dev", veth, "classid", "7672:12")
        _tc("class", "add", "dev", veth, "parent", "7672:1", "classid", "7672:99", "htb", "rate", "1mbit")
        handle = next(line.split("fh")[1].split()[0] for line in _tc("filter", "show", "dev", veth, "parent", "7672:")
                      .splitlines() if "flowid 7672:11" in line)
        _tc("filter", "del", "dev", veth, "parent", "7672:", "protocol", "ip", "prio", "10", "handle", handle, "u32")
        _tc("qdisc", "replace", "dev", veth, "parent", "7672:11", "handle", "8011:", "pfifo", "limit", "10")
        found = shaper.reconcile()
        assert [c.minor for c in found.add_classes] == [0x12] and found.remove_classes == (0x99,)
        assert [c.minor for c in found.change_classes] == [0x11]  # its queue shortened by hand
        assert _leaves() == {f"7672:{m}": (f"80{m}:", "66560p") for m in ("10", "11", "12")}
        assert [f.key for f in found.add_filters] == [(0xC456, None)]
        assert shaper.reconcile().empty
        assert set(_classes()) == {"7672:10", "7672:11", "7672:12"} and _filters()["c45612b7"] == "7672:11"
        # a restarted vrnicd adopts what it wants and reconciles the kernel to it
        again = HtbShaper(veth, link_mbps=100)
        again.adopt({"a": QosPolicy(rate_cap_mbps=20), "b": QosPolicy(guarantee_mbps=30, rate_cap_mbps=80),
                     "c": QosPolicy(weight=3)}, {"a": [(0xC123, 0x11)], "b": [(0xC456, None)]})
        assert again.reconcile().empty
        shaper.forget("c")
        assert set(_classes()) == {"7672:10", "7672:11"}
        counters = shaper.counters()
        assert set(counters) == {"a", "b"} and counters["a"].bytes >= 0
    finally:
        shaper.close()
    assert "htb" not in _tc("qdisc", "show", "dev", veth)
    # what a vrnicd killed with -9 leaves behind is swept by the next one
    left = HtbShaper(veth, link_mbps=100)
    left.set_policy("a", QosPolicy(rate_cap_mbps=5))
    left._ipr.close()  # as if the process died: nothing removed
    left._ipr = None
    assert "htb 7672:" in _tc("qdisc", "show", "dev", veth)
    assert HtbShaper(veth).sweep() and "htb" not in _tc("qdisc", "show", "dev", veth)


def _rx_filters() -> int:
    """How many receive-counting filters (ingress, a pass action into ffff:1) are on the device."""
    return sum("flowid ffff:1" in line for line in _tc("filter", "show", "dev", DEV, "ingress").splitlines())


def test_destroying_many_qps_reads_the_filters_once_and_takes_filters_gone_by_hand_in_its_stride(
        veth: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A QP's destroy deletes its two filters by the handles one dump read (a dump per destroy made destroying
    N shaped QPs O(N^2)). A filter deleted by hand in between is simply gone; an ingress qdisc deleted by hand is
    put back for the next QP; a netdev made again under the same name is found again by reconcile."""
    shaper = HtbShaper(veth, link_mbps=100)
    dumps = {"filters": 0, "rx": 0}
    observed, observed_rx = shaper._observed, shaper._observed_rx

    def counted_observed(with_leaves: bool = False) -> Any:
        dumps["filters"] += 1
        return observed(with_leaves)

    def counted_observed_rx() -> Any:
        dumps["rx"] += 1
        return observed_rx()

    monkeypatch.setattr(shaper, "_observed", counted_observed)
    monkeypatch.setattr(shaper, "_observed_rx", counted_observed_rx)
    try:
        shaper.set_policy("a", QosPolicy(rate_cap_mbps=50))
        keys = [(0xC100 + i, 0x100 + i) for i in range(20)]
        for i, key in enumerate(keys):
            shaper.classify("a", key)
            shaper.count_received("a", 0x100 + i)
        assert len(_filters()) == 20 and _rx_filters() == 20
        # the first QP's two filters deleted by hand (their handles read with the shaper's own dumps, uncounted)
        egress = next(handle for f, handle in observed()[1].items() if f.key == keys[0])
        ingress = observed_rx()[0x100][0]
        for parent, handle in (("7672:", egress), ("ffff:", ingress)):
            _tc("filter", "del", "dev", veth, "parent", parent, "protocol", "ip", "prio", "10", "handle",
                f"{handle >> 20:x}:{(handle >> 12) & 0xFF:x}:{handle & 0xFFF:x}", "u32")
        assert len(_filters()) == 19 and _rx_filters() == 19
        for i, key in enumerate(keys[:10]):
            shaper.unclassify("a", key)
            shaper.uncount_received("a", 0x100 + i)
        assert len(_filters()) == 10 and _rx_filters() == 10
        assert dumps == {"filters": 1, "rx": 1}
        # the ingress qdisc deleted by hand (its filters with it): the next QP's counting puts it back
        _tc("qdisc", "del", "dev", veth, "ingress")
        shaper.count_received("a", 0x200)
        assert _rx_filters() == 1
        # the netdev made again under its name: reconcile finds the new one and puts everything back
        subprocess.run(["ip", "link", "del", veth], check=True)
        subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p"], check=True)
        found = shaper.reconcile()
        assert [c.minor for c in found.add_classes] == [0x10] and len(found.add_filters) == 10
        assert set(_classes()) == {"7672:10"} and len(_filters()) == 10 and _rx_filters() == 11
        for i, key in enumerate(keys[10:], 10):
            shaper.unclassify("a", key)
            shaper.uncount_received("a", 0x100 + i)
        shaper.uncount_received("a", 0x200)
        assert len(_filters()) == 0 and _rx_filters() == 0
    finally:
        shaper.close()
    assert "htb" not in _tc("qdisc", "show", "dev", veth)


def test_a_policy_change_puts_every_class_again_but_each_queue_once(
        veth: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shares move with every policy, so each change puts every class again; replacing a class keeps its queue,
    so the queue is put once per class (and again after reconcile found it changed by hand)."""
    shaper = HtbShaper(veth, link_mbps=100)
    asked: list[str] = []
    netlink = shaper._netlink

    def spied(what: str) -> Any:
        asked.append(what)
        return netlink(what)

    monkeypatch.setattr(shaper, "_netlink", spied)
    try:
        shaper.set_policy("a", QosPolicy(rate_cap_mbps=50))
        shaper.set_policy("b", QosPolicy(weight=3))
        shaper.set_policy("a", QosPolicy(rate_cap_mbps=40))
        assert asked.count("class") == 5 and asked.count("class queue") == 2  # a, then a b, then a b again
        assert _classes() == {"7672:10": (25_000, 40_000), "7672:11": (75_000, 100_000)}
        assert _leaves() == {f"7672:{m}": (f"80{m}:", "66560p") for m in ("10", "11")}
        _tc("qdisc", "replace", "dev", veth, "parent", "7672:10", "handle", "8010:", "pfifo", "limit", "10")
        assert [c.minor for c in shaper.reconcile().change_classes] == [0x10]
        assert _leaves()["7672:10"] == ("8010:", "66560p")
        asked.clear()
        shaper.set_policy("b", QosPolicy(weight=1))
        assert asked.count("class") == 2 and "class queue" not in asked
        assert _classes() == {"7672:10": (40_000, 40_000), "7672:11": (50_000, 100_000)}
    finally:
        shaper.close()
