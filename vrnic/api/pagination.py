"""The one pagination of every list: items keyed by an ascending integer, cursor = the last key shown."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import InstrumentedAttribute

from vrnic.api.schemas import Page
from vrnic.errors import InvalidArgument

MAX_PAGE = 500
_MAX_KEY = 1 << 63

Row = TypeVar("Row")
Query = TypeVar("Query", bound=Select[Any])
Item = TypeVar("Item")


@dataclass(frozen=True)
class PageRequest:
    """What a client asked for: items after key `after` (None: from the start), at most `limit`."""

    after: int | None
    limit: int

    @classmethod
    def parse(cls, cursor: str | None, limit: int) -> PageRequest:
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidArgument(f"limit must be 1..{MAX_PAGE}")
        if cursor is None:
            return cls(None, limit)
        if not (cursor.isascii() and cursor.isdigit() and int(cursor) < _MAX_KEY):
            raise InvalidArgument(f"bad cursor {cursor!r}: pass back a next_cursor")
        return cls(int(cursor), limit)

    def window(self, query: Query, key: InstrumentedAttribute[int]) -> Query:
        """query narrowed to this page (one row more than the limit, to tell whether another page follows)."""
        if self.after is not None:
            query = query.where(key > self.after)
        windowed: Query = query.order_by(key).limit(self.limit + 1)
        return windowed

    def page(self, rows: Iterable[Row], key: Callable[[Row], int], convert: Callable[[Row], Item]) -> Page[Item]:
        """The page of rows (ascending by key; a window() or an in-memory list); only its items are converted."""
        shown: list[Row] = []
        more = False
        for row in rows:
            if self.after is not None and key(row) <= self.after:
                continue
            if len(shown) == self.limit:
                more = True
                break
            shown.append(row)
        next_cursor = str(key(shown[-1])) if more else None
        return Page[Item](items=[convert(r) for r in shown], next_cursor=next_cursor)

