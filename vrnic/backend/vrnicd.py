"""vrnicd on its own: the paravirtual backend with vRNICs given on the command line.

    python -m vrnic.backend.vrnicd --socket /run/vrnic/vrnicd.sock \\
        --vrnic a:tenant1:rxe0 --vrnic b:tenant1:rxe1 [--quota max_qps=8] [--attach-out FILE]

Prints (or writes) one JSON attach record per vRNIC, then serves guests until
SIGTERM or SIGINT, when it releases everything and exits 0. `vrnic daemon`
runs the same backend together with the REST API; this entry point is for
hosts without the control plane, the examples and the tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from vrnic.backend.channel import ChannelLimits, group_id
from vrnic.backend.descriptors import raise_descriptor_limit
from vrnic.backend.drivers.paravirtual import DEFAULT_SOCKET, VerbsDriver
from vrnic.core.specs import DataEngine, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import InvalidArgument, VrnicError

log = logging.getLogger("vrnicd")


def parse_vrnic(text: str, serial: int, quota: Quota) -> tuple[VrnicSpec, str]:
    """'ID:TENANT:DEVICE[:VPC[:ENGINE]]' -> (spec, device); ENGINE is ring (the default) or direct."""
    parts = text.split(":")
    engines = {e.value for e in DataEngine}
    if len(parts) not in (3, 4, 5) or not all(parts) or (len(parts) == 5 and parts[4] not in engines):
        raise InvalidArgument(f"--vrnic takes ID:TENANT:DEVICE[:VPC[:ENGINE]] with ENGINE ring or direct, "
                              f"not {text!r}")
    vpc = int(parts[3]) if len(parts) >= 4 else 0
    engine = DataEngine(parts[4]) if len(parts) == 5 else DataEngine.RING
    spec = VrnicSpec(id=parts[0], tenant=parts[1], vpc_id=vpc, quota=quota,
                     virtual_gid=make_virtual_gid(vpc, serial), engine=engine)
    return spec, parts[2]


def parse_quota(items: list[str]) -> Quota:
    values: dict[str, int] = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in Quota.model_fields or not value.isdigit():
            raise InvalidArgument(f"--quota takes NAME=INT with NAME in {', '.join(Quota.model_fields)}")
        values[name] = int(value)
    return Quota(**values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", type=Path, default=DEFAULT_SOCKET)
    parser.add_argument("--vrnic", action="append", default=[], help="ID:TENANT:DEVICE[:VPC[:ENGINE]]")
    parser.add_argument("--quota", action="append", default=[], help="NAME=INT, for every vRNIC")
    parser.add_argument("--attach-out", type=Path, help="write the attach records here instead of stdout")
    parser.add_argument("--socket-mode", type=lambda text: int(text, 8), default=0o660,
                        help="octal mode of the guest socket (default 660)")
    parser.add_argument("--socket-group", help="group (name or number) that owns the guest socket")
    parser.add_argument("--direct-containment", choices=("required", "best-effort"), default="required",
                        help="refuse direct-engine guests whose cgroup cannot be limited (default), or warn")
    parser.add_argument("--packet-guard", action="store_true",
                        help="filter RoCE egress to the flows vrnicd connected (nftables; see kernel/roce_guard)")
    parser.add_argument("--strict-isolation", action="store_true",
                        help="refuse the direct engine where the packet guard cannot hold")
    parser.add_argument("--qos-link-mbps", type=int, help="the uplinks' speed for QoS guarantees when sysfs has none")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="vrnicd: %(levelname)s %(message)s", force=True)  # pyverbs configures logging on import
    raise_descriptor_limit()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        quota = parse_quota(args.quota)
        driver = VerbsDriver(socket_path=args.socket, channel=ChannelLimits(socket_mode=args.socket_mode,
                                                                            socket_gid=group_id(args.socket_group)),
                             direct_containment=args.direct_containment, packet_guard=args.packet_guard,
                             strict_isolation=args.strict_isolation, qos_link_mbps=args.qos_link_mbps)
    except (VrnicError, ValueError) as exc:
        print(f"vrnicd: {exc}", file=sys.stderr)
        return 2
    try:
        records = []
        for serial, text in enumerate(args.vrnic, start=1):
            spec, device = parse_vrnic(text, serial, quota)
            records.append(driver.create_vrnic(spec, device).model_dump(mode="json"))
        out = "".join(json.dumps(r) + "\n" for r in records)
        # What start-up made (pyverbs, pydantic, the driver) lives as long as the process: out of the cyclic GC's
        # sight, whose collections otherwise walked all of it every so often in the middle of a guest's verb
        # (`vrnic daemon` does the same).
        gc.collect()
        gc.freeze()
        if args.attach_out:
            partial = args.attach_out.with_suffix(".tmp")
            partial.write_text(out)
            partial.replace(args.attach_out)
        else:
            sys.stdout.write(out)
            sys.stdout.flush()
        log.info("serving %d vRNIC(s) on %s", len(records), args.socket)
        stop.wait()
        return 0
    except (VrnicError, ValueError) as exc:
        print(f"vrnicd: {exc}", file=sys.stderr)
        return 1
    finally:
        driver.close()
        log.info("released every vRNIC; bye")


if __name__ == "__main__":
    sys.exit(main())
