"""schemathesis against the served OpenAPI schema: no 5xx, responses conform to the schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import SecretStr
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sriov_fakes import MemoryKernel, sriov_driver

from vrnic.api.app import create_app
from vrnic.backend.driver import load_driver
from vrnic.backend.service import BackendService
from vrnic.config import DaemonSettings
from vrnic.core.specs import VrnicMode
from vrnic.daemon import serve_in_thread
from vrnic.db.engine import make_engine
from vrnic.db.migrate import upgrade

TOKEN = "vro_schemathesis-operator"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TENANT_AUTH: dict[str, str] = {}  # filled once the tenant exists
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API served over HTTP on SQLite, with a tenant and a vRNIC in it; SR-IOV over in-memory kernel edges."""
    state: Path = tmp_path_factory.mktemp("schemathesis")
    engine = make_engine(f"sqlite:///{state / 'vrnic.db'}")
    upgrade(engine)
    backend = BackendService({VrnicMode.PARAVIRTUAL: load_driver("fake"),
                              VrnicMode.SRIOV: sriov_driver(engine, "st-host", MemoryKernel())})
    app = create_app(DaemonSettings(state_dir=state, operator_token=SecretStr(TOKEN), host_name="st-host"),
                     backend, engine=engine)
    with serve_in_thread(app) as base_url:
        tenant = httpx.post(f"{base_url}/api/v1/tenants", json={"name": "acme"}, headers=AUTH)
        tenant.raise_for_status()
        TENANT_AUTH["Authorization"] = f"Bearer {tenant.json()['token']}"
        httpx.post(f"{base_url}/api/v1/vrnics", json={"tenant": "acme"}, headers=AUTH).raise_for_status()
        yield base_url
    backend.close()
    engine.dispose()


@pytest.fixture(scope="module")
def api_schema(served: str) -> Any:
    return schemathesis.openapi.from_url(f"{served}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case: Any, served: str) -> None:
    case.call_and_validate(base_url=served, headers=AUTH, checks=CHECKS)


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema_for_a_tenant(case: Any, served: str) -> None:
    case.call_and_validate(base_url=served, headers=TENANT_AUTH, checks=CHECKS)


def test_schema_documents_problem_json_and_bearer_auth(served: str) -> None:
    document = httpx.get(f"{served}/openapi.json").json()
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    allocate = document["paths"]["/api/v1/vrnics"]["post"]
    assert "application/problem+json" in allocate["responses"]["409"]["content"]
    assert {p["name"] for p in allocate["parameters"]} == {"idempotency-key"}
    # attach state is observed by vrnicd: no client can set it
    assert not [path for path in document["paths"] if path.endswith(("/attach", "/detach"))]
    assert set(document["paths"]["/api/v1/vrnics/{vrnic_id}"]) == {"get", "delete", "patch"}  # patch: QoS only
    assert "observes" in document["paths"]["/api/v1/vrnics/{vrnic_id}"]["get"]["description"]
    # security groups: add, list, delete; the agents' host-to-host routes are not part of the public API
    assert set(document["paths"]["/api/v1/security-rules"]) == {"get", "post"}
    assert set(document["paths"]["/api/v1/security-rules/{rule_id}"]) == {"delete"}
    assert not [path for path in document["paths"] if path.startswith("/agent/")]
    created = document["components"]["schemas"]["VrnicCreate"]["properties"]
    assert {"host", "virtual_ip"} <= set(created)
    assert {"reachable", "virtual_ip"} <= set(document["components"]["schemas"]["VrnicOut"]["properties"])
    assert document["components"]["schemas"]["HostOut"]["properties"]["state"]["enum"] == ["up", "down"]
