"""Bearer tokens: the operator's from configuration, tenants' stored as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from enum import StrEnum

from vrnic.errors import PermissionDenied

TENANT_TOKEN_PREFIX = "vrt_"
_CACHE_SECONDS = 30.0  # other processes' revocations (PostgreSQL, several API servers) take this long


class Role(StrEnum):
    OPERATOR = "operator"
    TENANT = "tenant"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the operator (OPERATOR), or one tenant (Principal.tenant). The role is always
    explicit: nobody is the operator by omission."""

    role: Role
    tenant_id: int | None = None
    tenant_name: str | None = None

    def __post_init__(self) -> None:
        if (self.role is Role.TENANT) != (self.tenant_id is not None and self.tenant_name is not None):
            raise ValueError("a tenant principal has a tenant id and name, the operator neither")

    @classmethod
    def tenant(cls, tenant_id: int, tenant_name: str) -> Principal:
        return cls(Role.TENANT, tenant_id, tenant_name)

    @property
    def is_operator(self) -> bool:
        return self.role is Role.OPERATOR

    @property
    def actor(self) -> str:
        return "operator" if self.is_operator else f"tenant:{self.tenant_name}"

    def require_operator(self) -> None:
        if not self.is_operator:
            raise PermissionDenied("only the operator may do this")


OPERATOR = Principal(Role.OPERATOR)


def new_tenant_token() -> str:
    return TENANT_TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    # Tokens carry 256 random bits, so a fast hash is enough: nothing to brute-force.
    return hashlib.sha256(token.encode()).hexdigest()


def is_operator_token(token: str, operator_token: str) -> bool:
    return secrets.compare_digest(token.encode(), operator_token.encode())


class TokenCache:
    """token hash -> tenant Principal, so each request does not read the token table."""

    def __init__(self, ttl: float = _CACHE_SECONDS) -> None:
        self._ttl = ttl
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, token_hash: str) -> Principal | None:
        with self._lock:
            entry = self._entries.get(token_hash)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, token_hash: str, principal: Principal) -> None:
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[token_hash] = (time.monotonic() + self._ttl, principal)

    def forget_tenant(self, tenant_id: int) -> None:
        with self._lock:
            for key in [k for k, (_, p) in self._entries.items() if p.tenant_id == tenant_id]:
                del self._entries[key]
