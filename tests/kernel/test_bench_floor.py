"""The bench's bare mediator (bench.mediation_floor) does on rxe the work it stands for: its floors are real verbs."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.kernel.conftest import wait_for_baseline
from vrnic.backend.rdma_tool import resource_counts

pytestmark = pytest.mark.kernel


def _qp_states(pid: int) -> list[str]:
    shown = subprocess.run(["rdma", "-j", "res", "show", "qp"], capture_output=True, text=True, check=True).stdout
    return sorted(qp["state"] for qp in json.loads(shown) if qp.get("pid") == pid)


def _count(kind: str) -> int:
    return sum(counts.get(kind, 0) for counts in resource_counts().values())


def test_the_bare_mediator_connects_real_qps_registers_real_memory_and_leaves_nothing(
        device_pair: tuple[str, str]) -> None:
    from bench.mediation_floor import bare_mediator

    baseline = resource_counts()
    with bare_mediator(device_pair) as bare:
        bare.create(0, 2)
        bare.create(1, 2)
        assert _qp_states(bare.pid) == ["RESET"] * 6  # with each side's endpoint QP, never connected
        bare.connect(0)
        assert _qp_states(bare.pid) == ["RESET"] * 4 + ["RTS"] * 2
        bare.connect(1)
        assert _qp_states(bare.pid) == ["RESET"] * 2 + ["RTS"] * 4
        mrs = _count("mr")
        dereg = bare.reg(4096, 1 << 20)
        assert _count("mr") == mrs + 1
        dereg()
        assert _count("mr") == mrs
        bare.reg_many(1 << 20, 4096, 8)  # a pool's refill: eight MRs on pages side by side
        assert _count("mr") == mrs + 8
        bare.reg_many((1 << 20) + 8 * 4096, 4096, 16)
        assert _count("mr") == mrs + 24
        bare.dereg_first()  # a handed-out MR's close
        assert _count("mr") == mrs + 23
        bare.dereg_many()
        assert _count("mr") == mrs
        bare.close_qps()
        assert _qp_states(bare.pid) == ["RESET"] * 2
        bare.create(0, 4)  # a pool's refill of QPs, then a handed-out QP's close
        assert _qp_states(bare.pid) == ["RESET"] * 6
        bare.close_first(0)
        assert _qp_states(bare.pid) == ["RESET"] * 5
        bare.close_qps()
        assert _qp_states(bare.pid) == ["RESET"] * 2
    assert wait_for_baseline(baseline) == baseline, "the bare mediator left kernel objects"
