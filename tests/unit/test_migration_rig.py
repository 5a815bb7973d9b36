"""vrnic.lab.migration_rig's pure checks: what a migrated VM's traffic got wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from vrnic.lab.migration_rig import (
    NestedGuestFault,
    NestedGuestRetried,
    guest_stopped,
    retry_on_guest_fault,
    stream_into_new_vm,
    stream_problems,
)
from vrnic.lab.vm_guest import migratable_vm_spec


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


class _EndedVm:
    def __init__(self, report: str) -> None:
        self.report = report

    def exit_report(self, wait_s: float = 1.0) -> str:
        return self.report


def test_a_qemu_that_ended_without_a_panic_is_the_nested_guests_doing_and_a_panic_is_not() -> None:
    reset = "QEMU dst exited with status 0: (nothing in its log); its console ends: vrnic-vm: init"
    assert guest_stopped(_EndedVm(reset)) == reset  # type: ignore[arg-type]
    panicked = "QEMU dst exited with status 0: ...; its console ends: Kernel panic - not syncing: Fatal exception"
    assert guest_stopped(_EndedVm(panicked)) is None  # type: ignore[arg-type]


def test_retry_on_guest_fault_runs_once_more_only_for_a_nested_guest_fault() -> None:
    said: list[str] = []
    calls: list[int] = []

    def flaky(n: int) -> str:
        calls.append(n)
        if n == 1:
            raise NestedGuestFault("QEMU src exited with status 0")
        return "ok"

    with pytest.warns(NestedGuestRetried, match="the move: the nested guest stopped running"):
        assert retry_on_guest_fault(flaky, "the move", say=said.append) == "ok"
    assert calls == [1, 2] and "QEMU src exited with status 0" in said[0]

    def wrong(n: int) -> None:
        calls.append(n)
        raise AssertionError("a write is missing")

    calls.clear()
    with pytest.raises(AssertionError, match="a write is missing"):
        retry_on_guest_fault(wrong, "the move", say=said.append)
    assert calls == [1]  # the feature's failure is never retried

    def always(n: int) -> None:
        calls.append(n)
        raise NestedGuestFault(f"frozen {n}")

    calls.clear()
    with pytest.warns(NestedGuestRetried), pytest.raises(NestedGuestFault, match="all 3 attempts: frozen 3"):
        retry_on_guest_fault(always, "the move", say=said.append)
    assert calls == [1, 2, 3]


class _Vm(_EndedVm):
    """Enough of a QemuVm for binding() and a stop."""

    stopped = False
    ram_path = Path("/dev/shm/vm.ram")
    spec = migratable_vm_spec("src", Path("/tmp/src"), Path("/tmp/image.cpio.gz"))

    def stop(self) -> None:
        self.stopped = True


class _RefusingBinder:
    def bind_vm(self, binding: object) -> None:
        raise RuntimeError("the VM program did not say ready")


def _attach() -> object:
    from vrnic.core.specs import AttachInfo

    return AttachInfo.model_construct(vrnic_id="vr-1")


def test_a_vm_that_stopped_on_its_own_while_starting_to_stream_is_a_fault_and_everything_started_goes() -> None:
    vm, unbound = _Vm("QEMU src exited with status 0: (nothing in its log); its console is empty"), []
    with pytest.raises(NestedGuestFault, match="console is empty .the test then failed: RuntimeError") as raised:
        stream_into_new_vm(_RefusingBinder(), lambda: unbound.append(1), "mig", lambda: vm,  # type: ignore[arg-type,return-value]
                           _attach(), _attach())  # type: ignore[arg-type]
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert vm.stopped and unbound == [1]


def test_a_vm_that_panicked_while_starting_to_stream_fails_as_it_failed() -> None:
    vm, unbound = _Vm("QEMU src exited: its console ends: Kernel panic - not syncing: Fatal exception"), []
    with pytest.raises(RuntimeError, match="did not say ready"):
        stream_into_new_vm(_RefusingBinder(), lambda: unbound.append(1), "mig", lambda: vm,  # type: ignore[arg-type,return-value]
                           _attach(), _attach())  # type: ignore[arg-type]
    assert vm.stopped and unbound == [1]
