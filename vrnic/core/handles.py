"""Opaque per-vRNIC handles: a guest can only name objects in its own table.

Handles are random 63-bit numbers, so a forged or foreign handle is simply not
found (it names nothing here) and reveals nothing about other vRNICs.
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

from vrnic.errors import InvalidArgument, NotFound

T = TypeVar("T")

_DRAW = 64  # handles' worth of randomness read at once: one getrandom(2) per 64 new objects, not one each


class _RandomWords:
    """64-bit random words from the OS's CSPRNG, read in blocks (a batch of 64 QPs drew 64 times; issue 14)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._words: list[int] = []
        # A forked child must not hand out the words its parent holds (the same "random" names twice)
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._words = []

    def next(self) -> int:
        with self._lock:
            if not self._words:
                self._words = list(struct.unpack(f"<{_DRAW}Q", secrets.token_bytes(8 * _DRAW)))
            return self._words.pop()

    def take(self, count: int) -> list[int]:
        """count words at once (a batch's objects)."""
        with self._lock:
            if len(self._words) < count:
                fresh = max(_DRAW, count - len(self._words))
                self._words += struct.unpack(f"<{fresh}Q", secrets.token_bytes(8 * fresh))
            taken = self._words[-count:] if count else []
            del self._words[len(self._words) - count:]
            return taken


_random_words = _RandomWords()


def random_word() -> int:
    """64 random bits (CSPRNG), for names a guest must not guess: handles, virtual memory keys."""
    return _random_words.next()


def random_words(count: int) -> list[int]:
    """count words of random_word's kind at once."""
    return _random_words.take(count)


class HandleTable(Generic[T]):
    def __init__(self, kind: str, bits: int = 63) -> None:
        if not 1 <= bits <= 64:
            raise InvalidArgument(f"handles have 1 to 64 bits, not {bits}")
        self.kind = kind
        self._bits = bits
        self._objects: dict[int, T] = {}
        self._lock = threading.Lock()

    def add(self, obj: T) -> int:
        with self._lock:
            while True:
                handle = random_word() >> (64 - self._bits) or 1
                if handle not in self._objects:
                    self._objects[handle] = obj
                    return handle

    def add_many(self, objs: list[T]) -> list[int]:
        """add() of each, under one lock and one draw of randomness (a batch's objects)."""
        shift = 64 - self._bits
        with self._lock:
            handles: list[int] = []
            while len(handles) < len(objs):
                for word in random_words(len(objs) - len(handles)):
                    handle = word >> shift or 1
                    if handle not in self._objects:
                        self._objects[handle] = objs[len(handles)]
                        handles.append(handle)
            return handles

    def put(self, handle: int, obj: T) -> None:
        """Insert under a known handle (a session restored from a snapshot keeps its guest's handles)."""
        if handle <= 0 or handle >= 1 << self._bits:
            raise InvalidArgument(f"{self.kind} handle {handle} is out of range")
        with self._lock:
            if handle in self._objects:
                raise InvalidArgument(f"{self.kind} handle {handle} is already in use")
            self._objects[handle] = obj

    def get(self, handle: object) -> T:
        if not isinstance(handle, int) or isinstance(handle, bool):
            raise InvalidArgument(f"{self.kind} handle must be an integer, not {type(handle).__name__}")
        try:
            return self._objects[handle]
        except KeyError:
            raise NotFound(f"unknown {self.kind} handle {handle}") from None

    def pop(self, handle: object) -> T:
        self.get(handle)  # type check and NotFound
        with self._lock:
            # Removed under the lock: of two racing destroys, the second gets NotFound, not a KeyError.
            if handle not in self._objects:
                raise NotFound(f"unknown {self.kind} handle {handle}")
            return self._objects.pop(handle)

    def pop_many(self, handles: list[int]) -> list[T]:
        """pop() of each, all or none: every handle is known (and named once) or nothing is taken."""
        for handle in handles:
            self.get(handle)  # type check and NotFound
        with self._lock:
            if len(set(handles)) != len(handles) or any(h not in self._objects for h in handles):
                raise NotFound(f"unknown or repeated {self.kind} handle among {len(handles)}")
            return [self._objects.pop(handle) for handle in handles]

    def __contains__(self, handle: object) -> bool:
        # True == 1: a bool names no handle here, as in get().
        return isinstance(handle, int) and not isinstance(handle, bool) and handle in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def items(self) -> Iterator[tuple[int, T]]:
        with self._lock:
            return iter(list(self._objects.items()))
