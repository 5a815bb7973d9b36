"""The libvirt tier has a real libvirtd that runs TCG domains with QEMU."""

from __future__ import annotations

from typing import Any

from vrnic.lab.kernel import choose_kernel, installed_kernels, kernel_image

DOMAIN = """<domain type='qemu'>
  <name>vrnic-tier-probe</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type><kernel>{kernel}</kernel><cmdline>console=ttyS0</cmdline></os>
  <features><acpi/></features>
  <devices><serial type='pty'/></devices>
</domain>"""


def test_transient_tcg_domain_runs_and_is_destroyed(libvirt_conn: Any) -> None:
    import libvirt

    kernel = kernel_image(choose_kernel(installed_kernels()))
    domain = libvirt_conn.createXML(DOMAIN.format(kernel=kernel), 0)
    try:
        state, _ = domain.state()
        assert state == libvirt.VIR_DOMAIN_RUNNING
        assert domain.name() in [d.name() for d in libvirt_conn.listAllDomains()]
    finally:
        domain.destroy()
    assert "vrnic-tier-probe" not in [d.name() for d in libvirt_conn.listAllDomains()]
