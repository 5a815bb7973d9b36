"""The one pagination helper (vrnic.api.pagination): cursors, limits and windows, in memory and in SQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from vrnic.api.pagination import MAX_PAGE, PageRequest
from vrnic.db.tables import Event
from vrnic.errors import InvalidArgument


def test_pages_follow_the_cursor_until_the_last() -> None:
    items = [(k, f"item{k}") for k in (1, 2, 5, 8, 9)]
    seen, cursor = [], None
    while True:
        page = PageRequest.parse(cursor, 2).page(items, lambda i: i[0], lambda i: i[1])
        seen.append(page.items)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == [["item1", "item2"], ["item5", "item8"], ["item9"]]


def test_an_exactly_full_last_page_has_no_next_cursor() -> None:
    page = PageRequest.parse(None, 3).page([0, 1, 2], lambda k: k, str)
    assert (page.items, page.next_cursor) == (["0", "1", "2"], None)
    assert PageRequest.parse("2", 3).page([0, 1, 2], lambda k: k, str).items == []


def test_only_the_shown_items_are_converted() -> None:
    converted: list[int] = []
    page = PageRequest.parse("0", 2).page(range(100), lambda k: k, lambda k: converted.append(k) or k)
    assert page.items == [1, 2] and page.next_cursor == "2" and converted == [1, 2]


@pytest.mark.parametrize(("cursor", "limit"), [("x", 5), ("-1", 5), ("1.5", 5), (str(1 << 63), 5), ("٣", 5),
                                               (None, 0), (None, MAX_PAGE + 1)])
def test_bad_cursors_and_limits_are_invalid_arguments(cursor: str | None, limit: int) -> None:
    with pytest.raises(InvalidArgument):
        PageRequest.parse(cursor, limit)


def test_the_sql_window_asks_for_one_row_more_after_the_cursor() -> None:
    window = PageRequest.parse("7", 10).window(select(Event), Event.id)
    sql = str(window.compile(compile_kwargs={"literal_binds": True}))
    assert "WHERE events.id > 7" in sql and "ORDER BY events.id" in sql and "LIMIT 11" in sql
    first = str(PageRequest.parse(None, 10).window(select(Event), Event.id))
    assert "WHERE" not in first
