"""vrnic.lab.migration_rig's pure checks: what a migrated VM's traffic got wrong."""

from __future__ import annotations

from vrnic.lab.migration_rig import stream_problems


def _done(writes: list[int], sends: list[int], errors: list[str] | None = None) -> dict[str, object]:
    return {"writes": writes, "sends": sends, "errors": errors or []}


def test_nothing_is_wrong_when_every_write_is_in_ram_and_every_send_arrived_in_order() -> None:
    assert stream_problems(_done([1, 2, 3, 4], [4]), {"seqs": [4], "errors": []}, [0, 1, 2, 3, 4]) == []


def test_each_kind_of_loss_is_named() -> None:
    found = stream_problems(_done([1, 2, 4], [4, 8], ["WR_FLUSH_ERR"]), {"seqs": [8], "errors": ["RNR"]},
                            [0, 1, 0, 3, 4])
    assert found == [
        "the peer's traffic failed: ['WR_FLUSH_ERR']",
        "the peer's completed writes are not 1..n",
        "SENDs: sent 2, received 1, errors ['RNR']",
        "1 completed writes are not in the VM's RAM as its program reads it: [2]",
    ]


def test_a_doubled_send_and_a_short_slot_read_count_as_losses() -> None:
    found = stream_problems(_done([1, 2, 3], [4]), {"seqs": [4, 4], "errors": []}, [0, 1, 2])
    assert found == ["SENDs: sent 1, received 2, errors []",
                     "1 completed writes are not in the VM's RAM as its program reads it: [3]"]
