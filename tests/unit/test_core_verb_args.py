"""Argument schemas of the frontend protocol's operations (vrnic.core.verb_args)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from vrnic.core.verb_args import (
    OPS,
    Args,
    Attach,
    BusyPoll,
    Connect,
    CreateCq,
    CreateQp,
    ModifyQp,
    QueryGid,
    QueryPort,
    RegMr,
)

# A minimal valid argument set for every operation vrnicd serves.
VALID: dict[str, dict[str, Any]] = {
    "query_device": {}, "alloc_pd": {}, "detach": {}, "sync": {},
    "query_port": {"port": 1}, "query_gid": {"port": 1, "index": 0},
    "dealloc_pd": {"pd": 5},
    "reg_mr": {"pd": 5, "addr": 0, "length": 4096, "access": 7},
    "dereg_mr": {"mr": 6},
    "create_cq": {"cqe": 16, "ring": 0},
    "destroy_cq": {"cq": 7},
    "create_qp": {"pd": 5, "send_cq": 7, "recv_cq": 7, "max_send_wr": 16, "max_recv_wr": 16,
                  "sq_ring": 0, "rq_ring": 4096},
    "destroy_qp": {"qp": 8}, "query_qp": {"qp": 8},
    "modify_qp": {"qp": 8, "state": "init"},
    "connect": {"qp": 8, "remote_gid": "fd76:726e::2", "remote_qpn": 17},
    "busy_poll": {"enabled": True},
    "null_rpc": {},
    "alloc_pds": {"count": 4},
    "create_cqs": {"cqe": 64, "rings": [0, 4096]},
    "reg_mrs": {"pd": 5, "addrs": [0, 4096], "length": 4096, "access": 7},
    "dereg_mrs": {"mrs": [3, 4]},
    "destroy_qps": {"qps": [8, 9]},
    "create_qps": {"qps": [{"pd": 5, "send_cq": 7, "recv_cq": 7, "qp_type": "rc", "max_send_wr": 16,
                            "max_recv_wr": 16, "max_sge": 1, "sq_ring": 0, "rq_ring": 4096}]},
    "connect_qps": {"connections": [{"qp": 8, "remote_gid": "fd76:726e::2", "remote_qpn": 17, "access": 15}]},
    "resolve_rkey": {"qp": 1, "rkey": 0x1234},
    "translations": {},
    "resolve_ip": {"ip": "10.0.0.2"},
    "cm_listen": {"port": 7471}, "cm_unlisten": {"port": 7471},
    "cm_get_request": {"port": 7471, "timeout_ms": 100},
    "cm_accept": {"request": 3, "qp": 8, "private_data": "00ff"},
    "cm_reject": {"request": 3},
    "cm_connect": {"qp": 8, "ip": "10.0.0.2", "port": 7471, "private_data": "68656c6c6f"},
}


def refused(schema: type[BaseModel], data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        schema.model_validate(data)
    return str(info.value.errors()[0]["type"])


def test_every_op_has_a_strict_closed_schema_and_a_valid_example_here() -> None:
    assert set(OPS) == set(VALID)
    for schema in OPS.values():
        assert issubclass(schema, Args)
        assert schema.model_config.get("extra") == "forbid"
        assert schema.model_config.get("strict") is True


@pytest.mark.parametrize("op", sorted(VALID))
def test_valid_arguments_are_accepted_unchanged(op: str) -> None:
    parsed = OPS[op].model_validate(VALID[op])
    assert parsed.model_dump(include=set(VALID[op])) == VALID[op]


@pytest.mark.parametrize("op", sorted(VALID))
def test_extra_fields_are_refused(op: str) -> None:
    assert refused(OPS[op], {**VALID[op], "phys_addr": 0xDEAD}) == "extra_forbidden"


REQUIRED = {op: [name for name, field in schema.model_fields.items() if field.is_required()]
            for op, schema in OPS.items()}


def test_required_fields() -> None:
    assert REQUIRED["reg_mr"] == ["pd", "addr", "length", "access"]
    assert REQUIRED["query_port"] == REQUIRED["alloc_pd"] == []
    assert "attach" not in OPS  # attach is the channel's first message, checked with Attach
    assert [n for n, f in Attach.model_fields.items() if f.is_required()] == ["token"]
    # Rings are the shared-ring engine's (its session refuses a QP or CQ without them); direct has the NIC's.
    assert set(REQUIRED["create_qp"]) == {"pd", "send_cq", "recv_cq", "max_send_wr", "max_recv_wr"}
    assert REQUIRED["create_cq"] == ["cqe"]


@pytest.mark.parametrize("op", sorted(op for op, names in REQUIRED.items() if names))
def test_missing_required_fields_are_refused(op: str) -> None:
    schema = OPS[op]
    for name in REQUIRED[op]:
        args = {k: v for k, v in VALID[op].items() if k != name}
        assert refused(schema, args) == "missing"


# Every integer field of every schema refuses strings, floats and booleans (strict: no coercion).
INT_FIELDS = sorted(
    (op, name) for op, schema in OPS.items() for name, field in schema.model_fields.items()
    if field.annotation in (int, int | None)
)


@pytest.mark.parametrize(("op", "field"), INT_FIELDS)
@pytest.mark.parametrize("bad", ["1", 1.0, True, None, [1]])
def test_int_fields_are_strict(op: str, field: str, bad: object) -> None:
    schema = OPS[op]
    if bad is None and schema.model_fields[field].annotation == int | None:
        # None is the documented "not given" of optional fields
        assert getattr(schema.model_validate({**VALID[op], field: None}), field) is None
        return
    with pytest.raises(ValidationError):
        schema.model_validate({**VALID[op], field: bad})


def test_int_fields_found() -> None:
    assert ("reg_mr", "length") in INT_FIELDS
    assert ("modify_qp", "remote_qpn") in INT_FIELDS
    assert len(INT_FIELDS) >= 30


@pytest.mark.parametrize(("schema", "base", "field", "good", "bad"), [
    (QueryPort, {}, "port", [1, 255], [0, 256, -1]),
    (QueryGid, {}, "index", [0, 255], [-1, 256]),
    (RegMr, VALID["reg_mr"], "addr", [0, 1 << 40], [-1]),
    (RegMr, VALID["reg_mr"], "length", [1], [0, -4096]),
    (RegMr, VALID["reg_mr"], "access", [0, 15], [-1, 16]),
    (CreateCq, VALID["create_cq"], "cqe", [1], [0, -1]),
    (CreateCq, VALID["create_cq"], "ring", [0], [-64]),
    (CreateQp, VALID["create_qp"], "max_send_wr", [1], [0]),
    (CreateQp, VALID["create_qp"], "max_recv_wr", [1], [0]),
    (CreateQp, VALID["create_qp"], "max_sge", [1, 4], [0, 5]),
    (CreateQp, VALID["create_qp"], "sq_ring", [0], [-1]),
    (ModifyQp, VALID["modify_qp"], "qkey", [0, (1 << 32) - 1], [-1, 1 << 32]),
    (ModifyQp, VALID["modify_qp"], "remote_qpn", [0, (1 << 24) - 1], [-1, 1 << 24]),
    (ModifyQp, VALID["modify_qp"], "rq_psn", [0, (1 << 24) - 1], [1 << 24]),
    (ModifyQp, VALID["modify_qp"], "sq_psn", [0, (1 << 24) - 1], [1 << 24]),
    (ModifyQp, VALID["modify_qp"], "max_rd_atomic", [0, 16], [17]),
    (ModifyQp, VALID["modify_qp"], "max_dest_rd_atomic", [0, 16], [-1, 17]),
    (ModifyQp, VALID["modify_qp"], "min_rnr_timer", [0, 31], [32]),
    (ModifyQp, VALID["modify_qp"], "timeout", [0, 31], [32]),
    (ModifyQp, VALID["modify_qp"], "retry_cnt", [0, 7], [8]),
    (ModifyQp, VALID["modify_qp"], "rnr_retry", [0, 7], [8]),
    (ModifyQp, VALID["modify_qp"], "path_mtu", [256, 4096], [128, 1500, 8192]),
    (Connect, VALID["connect"], "remote_qpn", [0, (1 << 24) - 1], [-1, 1 << 24]),
    (Connect, VALID["connect"], "access", [0, 15], [16]),
])
def test_bounds(schema: type[BaseModel], base: dict[str, Any], field: str, good: list[int], bad: list[int]) -> None:
    for value in good:
        assert getattr(schema.model_validate({**base, field: value}), field) == value
    for value in bad:
        assert refused(schema, {**base, field: value}) in ("greater_than_equal", "greater_than", "less_than_equal",
                                                           "less_than", "literal_error")


def test_defaults() -> None:
    qp = CreateQp.model_validate(VALID["create_qp"])
    assert (qp.qp_type, qp.max_sge) == ("rc", 1)
    modify = ModifyQp.model_validate(VALID["modify_qp"])
    assert (modify.access, modify.qkey, modify.path_mtu, modify.remote_gid, modify.remote_qpn) == \
        (7, 0x11111111, 1024, None, None)
    assert Attach.model_validate({"token": "t"}).busy_poll is False
    assert QueryPort.model_validate({}).port == 1


@pytest.mark.parametrize(("schema", "base", "field", "bad"), [
    (CreateQp, VALID["create_qp"], "qp_type", "uc"),
    (CreateQp, VALID["create_qp"], "qp_type", "RC"),
    (ModifyQp, VALID["modify_qp"], "state", "sqd"),
    (ModifyQp, VALID["modify_qp"], "state", 1),
    (ModifyQp, VALID["modify_qp"], "path_mtu", "1024"),
    (ModifyQp, VALID["modify_qp"], "remote_gid", "f" * 65),
    (ModifyQp, VALID["modify_qp"], "remote_gid", 5),
    (Connect, VALID["connect"], "remote_gid", "f" * 65),
    (Attach, {"token": "t"}, "token", "x" * 257),
    (Attach, {"token": "t"}, "token", 123),
    (Attach, {"token": "t"}, "busy_poll", 1),
    (Attach, {"token": "t"}, "busy_poll", "true"),
    (BusyPoll, {}, "enabled", 0),
    (BusyPoll, {}, "enabled", None),
])
def test_wrong_types_and_values_are_refused(schema: type[BaseModel], base: dict[str, Any], field: str,
                                            bad: object) -> None:
    with pytest.raises(ValidationError):
        schema.model_validate({**base, field: bad})


def test_every_qp_state_and_type_is_accepted() -> None:
    for state in ("init", "rtr", "rts", "err", "reset"):
        assert ModifyQp.model_validate({"qp": 1, "state": state}).state == state
    for qp_type in ("rc", "ud"):
        assert CreateQp.model_validate({**VALID["create_qp"], "qp_type": qp_type}).qp_type == qp_type


def test_private_data_is_hex_and_capped_as_rdma_cm_caps_it_on_rc() -> None:
    connect, accept = OPS["cm_connect"], OPS["cm_accept"]
    assert connect.model_validate({**VALID["cm_connect"], "private_data": "ab" * 56})
    assert refused(connect, {**VALID["cm_connect"], "private_data": "ab" * 57}) == "string_too_long"
    assert accept.model_validate({**VALID["cm_accept"], "private_data": "ab" * 196})
    assert refused(accept, {**VALID["cm_accept"], "private_data": "ab" * 197}) == "string_too_long"
    for bad in ("zz", "abc", "AB"):  # lower-case hex, whole bytes
        assert refused(connect, {**VALID["cm_connect"], "private_data": bad}) == "string_pattern_mismatch"
    assert refused(OPS["cm_get_request"], {"port": 1, "timeout_ms": 5001}) == "less_than_equal"
    assert refused(OPS["cm_listen"], {"port": 0}) == "greater_than_equal"
