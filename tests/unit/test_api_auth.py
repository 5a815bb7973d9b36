"""Tokens and the principal cache."""

from __future__ import annotations

import time

import pytest

from vrnic.api.auth import (
    OPERATOR,
    Principal,
    Role,
    TokenCache,
    hash_token,
    is_operator_token,
    new_tenant_token,
)
from vrnic.errors import PermissionDenied


def test_tenant_tokens_are_random_prefixed_and_hashed() -> None:
    a, b = new_tenant_token(), new_tenant_token()
    assert a != b and a.startswith("vrt_") and len(a) > 40
    assert hash_token(a) == hash_token(a) != hash_token(b)
    assert len(hash_token(a)) == 64 and a not in hash_token(a)


def test_operator_token_comparison() -> None:
    assert is_operator_token("vro_x", "vro_x")
    assert not is_operator_token("vro_y", "vro_x")
    assert not is_operator_token("", "vro_x")


def test_principals() -> None:
    assert OPERATOR.is_operator and OPERATOR.actor == "operator" and OPERATOR.role is Role.OPERATOR
    OPERATOR.require_operator()
    acme = Principal.tenant(3, "acme")
    assert not acme.is_operator and acme.actor == "tenant:acme" and acme.role is Role.TENANT
    with pytest.raises(PermissionDenied, match="only the operator"):
        acme.require_operator()


def test_nobody_is_the_operator_by_omission() -> None:
    with pytest.raises(TypeError):
        Principal()  # type: ignore[call-arg]
    for half_made in (lambda: Principal(Role.TENANT), lambda: Principal(Role.TENANT, tenant_id=3),
                      lambda: Principal(Role.OPERATOR, 3, "acme")):
        with pytest.raises(ValueError, match="a tenant principal has a tenant id and name"):
            half_made()


def test_token_cache_expires_and_forgets_a_tenant() -> None:
    cache = TokenCache(ttl=0.05)
    acme, other = Principal.tenant(1, "acme"), Principal.tenant(2, "other")
    cache.put("h1", acme)
    cache.put("h2", other)
    assert cache.get("h1") == acme and cache.get("nope") is None
    cache.forget_tenant(1)
    assert cache.get("h1") is None and cache.get("h2") == other
    time.sleep(0.06)
    assert cache.get("h2") is None
