"""Benchmark records and timing helpers.

Every record compares a value with a baseline measured in the same run on the
same device; records that *are* a baseline carry baseline=None.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Record:
    name: str
    unit: str
    value: float
    baseline: float | None = None
    target: float | None = None  # the ratio we aim for; with better="within", the tolerance around 1
    better: Literal["lower", "higher", "within"] = "lower"
    at_most: float | None = None  # a bound on the value itself, for counts that must stay at 0
    at_least: float | None = None  # a bound from below on the value itself (an absolute target, as ops/s)

    @property
    def ratio(self) -> float | None:
        return None if not self.baseline else self.value / self.baseline

    @property
    def met(self) -> bool | None:
        if self.at_most is not None or self.at_least is not None:
            return (self.at_most is None or self.value <= self.at_most) and \
                (self.at_least is None or self.value >= self.at_least)
        if self.ratio is None or self.target is None:
            return None
        if self.better == "within":
            return abs(self.ratio - 1.0) <= self.target
        return self.ratio <= self.target if self.better == "lower" else self.ratio >= self.target

    @property
    def target_text(self) -> str:
        if self.at_most is not None or self.at_least is not None:
            return " ".join(([f">={self.at_least:g}"] if self.at_least is not None else [])
                            + ([f"<={self.at_most:g}"] if self.at_most is not None else []))
        if self.target is None:
            return ""
        return {"lower": f"<={self.target}x", "higher": f">={self.target}x", "within": f"1±{self.target}x"}[self.better]

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": self.ratio}


def samples_ms(operation: Callable[[], Callable[[], None] | None], repeat: int = 50) -> list[float]:
    """Wall time of each of repeat calls of operation(), in ms; a returned callable (cleanup) runs untimed."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        cleanup = operation()
        samples.append((time.perf_counter() - started) * 1e3)
        if cleanup is not None:
            cleanup()
    return samples


def alternating(first: Callable[[], float], second: Callable[[], float],
                rounds: int) -> tuple[list[float], list[float]]:
    """One sample of each per round, the order swapped every round, so that drift hits both alike and neither
    always runs right after the other: (first's samples, second's samples). For measures that each set up their
    own objects untimed (a pair to connect): a bare verb in turns would run cold (loops_in_turns is for those)."""
    return loops_in_turns(lambda: [first()], lambda: [second()], rounds)


def loops_in_turns(first: Callable[[], list[float]], second: Callable[[], list[float]],
                   rounds: int) -> tuple[list[float], list[float]]:
    """alternating() for whole loops: one loop of each per round (each returns its samples), the order swapped
    every round, the samples of each side's loops together. For bare verbs, which in the lab run 1.5-5x slower
    right after other work than in a loop of their own: each loop warms itself up as a loop on its own would,
    and the two sides share the same minutes of a host whose speed drifts 2x between runs (issue 14)."""
    samples: tuple[list[float], list[float]] = ([], [])
    loops = (first, second)
    for n in range(rounds):
        for which in (0, 1) if n % 2 == 0 else (1, 0):
            samples[which].extend(loops[which]())
    return samples


def median_ms(operation: Callable[[], Callable[[], None] | None], repeat: int = 50) -> float:
    """Median wall time of operation() in ms; a returned callable (cleanup) runs untimed."""
    return statistics.median(samples_ms(operation, repeat))


def write(records: list[Record], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.to_dict() for r in records], indent=2) + "\n")


def load(path: Path) -> list[Record]:
    return [Record(**{k: v for k, v in d.items() if k != "ratio"}) for d in json.loads(path.read_text())]


def show(records: list[Record]) -> None:
    table = Table("benchmark", "value", "baseline", "ratio", "target", "met")
    for r in records:
        table.add_row(r.name, f"{r.value:.3f} {r.unit}",
                      "" if r.baseline is None else f"{r.baseline:.3f}",
                      "" if r.ratio is None else f"{r.ratio:.2f}x",
                      r.target_text,
                      {None: "", True: "yes", False: "NO"}[r.met])
    Console().print(table)
