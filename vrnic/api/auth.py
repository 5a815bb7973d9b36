"""Bearer tokens: the operator's from configuration, tenants' stored as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass

TENANT_TOKEN_PREFIX = "vrt_"
_CACHE_SECONDS = 30.0  # other processes' revocations (PostgreSQL, several API servers) take this long


@dataclass(frozen=True)
class Principal:
    """Who is calling: the operator, or one tenant."""

    tenant_id: int | None = None
    tenant_name: str | None = None

    @property
    def is_operator(self) -> bool:
        return self.tenant_id is None

    @property
    def actor(self) -> str:
        return "operator" if self.is_operator else f"tenant:{self.tenant_name}"


OPERATOR = Principal()


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
