"""Issue 12 across two real hosts: a vRNIC's cap holds on traffic that crosses the link to the other host, and a
live PATCH of the cap applies while it streams (its QP stays connected), with a's HTB read back by iproute2.
vrnicd gave the shaped QP an RC timeout above what its packets can wait in the class's queue, read back from
the physical QP (a timeout during queueing is what made rxe fail such streams with IBV_WC_REM_INV_REQ_ERR;
vrnic.core.qos). QEMU's dgram link loses packets when the machine is loaded, and rxe retransmits those by
design: a's retransmission counter is read at each window's edges, and a window's lower bound allows one RC
timeout of stall per retransmission in it (capped_rate_floor); the upper bound does not move.

a's agent is restarted for these tests with VRNIC_QOS_LINK_MBPS (eth0 is virtio-net without a speed); it stays
so for the rest of the session (QoS acts only on vRNICs that ask for it). Rates are the vRNIC's HTB class byte
counter on a, read with tc.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from vrnic.core.qos import RC_TIMEOUT_MARGIN, RC_TIMEOUT_UNIT_S, queue_wait_s, rc_timeout_floor
from vrnic.lab.qos_two_hosts import (
    Pair,
    Program,
    capped_rate_floor,
    class_bytes,
    find_classes,
    rxe_counters,
    set_qos,
    tc_show,
)
from vrnic.lab.two_hosts.agent import AgentProcess
from vrnic.lab.two_hosts.rig import Rig

from .support import eventually, release

LINK_MBPS = 24
CAP_MBPS, NEW_CAP_MBPS = 16, 12  # 12: rxe's 65 packets in flight wait 48 ms at the qdisc, near the guest's 67 ms
GUEST_TIMEOUT = 14  # what the guest library asks for (verb_args.ModifyQp)


def _hosts_up(rig: Rig) -> bool:
    with rig.client("a") as api:
        listed = api.get("/hosts")
    return listed.status_code == 200 and {h["name"] for h in listed.json()["items"] if h["state"] == "up"} >= {"a", "b"}


@pytest.fixture
def qos_rig(rig: Rig) -> Iterator[Rig]:
    """The rig with a's agent told its link speed (QoS on)."""
    original = rig.agents["a"]
    assert isinstance(original, AgentProcess)
    original.stop()
    shaped = AgentProcess(dataclasses.replace(original.config, env={**original.config.env,
                                                                    "VRNIC_QOS_LINK_MBPS": str(LINK_MBPS)}))
    shaped.start()
    rig.agents["a"] = shaped
    assert eventually(lambda: _hosts_up(rig), timeout=15), "a's restarted agent does not beat"
    yield rig


def _retransmissions() -> int:
    return rxe_counters().get("completer_retry_err", 0)


def test_cap_holds_across_hosts_and_a_live_patch_applies_while_streaming(qos_rig: Rig) -> None:
    rig = qos_rig
    token = rig.make_tenant("shaped")
    mine = rig.allocate("a", token, qos={"rate_cap_mbps": CAP_MBPS})
    theirs = rig.allocate("a", token, host="b")
    programs = [Program(), Program(rig.control)]
    try:
        pair = Pair.connect(mine, theirs, *programs)
        timeout = pair.streamer.call("query")["timeout"]  # the physical QP's, as rxe holds it
        counted = rxe_counters()
        with rig.client("a") as api:
            klass = find_classes(api, {"x": pair})["x"]  # its HTB class on a's eth0
            pair.streamer.send("stream", seconds=20.0)  # outlasts the PATCH (seconds under a loaded machine)
            time.sleep(0.5)
            first, retx_first = class_bytes(), _retransmissions()
            time.sleep(2.5)
            second, retx_second = class_bytes(), _retransmissions()
            shown = tc_show()
            patching = time.monotonic()
            set_qos(api, mine["id"], rate_cap_mbps=NEW_CAP_MBPS)  # live, while the QP streams
            patch_s = time.monotonic() - patching
            patched = tc_show()
            time.sleep(1.0)  # what the qdisc held at the old rate drains
            third, retx_third = class_bytes(), _retransmissions()
            time.sleep(2.0)
            fourth, retx_fourth = class_bytes(), _retransmissions()
            done = pair.streamer.reply(timeout=120)  # every WRITE completed: the QP stayed connected
        after_stream = rxe_counters()
        retries, naks = (after_stream.get(k, 0) - counted.get(k, 0) for k in ("completer_retry_err", "rcvd_seq_err"))
        before = (second[0][klass] - first[0][klass]) * 8 / (second[1] - first[1]) / 1e6
        after = (fourth[0][klass] - third[0][klass]) * 8 / (fourth[1] - third[1]) / 1e6
        # a retransmission in a window stalls the stream for up to one RC timeout: the floor allows for it
        rc_timeout_s = RC_TIMEOUT_UNIT_S * 2 ** timeout
        floor_before = capped_rate_floor(CAP_MBPS, second[1] - first[1], retx_second - retx_first, rc_timeout_s)
        floor_after = capped_rate_floor(NEW_CAP_MBPS, fourth[1] - third[1], retx_fourth - retx_third, rc_timeout_s)
        print(f"cap {CAP_MBPS}: {before:.1f} Mbit/s (floor {floor_before:.1f}, {retx_second - retx_first} "
              f"retransmissions); live PATCH to {NEW_CAP_MBPS} ({patch_s:.1f} s): {after:.1f} Mbit/s (floor "
              f"{floor_after:.1f}, {retx_fourth - retx_third} retransmissions); "
              f"goodput {done['mbps']:.2f} MB/s over {done['writes']} WRITEs; RC timeout {timeout} "
              f"({RC_TIMEOUT_UNIT_S * 2 ** timeout * 1e3:.0f} ms); rxe on a: {retries} retransmissions, "
              f"{naks} sequence NAKs\n{shown}\n{patched}")
        # the class drained at no more than the cap at connect: vrnicd's floor is at least the cap's, and it
        # outlasts the queue at the lower cap by the margin too
        assert timeout >= rc_timeout_floor(1024, 1, CAP_MBPS * 1000) > GUEST_TIMEOUT, timeout
        assert RC_TIMEOUT_UNIT_S * 2 ** timeout >= RC_TIMEOUT_MARGIN * queue_wait_s(1024, 1, NEW_CAP_MBPS * 1000)
        assert floor_before <= before <= CAP_MBPS * 1.10, (before, floor_before, shown)
        assert floor_after <= after <= NEW_CAP_MBPS * 1.10, (after, floor_after, patched)
        assert "class htb" in shown and f"ceil {CAP_MBPS}Mbit" in shown and "u32" in shown, shown
        assert f"ceil {NEW_CAP_MBPS}Mbit" in patched and f"ceil {CAP_MBPS}Mbit" not in patched, patched
    finally:
        for program in programs:
            program.close()
        release(rig, mine, theirs)
