"""The libvirt qemu hook: `/etc/libvirt/hooks/qemu NAME OP SUBOP EXTRA`, the domain XML on stdin.

libvirtd runs the hook synchronously for prepare/start/started (begin), stopped/release (end),
migrate, restore, reconnect and attach; a non-zero exit of prepare/start refuses the start and
libvirt shows the hook's stderr to the caller. The hook must not call back into libvirtd (it would
deadlock), and it must exist when libvirtd starts. So everything it needs is in its arguments and
the XML: the vRNICs come from our `<metadata>` element (vrnic.vm.domain_xml), read by namespace.

Pure: `parse_hook_call(args, xml) -> HookEvent`, `decide(event, known) -> HookDecision`,
`hook_wrapper_script(...)`. Edge: `main()` (reads stdin, a JSON file of known vRNIC ids, appends
each event to a JSON-lines log, exits 1 with a message on refusal).
"""

from __future__ import annotations

import json
import shlex
import sys
import xml.etree.ElementTree as ET
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from vrnic.errors import InvalidArgument
from vrnic.vm.domain_xml import VRNIC_NS, VrnicAttachment
from vrnic.vm.guest_ram import libvirt_ram_file

REFUSE_EXIT = 1


class HookOp(StrEnum):
    PREPARE = "prepare"
    START = "start"
    STARTED = "started"
    STOPPED = "stopped"
    RELEASE = "release"
    MIGRATE = "migrate"
    RESTORE = "restore"
    RECONNECT = "reconnect"
    ATTACH = "attach"


# Ops whose failure stops the domain from starting: where vrnicd's admission check belongs.
GATING_OPS = frozenset({HookOp.PREPARE, HookOp.MIGRATE, HookOp.RESTORE})


class UnknownHookOp(InvalidArgument):
    """An op this vrnic does not know (a newer libvirt): the entry point lets it pass."""


@dataclass(frozen=True)
class HookEvent:
    domain: str
    domain_id: int | None  # the live id (<domain id='N'>), which names the RAM file; None when not running
    op: HookOp
    sub_op: str
    extra: str
    uuid: str | None
    vrnics: tuple[VrnicAttachment, ...]
    channels: tuple[tuple[str, str], ...]  # (virtio-serial port name, host unix socket path)
    shared_file_memory: bool  # <memoryBacking><source type='file'/><access mode='shared'/>

    def to_json(self) -> str:
        data = asdict(self)
        data["vrnics"] = [asdict(v) for v in self.vrnics]
        data["channels"] = [list(c) for c in self.channels]
        return json.dumps(data, sort_keys=True)


@dataclass(frozen=True)
class HookDecision:
    allow: bool
    message: str = ""


def _vrnics(root: ET.Element) -> tuple[VrnicAttachment, ...]:
    found = []
    for element in root.findall(f"metadata/{{{VRNIC_NS}}}vrnics/{{{VRNIC_NS}}}vrnic"):
        vrnic_id = element.get("id")
        if not vrnic_id:
            raise InvalidArgument("a vrnic metadata element has no id")
        found.append(VrnicAttachment(vrnic_id, element.get("channel") or VrnicAttachment(vrnic_id).channel))
    return tuple(found)


def _channels(root: ET.Element) -> tuple[tuple[str, str], ...]:
    found = []
    for channel in root.findall("devices/channel[@type='unix']"):
        target = channel.find("target[@type='virtio']")
        source = channel.find("source")
        if target is not None and source is not None and target.get("name") and source.get("path"):
            found.append((target.get("name", ""), source.get("path", "")))
    return tuple(found)


def _shared_file_memory(root: ET.Element) -> bool:
    backing = root.find("memoryBacking")
    if backing is None:
        return False
    source = backing.find("source")
    access = backing.find("access")
    return (source is not None and source.get("type") == "file"
            and access is not None and access.get("mode") == "shared")


def parse_hook_call(args: Sequence[str], stdin_xml: str) -> HookEvent:
    """args: NAME OP SUBOP EXTRA (without the program name); stdin_xml: what libvirtd wrote to stdin."""
    if len(args) != 4:
        raise InvalidArgument(f"the qemu hook takes NAME OP SUBOP EXTRA, got {list(args)}")
    name, op, sub_op, extra = args
    try:
        hook_op = HookOp(op)
    except ValueError:
        raise UnknownHookOp(f"unknown hook op {op!r}") from None
    try:
        root = ET.fromstring(stdin_xml)
    except ET.ParseError as exc:
        raise InvalidArgument(f"the hook's stdin is not XML: {exc}") from None
    if root.tag != "domain":
        raise InvalidArgument(f"expected a <domain> on stdin, got <{root.tag}>")
    if root.findtext("name") != name:
        raise InvalidArgument(f"argv names domain {name!r} but the XML names {root.findtext('name')!r}")
    raw_id = root.get("id")
    try:
        domain_id = int(raw_id) if raw_id is not None else None
    except ValueError:
        raise InvalidArgument(f"bad domain id {raw_id!r}") from None
    domain_id = domain_id if domain_id is None or domain_id > 0 else None  # -1: not running
    return HookEvent(domain=name, domain_id=domain_id, op=hook_op, sub_op=sub_op, extra=extra,
                     uuid=root.findtext("uuid"), vrnics=_vrnics(root), channels=_channels(root),
                     shared_file_memory=_shared_file_memory(root))


def decide(event: HookEvent, known_vrnics: Collection[str]) -> HookDecision:
    """Admission at the gating ops: every vRNIC must be known and have its channel; RAM must be a shared file."""
    if event.op not in GATING_OPS or not event.vrnics:
        return HookDecision(True)
    unknown = [v.vrnic_id for v in event.vrnics if v.vrnic_id not in known_vrnics]
    if unknown:
        return HookDecision(False, f"vrnic: unknown vRNIC(s) {', '.join(unknown)}; refusing to start {event.domain}")
    if not event.shared_file_memory:
        return HookDecision(False, f"vrnic: {event.domain} has vRNICs but its RAM is not a shared file "
                                   "(<memoryBacking><source type='file'/><access mode='shared'/>)")
    ports = {name for name, _ in event.channels}
    missing = [v.channel for v in event.vrnics if v.channel not in ports]
    if missing:
        return HookDecision(False, f"vrnic: {event.domain} lacks virtio-serial channel(s) {', '.join(missing)}")
    return HookDecision(True)


def hook_wrapper_script(python: Path, pythonpath: Path | None, known_file: Path, log_file: Path | None,
                        ram_dir: Path | None = None) -> str:
    """The /etc/libvirt/hooks/qemu text: libvirtd gives hooks a minimal environment, so set ours."""
    env = f"PYTHONPATH={shlex.quote(str(pythonpath))} " if pythonpath else ""
    log = f" --log {shlex.quote(str(log_file))}" if log_file else ""
    log += f" --memory-backing-dir {shlex.quote(str(ram_dir))}" if ram_dir else ""
    return (f"#!/bin/sh\n# vrnic libvirt hook (generated by vrnic.vm.hook); must not call back into libvirtd\n"
            f"exec env {env}{shlex.quote(str(python))} -m vrnic.vm.hook --known {shlex.quote(str(known_file))}"
            f'{log} -- "$@"\n')


def main(argv: Sequence[str] | None = None, stdin: str | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    paths: dict[str, Path] = {}
    while args and args[0] != "--":
        flag = args.pop(0)
        if flag in ("--known", "--log", "--memory-backing-dir") and args:
            paths[flag] = Path(args.pop(0))
        else:
            print(f"vrnic hook: bad option {flag!r}", file=sys.stderr)
            return 2
    args = args[1:] if args else []
    text = sys.stdin.read() if stdin is None else stdin
    try:
        event = parse_hook_call(args, text)
    except UnknownHookOp:
        return 0
    except InvalidArgument as exc:
        print(f"vrnic hook: {exc}", file=sys.stderr)
        return REFUSE_EXIT
    known_file, log_file, ram_dir = (paths.get(f) for f in ("--known", "--log", "--memory-backing-dir"))
    if log_file is not None:
        record = json.loads(event.to_json())
        if ram_dir is not None and event.domain_id is not None:
            # what vrnicd would map at `started`, found without asking libvirtd
            ram = libvirt_ram_file(ram_dir, event.domain_id, event.domain)
            record |= {"ram_file": str(ram), "ram_file_exists": ram.exists()}
        with log_file.open("a") as log:
            log.write(json.dumps(record, sort_keys=True) + "\n")
    known: list[str] = []
    if known_file is not None and known_file.exists():
        known = list(json.loads(known_file.read_text()))
    decision = decide(event, known)
    if not decision.allow:
        print(decision.message, file=sys.stderr)
        return REFUSE_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
