"""The control plane on the real backend: allocate through REST, attach a frontend, move bytes, release."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import AttachInfo
from vrnic.daemon import build_backend, serve_in_process
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, NotFound, RecvRequest, SendRequest, WrOpcode

from .conftest import wait_for_baseline

OPERATOR = "operator-secret-for-the-kernel-tier"


@contextmanager
def served(tmp_path: Path, **settings: Any) -> Iterator[tuple[BackendService, httpx.Client, httpx.Client]]:
    """`vrnic daemon`'s app on the verbs driver (rxe), in-process: the backend, an operator client and a client of
    the tenant acme. Afterwards the kernel holds what it held before."""
    baseline = resource_counts()
    config = DaemonSettings(state_dir=tmp_path, operator_token=OPERATOR, sriov_driver=None,
                            paravirtual_driver="verbs",
                            paravirtual_driver_options={"socket_path": str(tmp_path / "vrnicd.sock")}, **settings)
    backend = build_backend(config)
    try:
        with serve_in_process(config, backend) as url:
            operator = httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {OPERATOR}"},
                                    timeout=60)
            token = operator.post("/tenants", json={"name": "acme"}).json()["token"]
            tenant = httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                  timeout=60)
            try:
                yield backend, operator, tenant
            finally:
                operator.close()
                tenant.close()
    finally:
        backend.close()
    assert wait_for_baseline(baseline) == baseline


def test_rest_allocate_attach_verbs_release(device_pair: tuple[str, str], tmp_path: Path) -> None:
    baseline = resource_counts()
    with served(tmp_path) as (backend, operator, tenant):
        devices = {d["name"] for d in operator.get("/devices").json()["items"]}
        assert {device_pair[0], device_pair[1]} <= devices  # discovered from the real kernel
        created = [tenant.post("/vrnics", json={"device": dev, "quota": {"max_qps": 2}}) for dev in device_pair]
        assert [r.status_code for r in created] == [201, 201], [r.text for r in created]
        vrnics = [r.json() for r in created]
        assert backend.vrnic_ids() == {v["id"] for v in vrnics}  # real state in vrnicd, not just rows
        infos = [AttachInfo(**v["attach"]) for v in vrnics]
        access = Access.LOCAL_WRITE | Access.REMOTE_WRITE
        with Context.attach(infos[0], 1 << 20) as ca, Context.attach(infos[1], 1 << 20) as cb:
            assert ca.gid == vrnics[0]["virtual_gid"] and cb.gid == vrnics[1]["virtual_gid"]
            for v in vrnics:  # what vrnicd observes, not what a client says
                assert tenant.get(f"/vrnics/{v['id']}").json()["state"] == "attached"
            pa, pb = PD(ca), PD(cb)
            cqa, cqb = CQ(ca, 16), CQ(cb, 16)
            mra, mrb = MR(pa, 4096, access), MR(pb, 4096, access)
            qa, qb = QP(pa, cqa, cqa), QP(pb, cqb, cqb)
            qa.connect(cb.gid, qb.qpn)
            qb.connect(ca.gid, qa.qpn)
            qb.post_recv(RecvRequest(1, (mrb.sge(0, 64),)))
            mra.write(b"allocated through REST" + bytes(42))
            qa.post_send(SendRequest(1, WrOpcode.SEND, (mra.sge(0, 64),)))
            assert cqa.wait(1)[0].status == 0 and cqb.wait(1)[0].status == 0
            assert mrb.read(22) == b"allocated through REST"
            qa.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (mra.sge(0, 22),), remote_addr=mrb.addr + 1000,
                                     rkey=mrb.rkey))
            assert cqa.wait(1)[0].status == 0 and mrb.read(22, 1000) == b"allocated through REST"
            assert resource_counts()[device_pair[0]]["qp"] == baseline[device_pair[0]]["qp"] + 1
            for obj in (qa, qb, mra, mrb, cqa, cqb, pa, pb):
                obj.close()
        for v in vrnics:
            assert tenant.get(f"/vrnics/{v['id']}").json()["state"] == "detached"
            released = tenant.delete(f"/vrnics/{v['id']}")
            assert released.status_code == 200 and released.json()["state"] == "released"
        # The backend state is gone: no vRNIC in vrnicd, no kernel object, and the token attaches nothing.
        assert backend.vrnic_ids() == set()
        assert wait_for_baseline(baseline) == baseline
        with pytest.raises(NotFound):
            Context.attach(infos[0], 1 << 20)
        events = operator.get("/events").json()["items"]
        actions = {e["action"] for e in events}
        assert {"vrnic.allocate", "vrnic.attach", "vrnic.detach", "vrnic.release"} <= actions, events


def test_rest_refuses_guarantees_past_the_link_with_the_numbers(device_pair: tuple[str, str], tmp_path: Path) -> None:
    """rxe with the shaper (a 100 Mbit/s link): a second guarantee that does not fit is refused at allocate and
    at PATCH with a 409 that gives the sum, and what was admitted stays as it was."""
    with served(tmp_path, qos_link_mbps=100) as (backend, _, tenant):
        device = device_pair[0]
        first = tenant.post("/vrnics", json={"device": device, "qos": {"guarantee_mbps": 60}})
        assert first.status_code == 201, first.text
        refused = tenant.post("/vrnics", json={"device": device, "qos": {"guarantee_mbps": 50}})
        assert refused.status_code == 409, refused.text
        assert "sum to 110 Mbit/s (60 given + 50 asked) on a 100 Mbit/s link" in refused.json()["detail"]
        second = tenant.post("/vrnics", json={"device": device, "qos": {"guarantee_mbps": 40}})
        assert second.status_code == 201, second.text
        url_second = f"/vrnics/{second.json()['id']}"
        grown = tenant.patch(url_second, json={"qos": {"guarantee_mbps": 45}})
        assert grown.status_code == 409, grown.text
        assert "sum to 105 Mbit/s (60 given + 45 asked)" in grown.json()["detail"]
        assert tenant.get(url_second).json()["qos"]["guarantee_mbps"] == 40  # refused: unchanged
        over = tenant.patch(url_second, json={"qos": {"rate_cap_mbps": 150}})
        assert over.status_code == 400, over.text
        assert "a cap of 150 Mbit/s exceeds the link's 100 Mbit/s" in over.json()["detail"]
        assert backend.vrnic_ids() == {first.json()["id"], second.json()["id"]}  # nothing half-made
        for made in (first, second):
            assert tenant.delete(f"/vrnics/{made.json()['id']}").status_code == 200
