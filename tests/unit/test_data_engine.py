"""A vRNIC's data-path engine: the one rule (direct is for paravirtual vRNICs) as the spec, the REST request and
standalone vrnicd's --vrnic apply it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vrnic.api.schemas import VrnicCreate
from vrnic.backend.vrnicd import parse_vrnic
from vrnic.core.specs import DataEngine, Quota, VrnicMode, VrnicSpec, check_engine
from vrnic.errors import InvalidArgument


def test_the_direct_engine_is_for_paravirtual_vrnics_only() -> None:
    check_engine(VrnicMode.PARAVIRTUAL, DataEngine.DIRECT)
    check_engine(VrnicMode.SRIOV, DataEngine.RING)
    with pytest.raises(ValueError, match="the direct engine is for paravirtual vRNICs"):
        check_engine(VrnicMode.SRIOV, DataEngine.DIRECT)
    assert VrnicSpec(id="v", tenant="t", virtual_gid="fe80::1").engine is DataEngine.RING
    # the spec and the REST request apply the same rule
    for model, fields in ((VrnicSpec, {"id": "v", "tenant": "t", "virtual_gid": "fe80::1"}), (VrnicCreate, {})):
        assert model.model_validate({**fields, "engine": "direct"}).engine is DataEngine.DIRECT
        with pytest.raises(ValidationError, match="the direct engine is for paravirtual vRNICs"):
            model.model_validate({**fields, "mode": "sriov", "engine": "direct"})
    assert VrnicCreate().engine is DataEngine.RING


def test_standalone_vrnicd_takes_an_engine_per_vrnic() -> None:
    spec, device = parse_vrnic("a:t:rxe0", 1, Quota())
    assert (spec.id, spec.tenant, spec.vpc_id, spec.engine, device) == ("a", "t", 0, DataEngine.RING, "rxe0")
    spec, device = parse_vrnic("b:t:rxe1:7:direct", 2, Quota())
    assert (spec.vpc_id, spec.engine, device) == (7, DataEngine.DIRECT, "rxe1")
    assert parse_vrnic("c:t:rxe1:7:ring", 3, Quota())[0].engine is DataEngine.RING
    for bad in ("a:t:rxe0:7:turbo", "a:t:rxe0:7:direct:x", "a:t:rxe0:7:", "a:t"):
        with pytest.raises(InvalidArgument, match=r"ID:TENANT:DEVICE\[:VPC\[:ENGINE\]\]"):
            parse_vrnic(bad, 1, Quota())
