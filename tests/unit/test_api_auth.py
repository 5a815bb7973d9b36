"""Tokens and the principal cache."""

from __future__ import annotations

import time

from vrnic.api.auth import OPERATOR, Principal, TokenCache, hash_token, is_operator_token, new_tenant_token


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
    assert OPERATOR.is_operator and OPERATOR.actor == "operator"
    acme = Principal(tenant_id=3, tenant_name="acme")
    assert not acme.is_operator and acme.actor == "tenant:acme"


def test_token_cache_expires_and_forgets_a_tenant() -> None:
    cache = TokenCache(ttl=0.05)
    acme, other = Principal(1, "acme"), Principal(2, "other")
    cache.put("h1", acme)
    cache.put("h2", other)
    assert cache.get("h1") == acme and cache.get("nope") is None
    cache.forget_tenant(1)
    assert cache.get("h1") is None and cache.get("h2") == other
    time.sleep(0.06)
    assert cache.get("h2") is None
