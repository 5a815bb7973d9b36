"""Helpers of the two-hosts tests: answers, waiting, releasing, the audit log."""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from vrnic.config import PROJECT_DIR, lab_output_dir
from vrnic.lab.two_hosts.rig import Rig
from vrnic.lab.vm_guest import build_migratable_initramfs


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in answer, answer
    return answer


def once_moved(counts: dict[str, dict[str, int]], vrnic: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """a's `rdma res` once vrnic has left for b: less the device context it kept for its next guest while it was
    here (a shared-ring vRNIC holds one from its admission on: vrnic.backend.idle_contexts)."""
    left = {device: dict(kinds) for device, kinds in counts.items()}
    if vrnic.get("engine", "ring") == "ring":
        left[vrnic["device"]]["ctx"] -= 1
    return left


def eventually(check: Callable[[], Any], timeout: float, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(every)


@functools.cache
def migratable_image(mr_bytes: int) -> Path:
    """The migratable VM's boot image (vrnic.lab.vm_guest), built once per run for every test that boots it: a
    build takes 30-50 s under TCG. In the lab's output dir, which both hosts see at the same path."""
    target = lab_output_dir("two-hosts", "images") / f"migratable-{mr_bytes}.cpio.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    return build_migratable_initramfs(os.uname().release, target, PROJECT_DIR,
                                      program_args=("--mr-bytes", str(mr_bytes)))


def release(rig: Rig, *vrnics: dict[str, Any]) -> None:
    for vrnic in vrnics:
        answer = rig.release(vrnic["id"])
        assert answer.status_code == 200, (vrnic["id"], answer.text)


def events(rig: Rig, action: str, host: str = "a") -> list[dict[str, Any]]:
    with rig.client(host) as api:
        page = api.get("/events", params={"action": action, "limit": 100})
    assert page.status_code == 200, page.text
    return list(page.json()["items"])


class Rigs:
    """One rig at a time: PostgreSQL's port and each agent's port are fixed, so a module whose agents need other
    settings gets its rig after the one before it stopped. Modules asking for the same settings share one."""

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self._key = ""
        self._rig: Rig | None = None

    def get(self, agent_env: Mapping[str, str] | None = None,
            host_env: Mapping[str, Mapping[str, str]] | None = None) -> Rig:
        key = json.dumps([agent_env, host_env], sort_keys=True)
        if self._rig is None or key != self._key:
            self.close()
            stack = ExitStack()
            self._rig = stack.enter_context(Rig.start(agent_env=agent_env, host_env=host_env))
            self._stack, self._key = stack, key
        return self._rig

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self._rig = None, None
