"""bench.rest_floor: the REST allocate route's HTTP stack with no work behind it, and the control plane
called without HTTP; the two floors `make bench` puts under cp.rest.* (issue 14)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from bench.rest_floor import FLOOR_TOKEN, allocate_cpu_ms, floor_app


def test_the_floor_route_answers_as_the_real_one_does_without_doing_the_work() -> None:
    app = floor_app()
    with TestClient(app) as client:
        made = client.post("/api/v1/vrnics", json={}, headers={"Authorization": f"Bearer {FLOOR_TOKEN}"})
        assert made.status_code == 201, made.text
        assert app.state.fast_routes[0].served == 1  # the daemon's fast route, as in vrnic.api.app
        assert made.headers["location"] == f"/api/v1/vrnics/{made.json()['id']}"
        assert made.json()["attach"]["token"]
        # the same dependencies and problem handlers run: token, body and query are checked
        assert client.post("/api/v1/vrnics", json={}).json()["code"] == "unauthenticated"
        refused = client.post("/api/v1/vrnics", json={"bogus": 1}, headers={"Authorization": f"Bearer {FLOOR_TOKEN}"})
        assert refused.status_code == 422 and refused.json()["code"] == "invalid_request"
        unknown = client.post("/api/v1/vrnics?forse=1", json={}, headers={"Authorization": f"Bearer {FLOOR_TOKEN}"})
        assert unknown.status_code == 400 and "forse" in unknown.json()["detail"]


def test_the_control_plane_floor_is_real_allocations_on_a_database() -> None:
    assert 0 < allocate_cpu_ms(20) < 1000
