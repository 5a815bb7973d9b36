"""The backend service boundary, the fake driver and driver loading (vrnic.backend.service, driver, fake)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from vrnic.backend.driver import ENTRY_POINT_GROUP, RnicDriver, available_drivers, load_driver
from vrnic.backend.drivers.fake import FakeDriver
from vrnic.backend.service import BackendService
from vrnic.core.specs import AttachInfo, DeviceInfo, VrnicMode, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import Conflict, InvalidArgument, NotFound, NotSupported

PV, SRIOV = VrnicMode.PARAVIRTUAL, VrnicMode.SRIOV


def spec(n: int, mode: VrnicMode = PV, device: str | None = None) -> VrnicSpec:
    return VrnicSpec(id=f"v{n}", tenant="acme", mode=mode, device=device, virtual_gid=make_virtual_gid(1, n))


class FakeVfDriver(FakeDriver):
    """A second fake serving the SR-IOV mode, to check that the service routes by mode."""

    name: ClassVar[str] = "fakevf"
    modes = frozenset({SRIOV})


# ----- load_driver ------------------------------------------------------------------------------

def test_load_driver_finds_the_fake_through_its_entry_point() -> None:
    driver = load_driver("fake", device_count=3, socket_path="/tmp/x.sock")
    assert isinstance(driver, FakeDriver)
    assert [d.name for d in driver.devices()] == ["fake0", "fake1", "fake2"]
    assert ENTRY_POINT_GROUP == "vrnic.drivers"
    assert {"fake", "verbs", "sriov"} <= set(available_drivers())


def test_load_driver_unknown_name_is_not_found_and_lists_what_exists() -> None:
    with pytest.raises(NotFound, match="no RNIC driver 'nope'") as info:
        load_driver("nope")
    assert "fake" in str(info.value)


def test_load_driver_passes_options_through() -> None:
    with pytest.raises(TypeError):
        load_driver("fake", no_such_option=1)


# ----- the fake driver --------------------------------------------------------------------------

def test_fake_driver_devices_and_lifecycle() -> None:
    driver = FakeDriver(device_count=2, socket_path="/run/x.sock")
    assert driver.name == "fake" and driver.modes == frozenset({PV})
    devices = driver.devices()
    assert [d.name for d in devices] == ["fake0", "fake1"]
    assert all(d.driver == "fake" and d.ports[0].state == "ACTIVE" for d in devices)
    assert devices[0].node_guid != devices[1].node_guid
    info = driver.create_vrnic(spec(1), "fake1")
    assert (info.vrnic_id, info.device, info.mode, info.socket_path) == ("v1", "fake1", PV, "/run/x.sock")
    assert info.virtual_gid == make_virtual_gid(1, 1)
    assert info.token and len(info.token) >= 24
    assert driver.create_vrnic(spec(2), "fake1").token != info.token
    assert driver.vrnic_ids() == {"v1", "v2"}
    assert (driver.load("fake0"), driver.load("fake1")) == (0, 2)
    driver.release_vrnic("v1")
    assert driver.vrnic_ids() == {"v2"}
    assert driver.load("fake1") == 1


def test_fake_driver_refusals() -> None:
    driver = FakeDriver(device_count=1)
    with pytest.raises(NotFound, match="no device fake9"):
        driver.create_vrnic(spec(1), "fake9")
    driver.create_vrnic(spec(1), "fake0")
    with pytest.raises(Conflict, match="already exists"):
        driver.create_vrnic(spec(1), "fake0")
    with pytest.raises(NotFound):
        driver.release_vrnic("v2")
    assert driver.vrnic_ids() == {"v1"}


def test_driver_close_releases_everything() -> None:
    driver = FakeDriver()
    for n in range(3):
        driver.create_vrnic(spec(n + 1), "fake0")
    driver.close()
    assert driver.vrnic_ids() == set()
    assert driver.load("fake0") == 0


def test_the_default_load_is_zero() -> None:
    class Minimal(RnicDriver):
        name: ClassVar[str] = "minimal"
        modes: ClassVar[frozenset[VrnicMode]] = frozenset({PV})

        def devices(self) -> list[DeviceInfo]:
            return []

        def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
            raise NotImplementedError

        def release_vrnic(self, vrnic_id: str) -> None:
            raise NotFound(vrnic_id)

        def vrnic_ids(self) -> set[str]:
            return set()

    assert Minimal().load("anything") == 0


# ----- BackendService ---------------------------------------------------------------------------

def test_placement_picks_the_least_loaded_device_ties_by_name() -> None:
    service = BackendService({PV: FakeDriver(device_count=3)})
    placed = [service.create_vrnic(spec(n)).device for n in range(1, 8)]
    assert placed == ["fake0", "fake1", "fake2", "fake0", "fake1", "fake2", "fake0"]


def test_placement_follows_load_after_releases() -> None:
    driver = FakeDriver(device_count=2)
    service = BackendService({PV: driver})
    for n in range(1, 5):
        service.create_vrnic(spec(n))  # fake0: v1 v3, fake1: v2 v4
    service.release_vrnic("v2")
    service.release_vrnic("v4")
    assert (driver.load("fake0"), driver.load("fake1")) == (2, 0)
    assert service.create_vrnic(spec(5)).device == "fake1"
    assert service.create_vrnic(spec(6)).device == "fake1"
    assert service.create_vrnic(spec(7)).device == "fake0"


def test_an_explicit_device_is_honoured_even_when_loaded() -> None:
    driver = FakeDriver(device_count=2)
    service = BackendService({PV: driver})
    for n in range(1, 4):
        assert service.create_vrnic(spec(n, device="fake1")).device == "fake1"
    assert driver.load("fake1") == 3


def test_an_explicit_unknown_device_is_invalid_and_creates_nothing() -> None:
    driver = FakeDriver(device_count=2)
    service = BackendService({PV: driver})
    with pytest.raises(InvalidArgument, match="'rxe0' is not available .* fake0, fake1"):
        service.create_vrnic(spec(1, device="rxe0"))
    assert driver.vrnic_ids() == set()
    assert service.vrnic_ids() == set()
    with pytest.raises(NotFound):
        service.release_vrnic("v1")


def test_a_mode_that_is_not_enabled_is_not_supported() -> None:
    service = BackendService({PV: FakeDriver()})
    with pytest.raises(NotSupported, match="mode sriov is not enabled"):
        service.create_vrnic(spec(1, mode=SRIOV))
    with pytest.raises(NotSupported):
        service.driver(SRIOV)
    assert service.vrnic_ids() == set()


def test_no_device_at_all_is_not_supported() -> None:
    service = BackendService({PV: FakeDriver(device_count=0)})
    with pytest.raises(NotSupported, match="no device available"):
        service.create_vrnic(spec(1))
    with pytest.raises(InvalidArgument, match="available: none"):
        service.create_vrnic(spec(1, device="fake0"))


def test_release_unknown_is_not_found() -> None:
    service = BackendService({PV: FakeDriver()})
    with pytest.raises(NotFound, match="no vRNIC ghost"):
        service.release_vrnic("ghost")
    service.create_vrnic(spec(1))
    service.release_vrnic("v1")
    with pytest.raises(NotFound):
        service.release_vrnic("v1")  # twice


def test_modes_are_routed_to_their_driver() -> None:
    pv, vf = FakeDriver(device_count=1), FakeVfDriver(device_count=2)
    service = BackendService({PV: pv, SRIOV: vf})
    assert service.driver(SRIOV) is vf
    assert service.create_vrnic(spec(1)).device == "fake0"
    assert service.create_vrnic(spec(2, mode=SRIOV)).mode is SRIOV
    assert (pv.vrnic_ids(), vf.vrnic_ids()) == ({"v1"}, {"v2"})
    assert service.vrnic_ids() == {"v1", "v2"}
    service.release_vrnic("v2")
    assert (pv.vrnic_ids(), vf.vrnic_ids()) == ({"v1"}, set())
    assert sorted((d.driver, d.name) for d in service.devices()) == [
        ("fake", "fake0"), ("fakevf", "fake0"), ("fakevf", "fake1")]


def test_one_driver_serving_two_modes_lists_its_devices_once() -> None:
    driver = FakeDriver(device_count=2)
    service = BackendService({PV: driver, SRIOV: driver})
    assert [d.name for d in service.devices()] == ["fake0", "fake1"]


def test_an_id_lives_in_one_mode_only() -> None:
    pv, vf = FakeDriver(), FakeVfDriver()
    service = BackendService({PV: pv, SRIOV: vf})
    service.create_vrnic(spec(1))
    with pytest.raises(Conflict, match="v1"):
        service.create_vrnic(spec(1, mode=SRIOV))
    assert vf.vrnic_ids() == set()
    service.release_vrnic("v1")
    assert pv.vrnic_ids() == set()


def test_a_failed_driver_create_records_no_placement() -> None:
    driver = FakeDriver(device_count=1)
    service = BackendService({PV: driver})
    driver.create_vrnic(spec(1), "fake0")  # held by the driver behind the service's back
    with pytest.raises(Conflict):
        service.create_vrnic(spec(1))
    driver.release_vrnic("v1")
    with pytest.raises(NotFound):
        service.release_vrnic("v1")


def test_release_reaches_vrnics_a_driver_still_holds_after_a_service_restart() -> None:
    """SR-IOV allocations outlive the daemon; a new service must still be able to tear them down."""
    pv, vf = FakeDriver(), FakeVfDriver()
    BackendService({PV: pv, SRIOV: vf}).create_vrnic(spec(1, mode=SRIOV))
    restarted = BackendService({PV: pv, SRIOV: vf})
    assert restarted.vrnic_ids() == {"v1"}
    restarted.release_vrnic("v1")
    assert vf.vrnic_ids() == set()
    with pytest.raises(NotFound):
        restarted.release_vrnic("v1")


def test_close_releases_every_driver() -> None:
    pv, vf = FakeDriver(), FakeVfDriver()
    service = BackendService({PV: pv, SRIOV: vf})
    service.create_vrnic(spec(1))
    service.create_vrnic(spec(2, mode=SRIOV))
    service.close()
    assert pv.vrnic_ids() == vf.vrnic_ids() == set()
    assert service.vrnic_ids() == set()
    with pytest.raises(NotFound):
        service.release_vrnic("v1")


# ----- the attach state vrnicd observes ---------------------------------------------------------

def test_attached_vrnics_is_what_the_drivers_observe() -> None:
    fake, other = FakeDriver(), FakeVfDriver()
    service = BackendService({PV: fake, SRIOV: other})
    service.create_vrnic(spec(1))
    service.create_vrnic(spec(2))
    service.create_vrnic(spec(3, SRIOV))
    assert service.attached_vrnics() == set()
    fake.guest_attached("v1")
    other.guest_attached("v3")
    assert service.attached_vrnics() == {"v1", "v3"}
    fake.guest_detached("v1")
    fake.guest_detached("v1")  # a guest that is gone already: nothing to do
    assert service.attached_vrnics() == {"v3"}
    service.release_vrnic("v3")  # released: nothing left to be attached to
    assert service.attached_vrnics() == set()
    with pytest.raises(NotFound):
        fake.guest_attached("v9")


def test_a_driver_that_cannot_observe_reports_nobody_attached() -> None:
    class Blind(RnicDriver):
        name: ClassVar[str] = "blind"
        modes: ClassVar[frozenset[VrnicMode]] = frozenset({PV})

        def devices(self) -> list[DeviceInfo]:
            return []

        def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
            raise NotSupported("blind")

        def release_vrnic(self, vrnic_id: str) -> None:
            raise NotFound(vrnic_id)

        def vrnic_ids(self) -> set[str]:
            return {"v1"}

    assert Blind().attached_ids() == set()
    assert BackendService({PV: Blind()}).attached_vrnics() == set()


def test_registry_attached_ids_are_the_vrnics_with_a_session() -> None:
    from vrnic.backend.registry import Registry, VirtualRnic
    from vrnic.core.recovery import token_digest

    registry = Registry()
    for n in (1, 2):
        registry.add(VirtualRnic(spec=spec(n), device="rxe0", token_hash=token_digest(f"t{n}"), phys_gid="::1",
                                 gid_index=1))
    assert registry.attached_ids() == set()
    registry.by_token("t2").session = object()  # type: ignore[assignment]
    assert registry.attached_ids() == {"v2"}
