"""The libvirt qemu hook: `/etc/libvirt/hooks/qemu NAME OP SUBOP EXTRA`, the domain XML on stdin.

libvirtd runs the hook synchronously: prepare/start/started (begin), stopped/release (end),
migrate, restore, reconnect and attach. A non-zero exit at prepare (or started, or migrate) stops the
domain, and libvirt shows the hook's stderr to the caller (`virsh start`). The hook must not call back
into libvirtd (it would deadlock) and must exist when libvirtd starts. Everything it needs is in its
arguments and the XML: the vRNICs come from our `<metadata>` element (vrnic.vm.domain_xml), read by
namespace. It asks vrnicd through the REST API (operator token), quickly:

- prepare: the XML has what a vRNIC needs (shared file memory, a channel per vRNIC), the channels'
  socket directories exist, and the API admits the vRNICs (they exist, are live, and belong to this
  domain or to none);
- started, reconnect: vrnicd binds the VM (maps its RAM, connects its channels), all or nothing;
- stopped, release: vrnicd unbinds it (every kernel object released); never refuses;
- migrate (on the destination, before its QEMU starts): a live migration from the host the vRNICs live on.
  The hook finds that host through the API, remembers the incoming domain in its state dir, and lets the
  destination's prepare (the XML checked, no admission: the vRNICs still live on the source) and started
  (POST /vms/{domain}/handover on the source's API with this host's binding: the source's vrnicd starts its
  dirty logs and this host's vrnicd pre-sets-up the vRNICs) through. A domain served on this host is refused.
- the switchover: libvirt has no hook between QEMU's last pass and the destination's vCPUs running, so the
  operator runs `virsh migrate --live --suspend`: the destination stays paused, the source's QEMU ends (its
  libvirt Confirm step), its hook's stopped call makes the source's vrnicd hand the vRNICs over (instead of
  releasing them), and the destination's vrnicd resumes the domain once it serves them (VRNIC_LIBVIRT_URI).
- stopped/release of an incoming domain that never got its vRNICs (the migration failed): the source's
  hand-over is called off, the source serves on.

Pure: `parse_hook_call(args, xml) -> HookEvent`, `check_xml`, `binding_for`, `hook_wrapper_script`.
Edge: `run_hook` (the REST calls) and `main()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from vrnic.errors import ApiError, InvalidArgument, Unavailable
from vrnic.vm.domain_xml import VRNIC_NS, VrnicAttachment
from vrnic.vm.guest_ram import libvirt_ram_file

# libvirtd waits for the hook at every op of every domain: it imports only the standard library, the XML readers
# and its REST client on http.client (vrnic.vm.hook_client). httpx and pydantic cost seconds under the lab's TCG.

REFUSE_EXIT = 1
DEFAULT_MEMORY_BACKING_DIR = Path("/var/lib/libvirt/qemu/ram")  # libvirt's default memory_backing_dir


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
    machine: str = "q35"  # <os><type machine=...>: QEMU's RAM layout follows it

    def to_json(self) -> str:
        data = asdict(self)
        data["vrnics"] = [asdict(v) for v in self.vrnics]
        data["channels"] = [list(c) for c in self.channels]
        return json.dumps(data, sort_keys=True)


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
    os_type = root.find("os/type")
    machine = os_type.get("machine") if os_type is not None else None
    return HookEvent(domain=name, domain_id=domain_id, op=hook_op, sub_op=sub_op, extra=extra,
                     uuid=root.findtext("uuid"), vrnics=_vrnics(root), channels=_channels(root),
                     shared_file_memory=_shared_file_memory(root), machine=machine or "q35")


def check_xml(event: HookEvent) -> str | None:
    """What the domain's XML lacks for its vRNICs (None: nothing): shared file RAM, a channel per vRNIC."""
    if not event.vrnics:
        return None
    if not event.shared_file_memory:
        return (f"vrnic: {event.domain} has vRNICs but its RAM is not a shared file "
                "(<memoryBacking><source type='file'/><access mode='shared'/>)")
    ports = {name for name, _ in event.channels}
    missing = [v.channel for v in event.vrnics if v.channel not in ports]
    if missing:
        return f"vrnic: {event.domain} lacks virtio-serial channel(s) {', '.join(missing)}"
    return None


def binding_for(event: HookEvent, memory_backing_dir: Path) -> dict[str, Any]:
    """What vrnicd needs to serve the running domain (its live id names the RAM file): the JSON of a
    vrnic.core.specs.VmBinding, which the API validates."""
    if event.domain_id is None:
        raise InvalidArgument(f"{event.domain} is not running (no domain id): nothing to bind")
    sockets = dict(event.channels)
    return {"domain": event.domain, "uuid": event.uuid, "machine": event.machine,
            "ram_path": str(libvirt_ram_file(memory_backing_dir, event.domain_id, event.domain)),
            "vrnics": [{"vrnic_id": v.vrnic_id, "channel_socket": sockets[v.channel]} for v in event.vrnics]}


class HookApi(Protocol):
    def request(self, method: str, path: str, *, json_body: Any = None) -> Any: ...


RemoteApi = Callable[[str], HookApi]  # another host's API, by its URL (the source's, for a migration)
DEFAULT_STATE_DIR = Path("/run/vrnic/hook")
HANDOVER_TIMEOUT_S = 120.0  # a stopped call may wait for the hand-over of a migrated VM (a loaded lab: seconds)


class IncomingDomains:
    """Domains migrating to this host, from the hook's migrate call to their stop: the source's host and API."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def _path(self, domain: str) -> Path:
        return self.state_dir / f"incoming-{domain}.json"

    def remember(self, domain: str, source: dict[str, str]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._path(domain).write_text(json.dumps(source))

    def get(self, domain: str) -> dict[str, str] | None:
        try:
            found: dict[str, str] = json.loads(self._path(domain).read_text())
        except (OSError, ValueError):
            return None
        return found

    def forget(self, domain: str) -> None:
        self._path(domain).unlink(missing_ok=True)


def _locate_source(event: HookEvent, api: HookApi) -> dict[str, str]:
    """Where the migrating domain's vRNICs live (their host, its API URL) and this host's name."""
    domain = quote(event.domain, safe="")
    served = api.request("GET", "/vms") or {}
    if any(b.get("domain") == event.domain for b in served.get("items", [])):
        raise InvalidArgument(f"{event.domain} is served on this host: a migration to the same host is refused")
    here = str((api.request("GET", "/health") or {}).get("host"))
    hosts = {str(api.request("GET", f"/vrnics/{quote(v.vrnic_id, safe='')}")["host"]) for v in event.vrnics}
    if len(hosts) != 1:
        raise InvalidArgument(f"the vRNICs of {domain} live on several hosts ({', '.join(sorted(hosts))})")
    source = hosts.pop()
    if source == here:
        raise InvalidArgument(f"the vRNICs of {event.domain} live on this host already")
    host = api.request("GET", f"/hosts/{quote(source, safe='')}")
    if not host.get("api_url"):
        raise InvalidArgument(f"host {source}, where the vRNICs of {event.domain} live, has no agent URL")
    return {"source": source, "source_url": str(host["api_url"]), "here": here}


def _incoming_hook(event: HookEvent, api: HookApi, memory_backing_dir: Path, incoming: IncomingDomains,
                   remote: RemoteApi) -> tuple[str, str | None]:
    """migrate, and prepare/started of a domain that migrates here; its start passes through (see the module)."""
    domain = quote(event.domain, safe="")
    if event.op is HookOp.MIGRATE:
        problem = check_xml(event)
        if problem:
            return "refused", problem
        incoming.remember(event.domain, _locate_source(event, api))
        return "allowed", None
    source = incoming.get(event.domain)
    assert source is not None
    if event.op is HookOp.PREPARE:
        problem = check_xml(event)
        if problem:
            return "refused", problem
        for _, socket_path in event.channels:
            Path(socket_path).parent.mkdir(parents=True, exist_ok=True)
        return "allowed", None
    if event.op is HookOp.STARTED:
        binding = binding_for(event, memory_backing_dir)
        remote(source["source_url"]).request("POST", f"/vms/{domain}/handover",
                                             json_body={"host": source["here"], "binding": binding})
        return "handover_prepared", None
    return "passed", None


def passes_through(event: HookEvent) -> bool:
    """The call has nothing for vrnic to do: a domain without vRNICs, or start, restore or attach (the vRNICs are
    admitted at prepare and bound at started, a migrating domain's included). stopped and release always ask:
    their XML is not trusted to list every vRNIC."""
    if event.op in (HookOp.STOPPED, HookOp.RELEASE):
        return False
    return not event.vrnics or event.op not in (HookOp.PREPARE, HookOp.STARTED, HookOp.RECONNECT, HookOp.MIGRATE)


def run_hook(event: HookEvent, api: HookApi, memory_backing_dir: Path, incoming: IncomingDomains | None = None,
             remote: RemoteApi | None = None) -> tuple[str, str | None]:
    """Do the vRNIC's part of one hook call: (outcome, the refusal to print, if any).

    outcome: passed (nothing to do), allowed, refused, bound, unbound, handover_prepared, handover_called_off,
    error (logged, not refused). incoming and remote: for migrations to this host (None: migrations refused).
    """
    if passes_through(event):
        return "passed", None
    domain = quote(event.domain, safe="")
    if event.op in (HookOp.STOPPED, HookOp.RELEASE):
        try:  # at stopped/release the XML has no vRNIC list we can trust to be complete: always ask
            result = api.request("DELETE", f"/vms/{domain}/binding")
        except (ApiError, Unavailable) as exc:
            return "error", f"vrnic: could not unbind {event.domain}: {exc}"
        unbound = bool(result and result.get("unbound"))
        source = incoming.get(event.domain) if incoming is not None else None
        if incoming is not None and source is not None and remote is not None:
            incoming.forget(event.domain)
            if not unbound:  # it stops here without ever having been served here: the migration failed
                try:
                    remote(source["source_url"]).request("DELETE", f"/vms/{domain}/handover")
                except (ApiError, Unavailable) as exc:
                    return "error", f"vrnic: could not call off {event.domain}'s hand-over on {source['source']}: {exc}"
                return "handover_called_off", None
        return ("unbound" if unbound else "passed"), None
    migrating_here = incoming is not None and remote is not None and (
        event.op is HookOp.MIGRATE or (event.op in (HookOp.PREPARE, HookOp.STARTED)
                                       and incoming.get(event.domain) is not None))
    if event.op is HookOp.MIGRATE and not migrating_here:
        return "refused", (f"vrnic: libvirt migration of a VM with a vRNIC needs the hook's state dir and the other "
                           f"hosts' API (vrnic.vm.hook.main); {event.domain} has "
                           f"{', '.join(v.vrnic_id for v in event.vrnics)}")
    try:
        if migrating_here:
            assert incoming is not None and remote is not None
            return _incoming_hook(event, api, memory_backing_dir, incoming, remote)
        if event.op is HookOp.PREPARE:
            problem = check_xml(event)
            if problem:
                return "refused", problem
            for _, socket_path in event.channels:
                Path(socket_path).parent.mkdir(parents=True, exist_ok=True)
            api.request("POST", f"/vms/{domain}/admission",
                        json_body={"vrnic_ids": [v.vrnic_id for v in event.vrnics]})
            return "allowed", None
        if event.op in (HookOp.STARTED, HookOp.RECONNECT):
            binding = binding_for(event, memory_backing_dir)
            api.request("PUT", f"/vms/{domain}/binding", json_body=binding)
            return "bound", None
    except ApiError as exc:
        detail = exc.problem.get("detail") or str(exc)
        return "refused", f"vrnic: {detail}"
    except Unavailable as exc:
        return "refused", f"vrnic: vrnicd is not reachable ({exc}); refusing {event.op} of {event.domain}"
    except (InvalidArgument, OSError) as exc:
        what = "migration of " if event.op is HookOp.MIGRATE else ""
        return "refused", f"vrnic: {what}{event.domain}: {exc}"
    return "passed", None


MARKER = "# vrnic libvirt hook (generated by `vrnic hook install`)"
CHAINED_SUFFIX = ".vrnic-chained"


def hook_wrapper_script(python: Path, pythonpath: Path | None, api_url: str, token_file: Path | None,
                        memory_backing_dir: Path, log_file: Path | None, chained: Path | None = None) -> str:
    """The /etc/libvirt/hooks/qemu text. libvirtd gives hooks only LC_ALL, PATH and HOME, so it sets ours.

    chained: a hook that was there before; it runs first, with the same arguments and stdin, and its
    failure is the hook's failure.
    """
    env = [f"VRNIC_API_URL={shlex.quote(api_url)}"]
    if token_file is not None:
        env.append(f"VRNIC_API_TOKEN_FILE={shlex.quote(str(token_file))}")
    if pythonpath is not None:
        env.append(f"PYTHONPATH={shlex.quote(str(pythonpath))}")
    options = f"--memory-backing-dir {shlex.quote(str(memory_backing_dir))}"
    if log_file is not None:
        options += f" --log {shlex.quote(str(log_file))}"
    lines = ["#!/bin/sh", MARKER, "# It must not call back into libvirtd. `vrnic hook uninstall` restores what was "
             "here before."]
    stdin = "-"
    if chained is not None:
        lines += ['xml=$(mktemp) || exit 1', 'trap \'rm -f "$xml"\' EXIT', 'cat > "$xml"',
                  f'{shlex.quote(str(chained))} "$@" < "$xml" || exit $?']
        stdin = '"$xml"'
        lines.append(f'env {" ".join(env)} {shlex.quote(str(python))} -m vrnic.vm.hook {options} -- "$@" < {stdin}')
    else:
        lines.append(f'exec env {" ".join(env)} {shlex.quote(str(python))} -m vrnic.vm.hook {options} -- "$@"')
    return "\n".join(lines) + "\n"


def process_age_ms() -> float | None:
    """How long ago this process started (the interpreter's start and the imports included: what libvirtd waits
    for), at the kernel clock's 10 ms grain; None where /proc says nothing."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime, after the comm field
        return (time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")) * 1000
    except (OSError, ValueError, IndexError):
        return None


def _clients_from_environ() -> tuple[HookApi, RemoteApi]:
    """This host's API and, by URL, other hosts' (the same operator token), as the wrapper script sets them."""
    from vrnic.vm.hook_client import HookClient, HookClientSettings

    settings = HookClientSettings.from_environ(os.environ)
    client = HookClient(replace(settings, timeout=max(settings.timeout, HANDOVER_TIMEOUT_S)))
    return client, client.with_url


def main(argv: Sequence[str] | None = None, stdin: str | None = None, api: HookApi | None = None,
         remote: RemoteApi | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options: dict[str, str] = {}
    while args and args[0] != "--":
        flag = args.pop(0)
        if flag in ("--log", "--memory-backing-dir", "--state-dir") and args:
            options[flag] = args.pop(0)
        else:
            print(f"vrnic hook: bad option {flag!r}", file=sys.stderr)
            return 2
    args = args[1:] if args else []
    text = sys.stdin.read() if stdin is None else stdin
    started = time.monotonic()
    try:
        event = parse_hook_call(args, text)
    except UnknownHookOp:
        return 0
    except InvalidArgument as exc:
        print(f"vrnic hook: {exc}", file=sys.stderr)
        return REFUSE_EXIT
    ram_dir = Path(options.get("--memory-backing-dir", str(DEFAULT_MEMORY_BACKING_DIR)))
    outcome, message = "passed", None
    if not passes_through(event):
        try:
            if api is None:
                api, remote = _clients_from_environ()
        except InvalidArgument as exc:  # a bad URL or timeout: the end ops never refuse
            ending = event.op in (HookOp.STOPPED, HookOp.RELEASE)
            outcome, message = ("error" if ending else "refused"), f"vrnic: {exc}"
        else:
            incoming = IncomingDomains(Path(options.get("--state-dir", str(DEFAULT_STATE_DIR))))
            outcome, message = run_hook(event, api, ram_dir, incoming, remote)
    record = {"domain": event.domain, "op": str(event.op), "sub_op": event.sub_op, "domain_id": event.domain_id,
              "vrnics": [v.vrnic_id for v in event.vrnics], "outcome": outcome,
              "duration_ms": (time.monotonic() - started) * 1000, "process_ms": process_age_ms(), "error": message}
    if "--log" in options:
        with contextlib.suppress(OSError), open(options["--log"], "a") as log:
            log.write(json.dumps(record, sort_keys=True) + "\n")
    if message:
        print(message, file=sys.stderr)  # libvirtd logs it with the domain name; virsh shows a refusal
    return REFUSE_EXIT if outcome == "refused" else 0


if __name__ == "__main__":
    raise SystemExit(main())
