"""The two-hosts lab pass of `make bench`: bench.multihost, bench.qos_two_hosts, then bench.migration_two_hosts
(each with its own rig), their records merged into one file.

    vrnic lab run --topology two-hosts -- python -m vrnic.lab.two_hosts -- python -m bench.two_hosts --out FILE
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import migration_two_hosts, multihost, qos_two_hosts
from bench.harness import RESULTS, Record, load, write
from vrnic.errors import LabError, VrnicError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "multihost.json")
    args = parser.parse_args()
    records: list[Record] = []
    rc = 0
    for name, suite in (("multihost", multihost.run), ("qos_two_hosts", qos_two_hosts.run),
                        ("migration_two_hosts", migration_two_hosts.run)):
        part = args.out.with_name(f"{args.out.stem}.{name}.json")
        part.unlink(missing_ok=True)
        started = time.monotonic()
        try:
            rc = suite(part) or rc
        except (VrnicError, LabError, OSError) as exc:
            print(f"bench.{name} failed: {exc}", file=sys.stderr, flush=True)
            rc = 1
        if part.exists():
            records += load(part)
            part.unlink()
        print(f"bench.{name}: {time.monotonic() - started:.0f} s", flush=True)
    write(records, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
