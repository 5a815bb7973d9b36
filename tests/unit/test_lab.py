"""The pure parts of the lab: QEMU argv, kernel choice, guest scripts; the runner giving up a locked-up guest."""

from __future__ import annotations

import contextlib
import io
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from vrnic.config import LabSettings
from vrnic.errors import InvalidArgument, LabError
from vrnic.lab.guest import (
    EXIT_BOOT_FAILURE,
    EXIT_GUEST_LOST,
    MARKER,
    GuestPlan,
    Topology,
    guest_script,
    heartbeat_file,
    heartbeat_script,
    initramfs_init,
    ipv4_gid_suffix,
    lab_env,
)
from vrnic.lab.kernel import choose_kernel, parse_show_depends
from vrnic.lab.qemu import DgramLink, GuestSpec, kernel_cmdline, qemu_argv
from vrnic.lab.runner import LabRunner, _Guest, locked_up, quiet_for

SPEC = GuestSpec(kernel=Path("/boot/vmlinuz-6.1.0-56-amd64"), initrd=Path("/var/cache/vrnic/i.cpio.gz"),
                 work_dir=Path("/work/main"), run_dir=Path("/work/main/.lab/runs/1"))


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_qemu_argv_is_tcg_with_two_9p_shares_and_no_nic() -> None:
    argv = qemu_argv(SPEC)
    assert argv[0] == "qemu-system-x86_64"
    assert _option(argv, "-accel") == ["tcg"]
    # nested KVM needs svm; AVX makes glibc pick a memcpy TCG runs several times slower
    assert _option(argv, "-cpu") == ["max,-avx,-avx2,-vaes,-vpclmulqdq"]
    assert "-no-reboot" in argv and "-nodefaults" in argv
    assert _option(argv, "-virtfs") == [
        "local,path=/,mount_tag=hostroot,readonly=on,security_model=none,multidevs=remap",
        "local,path=/work/main,mount_tag=work,security_model=none,multidevs=remap",
    ]
    assert _option(argv, "-nic") == ["none"]
    assert _option(argv, "-kernel") == ["/boot/vmlinuz-6.1.0-56-amd64"]
    assert _option(argv, "-smp") == ["2"] and _option(argv, "-m") == ["2048M"]


def test_kernel_cmdline_carries_work_run_and_role() -> None:
    assert kernel_cmdline(SPEC) == ("console=ttyS0 quiet loglevel=4 panic=-1 oops=panic mitigations=off "
                                    "vrnic.work=/work/main vrnic.run=/work/main/.lab/runs/1 vrnic.role=a")


def test_two_hosts_link_is_a_dgram_netdev_never_a_stream() -> None:
    spec = GuestSpec(**{**SPEC.__dict__, "link": DgramLink(40001, 40002, "52:54:00:77:00:01")})
    argv = qemu_argv(spec)
    assert _option(argv, "-netdev") == [
        "dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port=40001,"
        "remote.type=inet,remote.host=127.0.0.1,remote.port=40002"]
    assert _option(argv, "-device") == ["virtio-net-pci,netdev=n0,mac=52:54:00:77:00:01,romfile="]
    assert "-nic" not in argv


@pytest.mark.parametrize("bad", [Path("relative"), Path("/a b"), Path("/a,b")])
def test_paths_qemu_or_the_cmdline_would_split_are_refused(bad: Path) -> None:
    with pytest.raises(InvalidArgument):
        qemu_argv(GuestSpec(**{**SPEC.__dict__, "work_dir": bad}))


def test_tiny_guests_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        qemu_argv(GuestSpec(**{**SPEC.__dict__, "memory_mb": 64}))


def test_choose_kernel_prefers_newest_6_1_over_newer_series() -> None:
    installed = ["6.12.48+deb12-amd64", "6.1.0-9-amd64", "6.1.0-56-amd64", "6.1.0-10-amd64"]
    assert choose_kernel(installed) == "6.1.0-56-amd64"
    assert choose_kernel(installed, "6.12.48+deb12-amd64") == "6.12.48+deb12-amd64"
    assert choose_kernel(["6.12.48+deb12-amd64"]) == "6.12.48+deb12-amd64"


def test_choose_kernel_errors_name_the_fix() -> None:
    with pytest.raises(LabError, match="make setup"):
        choose_kernel([])
    with pytest.raises(LabError, match="not installed"):
        choose_kernel(["6.1.0-56-amd64"], "5.10.0-1-amd64")


def test_parse_show_depends_keeps_order_and_skips_builtins() -> None:
    text = ("insmod /lib/modules/k/kernel/net/9p/9pnet.ko \n"
            "builtin virtio\n"
            "insmod /lib/modules/k/kernel/fs/9p/9p.ko.xz \n")
    assert parse_show_depends(text) == [Path("/lib/modules/k/kernel/net/9p/9pnet.ko"),
                                        Path("/lib/modules/k/kernel/fs/9p/9p.ko.xz")]


def test_ipv4_gid_suffix_matches_sysfs_format() -> None:
    assert ipv4_gid_suffix("10.77.1.1") == "ffff:0a4d:0101"
    assert ipv4_gid_suffix("192.168.0.255") == "ffff:c0a8:00ff"


def _plan(**kw: object) -> GuestPlan:
    base: dict[str, object] = dict(topology=Topology.PAIR, command=["rdma", "link", "show"], cwd=Path("/work/main"),
                                   rc_file=Path("/work/main/.lab/runs/1/rc-a"), venv=Path("/opt/vrnic/venv"))
    return GuestPlan(**{**base, **kw})  # type: ignore[arg-type]


def test_pair_script_builds_rxe_on_both_veth_ends_with_the_routing_fix() -> None:
    script = guest_script(_plan())
    assert "rdma link add rxe0 type rxe netdev veth0" in script
    assert "rdma link add rxe1 type rxe netdev veth1" in script
    assert "ip rule add pref 100 from 10.77.1.1 to 10.77.1.2 iif lo lookup 101" in script
    assert "ip rule add pref 1000 lookup local && ip rule del pref 0 lookup local" in script
    assert "accept_local=1" in script and "rp_filter=0" in script
    assert "ffff:0a4d:0102" in script  # waits for rxe1's GID
    assert "\nrdma link show </dev/null\nfinish $?\n" in script
    assert f"finish {EXIT_BOOT_FAILURE}" in script


def test_single_script_has_only_rxe0() -> None:
    script = guest_script(_plan(topology=Topology.SINGLE))
    assert "rxe0 type rxe netdev veth0" in script and "rxe1" not in script


def test_two_hosts_scripts_differ_by_role() -> None:
    a = guest_script(_plan(topology=Topology.TWO_HOSTS, role="a"))
    b = guest_script(_plan(topology=Topology.TWO_HOSTS, role="b"))
    assert "ip addr add 10.77.0.1/24 dev eth0" in a and "ip addr add 10.77.0.2/24 dev eth0" in b
    assert "export VRNIC_LAB_PEER_ADDR=10.77.0.2" in a and "export VRNIC_LAB_PEER_ADDR=10.77.0.1" in b
    assert "veth" not in a


def test_lab_env_tells_the_command_its_lab() -> None:
    env = lab_env(_plan(topology=Topology.TWO_HOSTS, role="b", env={"X": "1"}))
    assert env["VRNIC_LAB_ROLE"] == "b" and env["VRNIC_LAB_LOCAL_ADDR"] == "10.77.0.2"
    assert env["X"] == "1" and env["VRNIC_LAB"] == "1"
    assert lab_env(_plan())["VRNIC_LAB_RXE_DEVICES"] == "rxe0 rxe1"


def test_netdevsim_setup_and_arguments_are_quoted() -> None:
    script = guest_script(_plan(netdevsim_ko=Path("/var/cache/vrnic/k/netdevsim.ko"), netdevsim_vfs=8,
                                command=["sh", "-c", "echo 'hi there'"]))
    assert "insmod /var/cache/vrnic/k/netdevsim.ko" in script
    assert "echo 8 > /sys/bus/netdevsim/devices/netdevsim10/sriov_numvfs" in script
    assert "sh -c 'echo '\"'\"'hi there'\"'\"''" in script


@pytest.mark.parametrize("kw", [dict(command=[]), dict(role="c"),
                                dict(netdevsim_ko=Path("/x.ko"), netdevsim_vfs=0)])
def test_bad_plans_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        guest_script(_plan(**kw))


def test_scripts_are_valid_shell() -> None:
    subprocess.run(["bash", "-n"], input=guest_script(_plan(netdevsim_ko=Path("/n.ko"))), text=True, check=True)
    subprocess.run(["busybox", "sh", "-n"], input=initramfs_init(["virtio.ko", "9p.ko"]), text=True, check=True)


def test_initramfs_init_loads_modules_in_order_and_reports_failures() -> None:
    init = initramfs_init(["virtio.ko", "9pnet.ko", "9p.ko"])
    assert init.index("insmod /modules/virtio.ko") < init.index("insmod /modules/9p.ko")
    assert f"{MARKER}boot-failed" in init
    assert 'switch_root /newroot /bin/bash "$run/guest-$role.sh"' in init


def test_sriov_nic_is_an_igb_behind_a_pcie_root_port() -> None:
    argv = qemu_argv(GuestSpec(**{**SPEC.__dict__, "sriov_nic": True}))
    assert _option(argv, "-machine") == ["q35"]  # SR-IOV is a PCIe extended capability
    # an emulated VT-d first (before the devices it translates), so a VF can go to vfio-pci and a nested VM
    assert _option(argv, "-device") == ["intel-iommu,intremap=on", "pcie-root-port,id=rp0,slot=1",
                                        "igb,bus=rp0,romfile="]
    cmdline = _option(argv, "-append")[0].split()
    assert "intel_iommu=on" in cmdline and "iommu=pt" in cmdline
    script = guest_script(_plan(sriov_nic=True))
    assert "modprobe igb && modprobe igbvf" in script and "VRNIC_LAB_SRIOV_PF" in script
    with pytest.raises(InvalidArgument):
        guest_script(_plan(sriov_nic=True, topology=Topology.TWO_HOSTS))


def test_the_iommu_comes_only_with_the_sriov_nic_and_can_be_left_out() -> None:
    argv = qemu_argv(GuestSpec(**{**SPEC.__dict__, "sriov_nic": True, "sriov_iommu": False}))
    assert _option(argv, "-device") == ["pcie-root-port,id=rp0,slot=1", "igb,bus=rp0,romfile="]
    assert "intel_iommu=on" not in _option(argv, "-append")[0]
    plain = qemu_argv(SPEC)
    assert not any("iommu" in arg for arg in plain)


LOCKUP = "[  256.673817] watchdog: BUG: soft lockup - CPU#0 stuck for {}s! [qemu-system-x86:244]"


def test_locked_up_is_a_cpu_stuck_for_two_minutes() -> None:
    assert locked_up(LOCKUP.format(131))
    assert locked_up("tests/kernel/test_vm_nested.py " + LOCKUP.format(120))  # after pytest's unfinished line
    assert not locked_up(LOCKUP.format(26))  # a loaded host can starve the guest that long
    assert not locked_up("watchdog: BUG: soft lockup in a test's own output, no CPU")


def _stream_a_running_guest(tmp_path: Path, lines: list[str], stalled_after: float = 150.0, beat_once: bool = False,
                            ) -> tuple[LabRunner, _Guest, queue.Queue[tuple[str, str | None]], float]:
    """The runner streaming `lines` from one guest whose QEMU (a sleep) runs on; its runner, the guest, what
    was left unread and when it started."""
    runner = LabRunner(LabSettings(work_dir=tmp_path), console=Console(file=io.StringIO()), out=io.StringIO(),
                       stalled_after=stalled_after)
    runner.panicked = None
    process = subprocess.Popen(["sleep", "60"])
    guest = _Guest(role="a", process=process, rc_file=tmp_path / "rc-a", log=io.StringIO())
    events: queue.Queue[tuple[str, str | None]] = queue.Queue()
    for line in lines:
        events.put(("a", line))
    if beat_once:
        heartbeat_file(guest.rc_file).write_text("1")  # then stopped
    started = time.monotonic()
    try:
        assert runner._stream([guest], events, started, timeout=60, prefix=False) is False
    finally:
        process.kill()
        process.wait()
    return runner, guest, events, started


def test_a_locked_up_guest_is_given_up_at_once_and_counts_as_a_panic(tmp_path: Path) -> None:
    lines = [f"{MARKER}ready", LOCKUP.format(26), LOCKUP.format(52), LOCKUP.format(131), "never read"]
    runner, guest, events, started = _stream_a_running_guest(tmp_path, lines)
    assert events.get_nowait() == ("a", "never read")  # it did not wait for the lab's timeout
    assert runner._verdict([guest], False, started, 60) == EXIT_GUEST_LOST
    assert runner.panicked is not None and "stuck for 131s" in runner.panicked  # --rerun-on-panic reruns


def test_the_guest_beats_into_a_file_beside_its_rc_file_while_the_command_runs() -> None:
    script = guest_script(_plan())
    beat = script.index("/work/main/.lab/runs/1/rc-a.heartbeat")
    assert script.index(f"{MARKER}ready") < beat < script.index("\nrdma link show </dev/null\n")
    assert heartbeat_file(Path("/r/rc-b")) == Path("/r/rc-b.heartbeat")


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _beats(beat: Path, seconds: float) -> int:
    """How many times beat's mtime moved in the next seconds."""
    seen, moved = None, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            mtime = beat.stat().st_mtime_ns
            moved += seen is not None and mtime != seen
            seen = mtime
        time.sleep(0.02)
    return moved


def test_the_heartbeat_beats_with_builtins_and_stops_when_one_cpus_task_cannot_run(tmp_path: Path) -> None:
    beat = tmp_path / "rc-a.heartbeat"
    script = heartbeat_script(str(beat), period_s=0.1, fifo_dir=str(tmp_path))
    shell = subprocess.Popen(["bash", "-c", script + "\nwait\n"], start_new_session=True)
    try:
        assert _beats(beat, 1.5) >= 3
        (loop,) = _children(shell.pid)  # the heartbeat's subshell
        workers = _children(loop)  # a subshell per CPU, pinned, answering each beat
        assert len(workers) == os.cpu_count()
        for _ in range(3):  # beats later: the same subshells and no process of theirs (none started per beat)
            assert _beats(beat, 0.5) >= 1
            assert set(_children(loop)) == set(workers) and not any(_children(w) for w in workers)
        os.kill(workers[-1], signal.SIGSTOP)  # as a CPU stuck in nested KVM runs nothing
        time.sleep(0.3)
        assert _beats(beat, 1.0) == 0
        os.kill(workers[-1], signal.SIGCONT)
        assert _beats(beat, 1.0) >= 2
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_quiet_for_counts_from_the_last_beat_or_from_ready(tmp_path: Path) -> None:
    beat = tmp_path / "rc-a.heartbeat"
    assert quiet_for(beat, ready_at=1000.0, now=1030.0) == 30.0  # not beaten yet
    beat.write_text("1")
    os.utime(beat, (2000.0, 2000.0))
    assert quiet_for(beat, ready_at=1000.0, now=2010.0) == 10.0
    assert quiet_for(beat, ready_at=3000.0, now=3005.0) == 5.0  # a beat from before ready (a rerun) is not one


def test_a_guest_whose_heartbeat_stopped_is_given_up_and_counts_as_lost(tmp_path: Path) -> None:
    runner, guest, _, started = _stream_a_running_guest(tmp_path, [f"{MARKER}ready"], stalled_after=1.0,
                                                        beat_once=True)
    assert time.monotonic() - started < 10  # given up after about a second of silence, not at the timeout
    assert runner._verdict([guest], False, started, 60) == EXIT_GUEST_LOST
    assert runner.panicked is not None and "no heartbeat for" in runner.panicked


def test_a_beating_guest_is_left_alone(tmp_path: Path) -> None:
    runner = LabRunner(LabSettings(work_dir=tmp_path), console=Console(file=io.StringIO()), out=io.StringIO(),
                       stalled_after=1.5)
    guest = _Guest(role="a", process=subprocess.Popen(["true"]), rc_file=tmp_path / "rc-a", log=io.StringIO())
    guest.process.wait()
    events: queue.Queue[tuple[str, str | None]] = queue.Queue()
    events.put(("a", f"{MARKER}ready"))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.3):
            heartbeat_file(guest.rc_file).write_text("1")
        events.put(("a", None))  # the console closes: the run ends normally

    beater = threading.Thread(target=beat)
    beater.start()
    threading.Timer(4.0, stop.set).start()
    try:
        assert runner._stream([guest], events, time.monotonic(), timeout=60, prefix=False) is False
    finally:
        stop.set()
        beater.join()
    assert guest.locked_up is None


def test_the_guest_learns_the_labs_writable_output_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    from vrnic.config import LAB_OUTPUT_DIR_ENV, PROJECT_DIR, lab_output_dir

    env = lab_env(_plan(output_dir=Path("/srv/lab-work/.lab")))
    assert env[LAB_OUTPUT_DIR_ENV] == "/srv/lab-work/.lab"
    assert LAB_OUTPUT_DIR_ENV not in lab_env(_plan())
    monkeypatch.setenv(LAB_OUTPUT_DIR_ENV, "/srv/lab-work/.lab")
    assert lab_output_dir("two-hosts", "xvm") == Path("/srv/lab-work/.lab/two-hosts/xvm")
    monkeypatch.delenv(LAB_OUTPUT_DIR_ENV)
    assert lab_output_dir("two-hosts") == PROJECT_DIR / ".lab" / "two-hosts"
