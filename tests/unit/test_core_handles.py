"""Opaque per-vRNIC handle tables (vrnic.core.handles)."""

from __future__ import annotations

import os
import threading

import pytest

from vrnic.core.handles import HandleTable, random_word, random_words
from vrnic.errors import InvalidArgument, NotFound


def test_add_get_contains_len() -> None:
    table: HandleTable[str] = HandleTable("pd")
    a, b = table.add("a"), table.add("b")
    assert a != b
    assert table.get(a) == "a" and table.get(b) == "b"
    assert a in table and b in table
    assert len(table) == 2
    assert sorted(table.items()) == sorted([(a, "a"), (b, "b")])


def test_handles_are_positive_and_fit_63_bits() -> None:
    table: HandleTable[int] = HandleTable("mr")
    handles = [table.add(i) for i in range(200)]
    assert all(0 < h < 1 << 63 for h in handles)
    assert len(set(handles)) == 200
    assert len(table) == 200
    assert [table.get(h) for h in handles] == list(range(200))


def test_a_tiny_handle_space_still_gives_unique_nonzero_handles() -> None:
    table: HandleTable[str] = HandleTable("cq", bits=2)  # only 1, 2, 3 exist
    handles = {table.add("x") for _ in range(3)}
    assert handles == {1, 2, 3}


def test_forged_handle_is_not_found() -> None:
    table: HandleTable[str] = HandleTable("qp")
    table.add("mine")
    with pytest.raises(NotFound, match="unknown qp handle 12345"):
        table.get(12345)


def test_a_handle_of_another_table_is_not_found_there() -> None:
    mine: HandleTable[str] = HandleTable("pd")
    theirs: HandleTable[str] = HandleTable("pd")
    foreign = theirs.add("secret")
    mine.add("mine")
    if foreign not in mine:  # 2^-63 chance of a collision
        with pytest.raises(NotFound):
            mine.get(foreign)
        with pytest.raises(NotFound):
            mine.pop(foreign)
    assert theirs.get(foreign) == "secret"


@pytest.mark.parametrize("bad", [True, False, "1", 1.0, None, [1], b"\x01"])
def test_a_handle_that_is_not_an_int_is_invalid(bad: object) -> None:
    table: HandleTable[str] = HandleTable("mr")
    with pytest.raises(InvalidArgument, match="mr handle must be an integer"):
        table.get(bad)
    with pytest.raises(InvalidArgument):
        table.pop(bad)


def test_bool_is_refused_even_when_handle_1_exists() -> None:
    table: HandleTable[str] = HandleTable("pd", bits=1)  # the only handle is 1
    assert table.add("x") == 1
    with pytest.raises(InvalidArgument):
        table.get(True)
    assert True not in table
    assert 1 in table


def test_pop_removes_exactly_one() -> None:
    table: HandleTable[str] = HandleTable("cq")
    a, b = table.add("a"), table.add("b")
    assert table.pop(a) == "a"
    assert a not in table
    assert len(table) == 1
    assert table.get(b) == "b"
    with pytest.raises(NotFound):
        table.get(a)
    with pytest.raises(NotFound):  # a second destroy of the same handle
        table.pop(a)


def test_negative_and_huge_ints_are_just_unknown() -> None:
    table: HandleTable[str] = HandleTable("qp")
    for handle in (0, -1, 1 << 64):
        with pytest.raises(NotFound):
            table.get(handle)


def test_items_is_a_snapshot() -> None:
    table: HandleTable[str] = HandleTable("pd")
    a = table.add("a")
    snapshot = table.items()
    table.pop(a)
    assert list(snapshot) == [(a, "a")]
    assert list(table.items()) == []


def test_racing_destroys_of_one_handle_give_one_object_and_not_found() -> None:
    table: HandleTable[int] = HandleTable("mr")
    handles = [table.add(i) for i in range(2000)]
    results: list[str] = []
    lock = threading.Lock()

    def destroy_all() -> None:
        for handle in handles:
            try:
                table.pop(handle)
                outcome = "ok"
            except NotFound:
                outcome = "not_found"
            except Exception as exc:  # noqa: BLE001 - what we are checking for
                outcome = type(exc).__name__
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=destroy_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 2000
    assert results.count("not_found") == 6000
    assert len(table) == 0


def test_handles_spread_over_the_whole_space_and_its_size_is_checked() -> None:
    """Random words are read in blocks; each handle still takes all of its bits from one of them."""
    table: HandleTable[int] = HandleTable("qp")
    handles = [table.add(i) for i in range(300)]  # more than one block
    assert 100 < sum(h >> 62 for h in handles) < 200  # the top bit set in about half
    assert 100 < sum(h & 1 for h in handles) < 200  # and the bottom one
    for bits in (0, 65):
        with pytest.raises(InvalidArgument, match="1 to 64 bits"):
            HandleTable("qp", bits=bits)
    assert 0 < HandleTable[int]("wide", bits=64).add(1) < 1 << 64


def test_a_forked_child_does_not_repeat_its_parents_random_words() -> None:
    random_word()  # the parent now holds a block of words
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next word, to the parent
        try:
            os.write(write, random_word().to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(write)
    child = int.from_bytes(os.read(read, 8), "little")
    os.close(read)
    os.waitpid(pid, 0)
    assert child != random_word()  # the parent's next word, which the child would have repeated


def test_a_batch_of_handles_is_added_and_popped_at_once() -> None:
    table: HandleTable[int] = HandleTable("mr", bits=8)  # a small space: draws collide and are drawn again
    first = table.add_many(list(range(100)))
    assert len(set(first)) == 100 and all(0 < h < 256 for h in first)
    assert [table.get(h) for h in first] == list(range(100))
    more = table.add_many([7, 8])
    assert not set(more) & set(first) and len(table) == 102
    assert table.add_many([]) == []
    with pytest.raises(NotFound):
        table.pop_many([first[0], 999])  # unknown: nothing is taken
    with pytest.raises(NotFound):
        table.pop_many([first[0], first[0]])
    with pytest.raises(InvalidArgument):
        table.pop_many([first[0], "1"])  # type: ignore[list-item]
    assert len(table) == 102
    assert table.pop_many(first[:3]) == [0, 1, 2] and len(table) == 99 and first[0] not in table


def test_random_words_come_in_batches_of_any_size() -> None:
    assert random_words(0) == []
    words = random_words(300)  # more than one block
    assert len(words) == 300 and len(set(words)) == 300 and all(0 <= w < 1 << 64 for w in words)
