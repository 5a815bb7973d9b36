"""vrnic.vm.hook: the libvirt qemu hook's (argv, stdin XML) -> typed event -> admission decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vrnic.errors import InvalidArgument
from vrnic.vm.domain_xml import DirectKernelBoot, VirtioSerialChannel, VmDomain, VrnicAttachment
from vrnic.vm.hook import (
    HookOp,
    UnknownHookOp,
    decide,
    hook_wrapper_script,
    main,
    parse_hook_call,
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
    assert decide(event, known_vrnics=[]).allow


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


def test_decide() -> None:
    prepare = parse_hook_call(["vm1", "prepare", "begin", "-"], LIBVIRT_XML)
    assert decide(prepare, {"v-1"}).allow
    refused = decide(prepare, {"v-2"})
    assert not refused.allow and "unknown vRNIC(s) v-1" in refused.message
    # only the gating ops refuse; a stopped/release must always pass
    stopped = parse_hook_call(["vm1", "stopped", "end", "-"], LIBVIRT_XML)
    assert decide(stopped, set()).allow
    args = ["vm1", "prepare", "begin", "-"]
    private = parse_hook_call(args, LIBVIRT_XML.replace("mode='shared'", "mode='private'"))
    assert "not a shared file" in decide(private, {"v-1"}).message
    no_channel = parse_hook_call(args, LIBVIRT_XML.replace("name='org.vrnic.0'", "name='x'"))
    assert "lacks virtio-serial channel(s) org.vrnic.0" in decide(no_channel, {"v-1"}).message


def test_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known = tmp_path / "known.json"
    log = tmp_path / "events.jsonl"
    known.write_text(json.dumps(["v-1"]))
    ram = tmp_path / "libvirt" / "qemu" / "3-vm1" / "pc.ram"
    ram.parent.mkdir(parents=True)
    ram.write_bytes(b"")
    opts = ["--known", str(known), "--log", str(log), "--memory-backing-dir", str(tmp_path), "--"]
    assert main([*opts, "vm1", "prepare", "begin", "-"], LIBVIRT_XML) == 0
    known.write_text("[]")
    assert main([*opts, "vm1", "prepare", "begin", "-"], LIBVIRT_XML) == 1
    assert "unknown vRNIC(s) v-1" in capsys.readouterr().err
    assert main([*opts, "vm1", "future-op", "-", "-"], LIBVIRT_XML) == 0
    assert main(["--bogus"], "") == 2
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["op"] for r in records] == ["prepare", "prepare"]
    assert records[0]["ram_file"] == str(ram) and records[0]["ram_file_exists"]


def test_wrapper_script() -> None:
    text = hook_wrapper_script(Path("/opt/v/bin/python"), Path("/work/wt"), Path("/run/k.json"), Path("/run/l"),
                               Path("/ram"))
    assert text.startswith("#!/bin/sh\n")
    assert text.endswith('exec env PYTHONPATH=/work/wt /opt/v/bin/python -m vrnic.vm.hook --known /run/k.json'
                         ' --log /run/l --memory-backing-dir /ram -- "$@"\n')
