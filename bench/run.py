"""`make bench`: run every benchmark, write bench/results/latest.json, print a table.

Host benchmarks run here; kernel benchmarks run inside the lab guest
(`--in-guest`), the multi-host ones on the lab's two hosts (bench/two_hosts.py: bench/multihost.py and
bench/qos_two_hosts.py),
and their records are merged in.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.harness import RESULTS, Record, load, show, write

GUEST_PART = RESULTS / "guest.json"
MULTIHOST_PART = RESULTS / "multihost.json"  # written by bench.two_hosts (multihost, qos_two_hosts) on host a
RECOVERY_PART = RESULTS / "recovery.json"  # the kill storm, in its own lab run (with netdevsim VFs)


def guest_suites() -> list[Record]:
    from bench import control_plane, direct, migration, native_verbs, paravirt, qos, vm

    native = native_verbs.run()
    mediated = paravirt.run(native)
    return (native + mediated + direct.run(native) + vm.run(native, mediated) + migration.run() + qos.run()
            + control_plane.run_guest())


def host_suites() -> list[Record]:
    from bench import control_plane

    return control_plane.run()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--in-guest", action="store_true", help="run the kernel suites (inside the lab)")
    parser.add_argument("--recovery", action="store_true", help="run the kill storm (inside the lab)")
    args = parser.parse_args()
    if args.in_guest:
        write(guest_suites(), GUEST_PART)
        return 0
    if args.recovery:
        from bench import recovery

        write(recovery.run(), RECOVERY_PART)
        return 0
    records = host_suites()
    lab = [sys.executable, "-m", "vrnic.cli.main", "lab", "run", "--timeout", "1800", "--"]
    passes = [
        ("the kernel suites", lab, [sys.executable, "-m", "bench.run", "--in-guest"], GUEST_PART),
        # 50 restarts of `vrnic daemon` at 27-48 s each in the lab (Python's imports over 9p under TCG): up to 40 min
        ("the kill storm", [*lab[:5], "--netdevsim", "--timeout", "3600", *lab[7:]],
         [sys.executable, "-m", "bench.run", "--recovery"],
         RECOVERY_PART),
        ("the two-hosts suite", [*lab[:5], "--topology", "two-hosts", *lab[5:]],
         [sys.executable, "-m", "vrnic.lab.two_hosts", "--", sys.executable, "-m", "bench.two_hosts", "--out",
          str(MULTIHOST_PART)], MULTIHOST_PART),
    ]
    for what, run_lab, command, part in passes:
        part.unlink(missing_ok=True)
        rc = subprocess.run([*run_lab, *command], cwd=Path(__file__).parents[1], check=False).returncode
        if rc != 0 or not part.exists():
            print(f"bench: {what} failed in the lab (exit {rc})", file=sys.stderr)
            return 1
        records += load(part)
        part.unlink()
    write(records, RESULTS / "latest.json")
    show(records)
    print(f"wrote {RESULTS / 'latest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
