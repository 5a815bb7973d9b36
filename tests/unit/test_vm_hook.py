"""vrnic.vm.hook: the libvirt qemu hook's (argv, stdin XML) -> typed event -> admission decision."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vrnic.errors import ApiError, InvalidArgument, Unavailable
from vrnic.vm.domain_xml import DirectKernelBoot, VirtioSerialChannel, VmDomain, VrnicAttachment
from vrnic.vm.hook import (
    HookOp,
    IncomingDomains,
    UnknownHookOp,
    binding_for,
    check_xml,
    hook_wrapper_script,
    main,
    parse_hook_call,
    run_hook,
)

BOOT = DirectKernelBoot(kernel=Path("/boot/vmlinuz"))

# What libvirtd 9.0 hands the hook: its own formatting, with our metadata re-prefixed and extra elements.
LIBVIRT_XML = """<domain type='kvm' id='3'>
  <name>vm1</name>
  <uuid>757fef6f-c10c-4ed2-b625-46ea44233d94</uuid>
  <metadata>
    <ns0:vrnics xmlns:ns0="https://vrnic.dev/xmlns/vrnic/1">
      <ns0:vrnic id="v-1" channel="org.vrnic.0"/>
    </ns0:vrnics>
    <other:thing xmlns:other="https://example.org/other"><other:vrnic id="not-ours"/></other:thing>
  </metadata>
  <memory unit='KiB'>262144</memory>
  <memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <channel type='unix'>
      <source mode='bind' path='/run/vm1.sock'/>
      <target type='virtio' name='org.vrnic.0'/>
      <alias name='channel0'/>
    </channel>
    <channel type='pty'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
  </devices>
</domain>"""


def test_parse_libvirt_xml() -> None:
    event = parse_hook_call(["vm1", "prepare", "begin", "-"], LIBVIRT_XML)
    assert event.domain == "vm1"
    assert event.domain_id == 3
    assert event.op is HookOp.PREPARE
    assert (event.sub_op, event.extra) == ("begin", "-")
    assert event.uuid == "757fef6f-c10c-4ed2-b625-46ea44233d94"
    assert event.vrnics == (VrnicAttachment("v-1", "org.vrnic.0"),)
    assert event.channels == (("org.vrnic.0", "/run/vm1.sock"),)
    assert event.shared_file_memory


def test_round_trip_of_our_own_xml() -> None:
    domain = VmDomain(name="vm2", boot=BOOT, vrnics=(VrnicAttachment("a"), VrnicAttachment("b", "org.vrnic.1")),
                      channels=(VirtioSerialChannel(Path("/s0")), VirtioSerialChannel(Path("/s1"), "org.vrnic.1")))
    event = parse_hook_call(["vm2", "release", "end", "-"], domain.to_xml())
    assert [v.vrnic_id for v in event.vrnics] == ["a", "b"]
    assert event.channels == (("org.vrnic.0", "/s0"), ("org.vrnic.1", "/s1"))
    assert json.loads(event.to_json())["vrnics"][1] == {"vrnic_id": "b", "channel": "org.vrnic.1"}


def test_domain_without_vrnics() -> None:
    xml = "<domain type='kvm'><name>plain</name></domain>"
    event = parse_hook_call(["plain", "start", "begin", "-"], xml)
    assert event.vrnics == () and not event.shared_file_memory and event.uuid is None and event.domain_id is None
    assert parse_hook_call(["plain", "stopped", "end", "-"], xml.replace("'kvm'", "'kvm' id='-1'")).domain_id is None
    assert check_xml(event) is None


@pytest.mark.parametrize("args, xml, message", [
    (["vm1", "prepare", "begin"], LIBVIRT_XML, "NAME OP SUBOP EXTRA"),
    (["vm1", "prepare", "begin", "-"], "not xml", "not XML"),
    (["vm1", "prepare", "begin", "-"], "<network><name>vm1</name></network>", "<domain>"),
    (["other", "prepare", "begin", "-"], LIBVIRT_XML, "names 'vm1'"),
    (["vm1", "prepare", "begin", "-"], LIBVIRT_XML.replace('id="v-1" ', ""), "no id"),
    (["vm1", "prepare", "begin", "-"], LIBVIRT_XML.replace("id='3'", "id='x'"), "bad domain id"),
])
def test_bad_calls(args: list[str], xml: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_hook_call(args, xml)


def test_unknown_op_is_its_own_error() -> None:
    with pytest.raises(UnknownHookOp):
        parse_hook_call(["vm1", "future-op", "begin", "-"], LIBVIRT_XML)


class FakeApi:
    """The REST API as the hook sees it: records each request, answers from a script."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.fail = fail or {}

    def request(self, method: str, path: str, *, json_body: Any = None) -> Any:
        self.requests.append((method, path, json_body))
        if method in self.fail:
            raise self.fail[method]
        return {"unbound": ["v-1"]} if method == "DELETE" else {}


def test_check_xml() -> None:
    prepare = parse_hook_call(["vm1", "prepare", "begin", "-"], LIBVIRT_XML)
    assert check_xml(prepare) is None
    args = ["vm1", "prepare", "begin", "-"]
    private = parse_hook_call(args, LIBVIRT_XML.replace("mode='shared'", "mode='private'"))
    assert "not a shared file" in (check_xml(private) or "")
    no_channel = parse_hook_call(args, LIBVIRT_XML.replace("name='org.vrnic.0'", "name='x'"))
    assert "lacks virtio-serial channel(s) org.vrnic.0" in (check_xml(no_channel) or "")


def test_binding_for_a_running_domain() -> None:
    started = parse_hook_call(["vm1", "started", "begin", "-"], LIBVIRT_XML.replace("<memory", "<os><type "
                              "arch='x86_64' machine='pc-q35-7.2'>hvm</type></os><memory"))
    binding = binding_for(started, Path("/ram"))
    assert binding == {
        "domain": "vm1", "uuid": "757fef6f-c10c-4ed2-b625-46ea44233d94", "machine": "pc-q35-7.2",
        "ram_path": "/ram/libvirt/qemu/3-vm1/pc.ram",
        "vrnics": [{"vrnic_id": "v-1", "channel_socket": "/run/vm1.sock"}]}
    with pytest.raises(InvalidArgument, match="not running"):
        binding_for(parse_hook_call(["vm1", "started", "begin", "-"], LIBVIRT_XML.replace("id='3'", "id='-1'")),
                    Path("/ram"))


def _run(op: str, api: FakeApi, xml: str = LIBVIRT_XML, tmp: Path | None = None) -> tuple[str, str | None]:
    text = xml.replace("/run/vm1.sock", str(tmp / "ch" / "vm1.sock")) if tmp else xml
    return run_hook(parse_hook_call(["vm1", op, "-", "-"], text), api, Path("/ram"))  # type: ignore[arg-type]


def test_every_op(tmp_path: Path) -> None:
    api = FakeApi()
    assert _run("prepare", api, tmp=tmp_path) == ("allowed", None)
    assert (tmp_path / "ch").is_dir()  # QEMU binds the channel there: the hook made the directory
    assert api.requests[-1] == ("POST", "/vms/vm1/admission", {"vrnic_ids": ["v-1"]})
    assert _run("start", api) == ("passed", None)
    assert _run("started", api) == ("bound", None)
    method, path, body = api.requests[-1]
    assert (method, path, body["ram_path"], body["vrnics"]) == (
        "PUT", "/vms/vm1/binding", "/ram/libvirt/qemu/3-vm1/pc.ram", [{"vrnic_id": "v-1", "channel_socket":
                                                                       "/run/vm1.sock"}])
    assert _run("reconnect", api)[0] == "bound"
    assert _run("stopped", api) == ("unbound", None)
    assert _run("release", api) == ("unbound", None)
    assert api.requests[-1] == ("DELETE", "/vms/vm1/binding", None)
    outcome, message = _run("migrate", api)
    assert outcome == "refused" and "migration" in (message or "")
    assert _run("restore", api) == ("passed", None)
    # a domain without vRNICs: nothing asked, except the unbind at the end (harmless, never refused)
    plain = FakeApi()
    bare = LIBVIRT_XML.replace('<ns0:vrnic id="v-1" channel="org.vrnic.0"/>', "")
    assert [_run(op, plain, bare)[0] for op in ("prepare", "started", "migrate")] == ["passed"] * 3
    assert plain.requests == []


def test_failures_refuse_the_gating_ops_and_never_the_end_ops() -> None:
    refused = ApiError(404, {"code": "not_found", "detail": "vRNIC v-1 does not exist; refusing to start vm1"})
    api = FakeApi({"POST": refused, "PUT": refused})
    assert _run("prepare", api) == ("refused", "vrnic: vRNIC v-1 does not exist; refusing to start vm1")
    assert _run("started", api)[0] == "refused"
    down = FakeApi({"POST": Unavailable("connection refused"), "DELETE": Unavailable("refused")})
    outcome, message = _run("prepare", down)
    assert outcome == "refused" and "not reachable" in (message or "")
    assert _run("stopped", down)[0] == "error"  # logged; libvirt goes on stopping the domain


def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "events.jsonl"
    opts = ["--log", str(log), "--memory-backing-dir", str(tmp_path), "--"]
    assert main([*opts, "vm1", "started", "begin", "-"], LIBVIRT_XML, api=FakeApi()) == 0
    refusal = ApiError(409, {"code": "conflict", "detail": "vRNIC v-1 was released; refusing to start vm1"})
    assert main([*opts, "vm1", "started", "begin", "-"], LIBVIRT_XML, api=FakeApi({"PUT": refusal})) == 1
    assert "vRNIC v-1 was released; refusing to start vm1" in capsys.readouterr().err
    assert main([*opts, "vm1", "future-op", "-", "-"], LIBVIRT_XML, api=FakeApi()) == 0
    assert main(["--bogus"], "") == 2
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["op"], r["outcome"], r["domain"]) for r in records] == [("started", "bound", "vm1"),
                                                                        ("started", "refused", "vm1")]
    assert records[1]["error"].startswith("vrnic: vRNIC v-1 was released") and records[0]["duration_ms"] >= 0
    assert records[0]["process_ms"] >= records[0]["duration_ms"]  # this test process began long before the call


def test_wrapper_script_and_chaining(tmp_path: Path) -> None:
    text = hook_wrapper_script(Path("/opt/v/bin/python"), Path("/work/wt"), "http://127.0.0.1:8470",
                               Path("/var/lib/vrnic/operator-token"), Path("/ram"), Path("/run/l"))
    assert text.startswith("#!/bin/sh\n")
    assert text.endswith("exec env VRNIC_API_URL=http://127.0.0.1:8470 VRNIC_API_TOKEN_FILE=/var/lib/vrnic/"
                         "operator-token PYTHONPATH=/work/wt /opt/v/bin/python -m vrnic.vm.hook "
                         '--memory-backing-dir /ram --log /run/l -- "$@"\n')
    # chained: the earlier hook sees the same arguments and stdin, and its failure is final
    seen = tmp_path / "seen"
    earlier = tmp_path / "qemu.vrnic-chained"
    earlier.write_text(f'#!/bin/sh\necho "$@" > {seen}; cat >> {seen}; exit ${{EARLIER_RC:-0}}\n')
    earlier.chmod(0o755)
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\necho "ours: $@" >> {seen}; cat >> {seen}\n')
    fake_python.chmod(0o755)
    script = tmp_path / "qemu"
    script.write_text(hook_wrapper_script(fake_python, None, "http://x", None, Path("/ram"), None, earlier))
    script.chmod(0o755)
    ok = subprocess.run([str(script), "vm1", "prepare", "begin", "-"], input="<domain/>", text=True,
                        capture_output=True)
    assert ok.returncode == 0, ok.stderr
    assert seen.read_text() == ("vm1 prepare begin -\n<domain/>"
                                "ours: -m vrnic.vm.hook --memory-backing-dir /ram -- vm1 prepare begin -\n<domain/>")
    failed = subprocess.run([str(script), "vm1", "prepare", "begin", "-"], input="<domain/>", text=True,
                            capture_output=True, env={**os.environ, "EARLIER_RC": "3"})
    assert failed.returncode == 3
    assert "ours" not in seen.read_text()


class ScriptedApi(FakeApi):
    """FakeApi with fixed answers to GETs (the hook locating a migrating domain's source)."""

    def __init__(self, answers: dict[str, Any], unbound: list[str] | None = None) -> None:
        super().__init__()
        self.answers = answers
        self.unbound = unbound or []

    def request(self, method: str, path: str, *, json_body: Any = None) -> Any:
        self.requests.append((method, path, json_body))
        if method == "GET":
            return self.answers[path]
        return {"unbound": self.unbound} if method == "DELETE" else {}


def _dest_api(served: list[str] | None = None) -> ScriptedApi:
    return ScriptedApi({"/vms": {"items": [{"domain": d} for d in served or []]}, "/health": {"host": "b"},
                        "/vrnics/v-1": {"host": "a"}, "/hosts/a": {"api_url": "http://10.77.0.1:8470"}})


def test_a_migration_to_this_host_prepares_the_hand_over_on_the_source(tmp_path: Path) -> None:
    incoming = IncomingDomains(tmp_path / "state")
    local, source = _dest_api(), FakeApi()
    remotes: list[str] = []

    def remote(url: str) -> FakeApi:
        remotes.append(url)
        return source

    def run(op: str, api: FakeApi = local) -> tuple[str, str | None]:
        xml = LIBVIRT_XML.replace("/run/vm1.sock", str(tmp_path / "ch" / "vm1.sock"))
        return run_hook(parse_hook_call(["vm1", op, "-", "-"], xml), api, Path("/ram"), incoming, remote)

    assert run("migrate") == ("allowed", None)
    assert incoming.get("vm1") == {"source": "a", "source_url": "http://10.77.0.1:8470", "here": "b"}
    assert run("prepare") == ("allowed", None)  # no admission here: the vRNIC lives on a until the hand-over
    assert (tmp_path / "ch").is_dir() and all(m == "GET" for m, _, _ in local.requests)
    assert run("start") == ("passed", None)
    assert run("started") == ("handover_prepared", None)
    method, path, body = source.requests[-1]
    assert (remotes[-1], method, path, body["host"]) == ("http://10.77.0.1:8470", "POST", "/vms/vm1/handover", "b")
    assert body["binding"]["ram_path"] == "/ram/libvirt/qemu/3-vm1/pc.ram"
    # the migration failed: b's QEMU stops without having been served here, a's hand-over is called off
    assert run("stopped") == ("handover_called_off", None)
    assert source.requests[-1] == ("DELETE", "/vms/vm1/handover", None) and incoming.get("vm1") is None
    assert run("release") == ("passed", None)
    # it arrived (served here), then stops much later: nothing to call off
    assert run("migrate") == ("allowed", None)
    served = _dest_api()
    served.unbound = ["v-1"]
    calls = len(source.requests)
    assert run("stopped", served) == ("unbound", None)
    assert len(source.requests) == calls and incoming.get("vm1") is None


def test_a_migration_is_refused_when_the_domain_is_here_or_its_vrnic_is(tmp_path: Path) -> None:
    incoming = IncomingDomains(tmp_path)
    migrate = parse_hook_call(["vm1", "migrate", "begin", "-"], LIBVIRT_XML)
    outcome, message = run_hook(migrate, _dest_api(served=["vm1"]), Path("/ram"), incoming, lambda _: FakeApi())
    assert outcome == "refused" and "migration of vm1" in (message or "") and "same host" in (message or "")
    here = _dest_api()
    here.answers["/vrnics/v-1"] = {"host": "b"}
    outcome, message = run_hook(migrate, here, Path("/ram"), incoming, lambda _: FakeApi())
    assert outcome == "refused" and "this host already" in (message or "")
    assert incoming.get("vm1") is None


def test_main_remembers_an_incoming_domain_in_its_state_dir(tmp_path: Path) -> None:
    source = FakeApi()
    opts = ["--state-dir", str(tmp_path / "state"), "--memory-backing-dir", "/ram", "--"]
    assert main([*opts, "vm1", "migrate", "begin", "-"], LIBVIRT_XML, api=_dest_api(), remote=lambda _: source) == 0
    assert IncomingDomains(tmp_path / "state").get("vm1") == {"source": "a", "source_url": "http://10.77.0.1:8470",
                                                              "here": "b"}
    assert main([*opts, "vm1", "started", "begin", "-"], LIBVIRT_XML, api=_dest_api(), remote=lambda _: source) == 0
    assert source.requests[-1][:2] == ("POST", "/vms/vm1/handover")
