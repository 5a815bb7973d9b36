"""bench.host_noise: the windows in which this machine ran CPU work slowly, judged from chunk timings."""

from __future__ import annotations

import pytest

from bench.host_noise import spin, steadiness


def test_a_steady_machine_has_no_slowed_window() -> None:
    found = steadiness([1.0, 1.1, 0.9, 1.0, 1.2])
    assert found.median_chunk_ms == 1.0
    assert (found.slowed_share, found.slowed_windows, found.longest_window_ms) == (0.0, 0, 0.0)


def test_slowed_chunks_in_a_row_are_one_window_and_their_time_is_its_length() -> None:
    chunks = [1.0] * 10 + [8.0, 10.0] + [1.0] * 5 + [5.0] + [1.0] * 2
    found = steadiness(chunks)
    assert found.slowed_windows == 2 and found.longest_window_ms == 18.0
    assert found.slowed_share == pytest.approx(23.0 / sum(chunks))


def test_a_chunk_under_the_factor_is_not_slowed() -> None:
    assert steadiness([1.0, 1.0, 1.0, 3.9]).slowed_windows == 0


def test_nothing_timed_is_an_error() -> None:
    with pytest.raises(ValueError, match="no chunks"):
        steadiness([])


def test_spin_times_chunks_for_about_the_time_asked() -> None:
    chunks = spin(0.05, chunk_iterations=1000)
    assert chunks and all(c > 0 for c in chunks)
    assert sum(chunks) >= 40.0  # ms: most of the 50 ms is spent in the chunks
