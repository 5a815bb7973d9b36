"""Two-hosts tier: the lab's two guests as two hosts, one PostgreSQL on a, `vrnic daemon` on each.

pytest runs on host a (`make test-two-hosts`: `python -m vrnic.lab.two_hosts --smoke -- pytest ...` in
both guests); host b serves a's requests through its control server. Anywhere else these tests skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vrnic.lab.two_hosts.rig import Rig, in_two_hosts_lab

from .support import Rigs

B_DEVICE_CAP = 6  # b's rxe0 takes this many live vRNICs (the race for the last slot)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if in_two_hosts_lab() and os.environ.get("VRNIC_LAB_ROLE") == "a" and "VRNIC_LAB_CONTROL" in os.environ:
        return
    skip = pytest.mark.skip(reason="runs on host a of the lab's two-hosts topology (`make test-two-hosts`)")
    for item in items:
        if item.path.is_relative_to(os.path.dirname(__file__)):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rigs() -> Iterator[Rigs]:
    made = Rigs()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def rig(rigs: Rigs) -> Rig:
    return rigs.get(host_env={"b": {"VRNIC_DEVICE_MAX_VRNICS": str(B_DEVICE_CAP)}})
