"""Bench records: how `met` reads each kind of target (the table and bench/results JSON show it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.harness import Record, alternating, load, loops_in_turns, median_ms, samples_ms, write


def test_within_is_a_tolerance_on_both_sides_of_one() -> None:
    def cap(achieved: float) -> Record:
        return Record("qos.cap_accuracy", "ratio", achieved, 1.0, target=0.10, better="within")

    assert cap(1.0).met and cap(0.91).met and cap(1.09).met
    assert cap(0.5).met is False and cap(0.89).met is False and cap(1.11).met is False
    assert cap(1.0).target_text == "1±0.1x"


def test_a_count_that_must_stay_zero_is_judged_on_its_value() -> None:
    assert Record("recovery.disagreements_found", "count", 0, at_most=0).met is True
    assert Record("recovery.disagreements_found", "count", 2, at_most=0).met is False
    assert Record("recovery.kills", "kills", 50).met is None


def test_ratio_targets_and_round_trip_through_json(tmp_path: Path) -> None:
    lower = Record("paravirt.create_cq", "ms", 6.0, 2.0, target=3.0)
    higher = Record("qos.jain_index", "index", 0.9, 1.0, target=0.95, better="higher")
    assert lower.met is True and higher.met is False
    path = tmp_path / "r.json"
    write([lower, higher], path)
    assert load(path) == [lower, higher]
    assert json.loads(path.read_text())[0]["ratio"] == 3.0


def test_samples_time_each_call_and_leave_its_cleanup_out() -> None:
    import time

    cleaned = []

    def operation():  # type: ignore[no-untyped-def]
        return lambda: (time.sleep(0.1), cleaned.append(1))

    samples = samples_ms(operation, repeat=5)
    assert len(samples) == 5 and len(cleaned) == 5
    assert max(samples) < 90  # the 100 ms cleanup is not in any sample
    assert median_ms(lambda: None, repeat=3) >= 0


def test_the_bare_round_trip_is_a_real_echo_through_another_process() -> None:
    from bench.paravirt import bare_round_trip_ms

    assert 0 < bare_round_trip_ms(20) < 1000


def test_the_codec_is_timed_in_a_loop_and_between_round_trips_with_a_child_that_decodes_too() -> None:
    """The platform's record under null_rpc needs no RDMA: the child imports the same codec work and does it
    per message (a child that could not would end the echo, and the bench would say so); nothing stays open."""
    import os

    from bench.paravirt import codec_in_and_out_of_a_round_trip

    before = set(os.listdir("/proc/self/fd"))
    loop, between = codec_in_and_out_of_a_round_trip(10)
    assert (loop.name, between.name) == ("paravirt.codec_loop", "paravirt.codec_between_round_trips")
    assert loop.value > 0 and between.value > 0 and between.baseline == loop.value and loop.baseline is None
    assert set(os.listdir("/proc/self/fd")) <= before


def test_an_absolute_target_bounds_the_value_from_below_above_or_both(tmp_path: Path) -> None:
    rate = Record("cp.rest.allocate.c1.throughput", "ops/s", 740.0, baseline=80000.0, better="higher",
                  at_least=1000.0)
    assert rate.met is False and rate.target_text == ">=1000"  # the bound decides, not the ratio to the baseline
    assert Record("r", "ops/s", 1000.0, at_least=1000.0).met is True
    assert Record("p99", "ms", 3.0, at_most=10.0).met is True
    band = Record("b", "ms", 5.0, at_least=1.0, at_most=4.0)
    assert band.met is False and band.target_text == ">=1 <=4"
    path = tmp_path / "r.json"
    write([rate], path)
    assert load(path) == [rate]


def test_alternating_takes_one_sample_of_each_per_round_and_swaps_who_goes_first() -> None:
    calls: list[str] = []

    def measure(name: str, value: float):  # type: ignore[no-untyped-def]
        return lambda: (calls.append(name), value)[1]

    firsts, seconds = alternating(measure("native", 1.0), measure("mediated", 2.0), rounds=4)
    assert firsts == [1.0] * 4 and seconds == [2.0] * 4
    assert calls == ["native", "mediated", "mediated", "native", "native", "mediated", "mediated", "native"]


def test_loops_in_turns_runs_one_loop_of_each_per_round_and_keeps_every_sample() -> None:
    calls: list[str] = []

    def loop(name: str, values: list[float]):  # type: ignore[no-untyped-def]
        return lambda: (calls.append(name), list(values))[1]

    natives, mediated = loops_in_turns(loop("native", [1.0, 1.5]), loop("mediated", [2.0, 3.0, 4.0]), rounds=3)
    assert natives == [1.0, 1.5] * 3 and mediated == [2.0, 3.0, 4.0] * 3
    assert calls == ["native", "mediated", "mediated", "native", "native", "mediated"]


def test_the_bare_attach_floor_runs_anywhere_and_leaves_nothing_behind() -> None:
    """bench.paravirt's floor under open_device needs no RDMA: its child answers each attach, mapping the arena it
    was sent, and ends when asked; no descriptor of the samples stays open here."""
    import os

    from bench.paravirt import bare_attach_ms

    before = set(os.listdir("/proc/self/fd"))
    samples = bare_attach_ms(5)
    assert len(samples) == 5 and all(sample > 0 for sample in samples)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_the_derived_floors_add_one_round_trip_of_framing_per_request() -> None:
    from bench.mediation_floor import with_framing

    mediated = [Record("paravirt.null_rpc", "ms", 0.35, 0.08), Record("paravirt.bare_rpc", "ms", 0.07, 0.08)]
    floors = [Record("paravirt.bare_reg_mr_1m", "ms", 0.40, 0.10),
              Record("paravirt.bare_connect_qp_pair", "ms", 2.0, 1.6),
              Record("paravirt.bare_setup_64_qp_pairs", "ms", 90.0, 100.0),
              Record("paravirt.bare_reg_mr_4k.mean", "ms", 0.20, 0.08),
              Record("paravirt.bare_create_qp.mean", "ms", 0.60, 0.30)]
    derived = {r.name: r for r in with_framing(floors, mediated)}
    # a loop of 50 small MRs sends three reg_mrs (refills of 4, 16 and 32): three round trips' framing over 50
    assert derived["paravirt.floor_reg_mr_4k.mean"].value == pytest.approx(0.20 + 3 * 0.28 / 50)
    assert derived["paravirt.floor_create_qp.mean"].value == pytest.approx(0.60 + 4 * 0.28 / 50)  # so do QPs'
    assert derived["paravirt.floor_reg_mr_1m"].value == pytest.approx(0.40 + 0.28)
    assert derived["paravirt.floor_connect_qp_pair"].value == pytest.approx(2.0 + 2 * 0.28)
    assert derived["paravirt.floor_setup_64_qp_pairs"].value == pytest.approx(90.0 + 4 * 0.28)
    assert derived["paravirt.floor_connect_qp_pair"].ratio == pytest.approx(2.56 / 1.6)
    assert all(r.target is None for r in derived.values())  # floors inform the targets; they are not held to them
    assert with_framing(floors, mediated[:1]) == []  # no round-trip floor in the run: nothing to derive


def test_each_pooled_loop_of_the_mr_floor_registers_pages_of_its_own() -> None:
    """The bare mediator's loops of small MRs replay the frontend's refills on fresh pages: a loop's region holds
    all of them, and the regions lie past reg_mr_1m's megabyte, inside the arena."""
    from bench import mediation_floor as floor
    from vrnic.frontend.guest_library import mr_pool_refills

    assert sum(mr_pool_refills(floor._SMALL_MR, floor.LOOP)) * floor._SMALL_MR <= floor._POOL_REGION
    assert (1 << 20) + floor._POOL_REGIONS * floor._POOL_REGION <= floor._ARENA_SIZE
    assert floor._POOL_REGIONS >= 4  # a bench run's loops (CONTROL_ROUNDS) never register a page twice


def test_a_pooled_loop_of_the_floor_refills_when_empty_and_closes_each_object_untimed() -> None:
    """What the bare mediator's pooled loops send, in order: a refill whenever the pool is empty (the frontend's
    schedule), one close after each sample, the spares at the end; a sample with a refill is the one that waits."""
    from bench import mediation_floor as floor
    from vrnic.frontend.guest_library import qp_pool_refills

    sent: list[str] = []

    def refill(count: int) -> None:
        sent.append(f"refill {count}")
        time.sleep(0.02)  # a margin no list append reaches, even on a loaded host

    samples = floor._pool_loop(qp_pool_refills(floor.LOOP), refill, lambda: sent.append("close"),
                               lambda: sent.append("spares"))
    assert len(samples) == floor.LOOP
    refills = [entry for entry in sent if entry.startswith("refill")]
    assert refills == ["refill 4", "refill 8", "refill 16", "refill 32"]
    assert sent.count("close") == floor.LOOP and sent[-1] == "spares"
    assert sent[:3] == ["refill 4", "close", "close"] and sent[5:7] == ["refill 8", "close"]
    slow = [index for index, sample in enumerate(samples) if sample >= 20.0]
    assert slow == [0, 4, 12, 28]  # the samples that found the pool empty
