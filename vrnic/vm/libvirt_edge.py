"""The thin libvirt edge (libvirt-python): look up, read, define and hot-plug; libvirtError -> VrnicError here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vrnic.errors import Conflict, DeviceError, NotFound, NotSupported, VrnicError

DEFAULT_URI = "qemu:///system"


def _translate(exc: Exception, what: str) -> VrnicError:
    import libvirt

    code = exc.get_error_code() if isinstance(exc, libvirt.libvirtError) else None
    message = exc.get_error_message() if isinstance(exc, libvirt.libvirtError) else str(exc)
    if code == libvirt.VIR_ERR_NO_DOMAIN:
        return NotFound(f"no domain {what}")
    if code in (libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_ERR_OPERATION_FAILED):
        return Conflict(f"{what}: {message}")
    if code in (libvirt.VIR_ERR_NO_SUPPORT, libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED):
        return NotSupported(f"{what}: {message}")
    return DeviceError(f"libvirt: {what}: {message}")


class Domain:
    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self.name = name

    def persistent_xml(self) -> str:
        import libvirt

        try:
            return str(self._handle.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        except libvirt.libvirtError as exc:
            raise _translate(exc, self.name) from None

    def is_active(self) -> bool:
        import libvirt

        try:
            return bool(self._handle.isActive())
        except libvirt.libvirtError as exc:
            raise _translate(exc, self.name) from None

    def attach_device_live(self, device_xml: str) -> None:
        """Hot-plug into the running domain and its persistent definition."""
        import libvirt

        try:
            flags = libvirt.VIR_DOMAIN_AFFECT_LIVE | libvirt.VIR_DOMAIN_AFFECT_CONFIG
            self._handle.attachDeviceFlags(device_xml, flags)
        except libvirt.libvirtError as exc:
            raise _translate(exc, self.name) from None

    def resume_if_paused(self) -> bool:
        """Let a paused domain run (True); False if it runs already."""
        import libvirt

        try:
            state, _ = self._handle.state()
            if state != libvirt.VIR_DOMAIN_PAUSED:
                return False
            self._handle.resume()
            return True
        except libvirt.libvirtError as exc:
            raise _translate(exc, self.name) from None

    def detach_device_live(self, device_xml: str) -> None:
        import libvirt

        try:
            self._handle.detachDeviceFlags(device_xml, libvirt.VIR_DOMAIN_AFFECT_LIVE)
        except libvirt.libvirtError as exc:
            raise _translate(exc, self.name) from None


class Libvirt:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def domain(self, name: str) -> Domain:
        import libvirt

        try:
            return Domain(self._conn.lookupByName(name), name)
        except libvirt.libvirtError as exc:
            raise _translate(exc, name) from None

    def define(self, domain_xml: str, name: str) -> None:
        import libvirt

        try:
            self._conn.defineXML(domain_xml)
        except libvirt.libvirtError as exc:
            raise _translate(exc, name) from None


@contextmanager
def connect(uri: str = DEFAULT_URI) -> Iterator[Libvirt]:
    try:
        import libvirt
    except ImportError:
        raise NotSupported("libvirt-python is not installed (make setup)") from None
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise DeviceError(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}") from None
    try:
        yield Libvirt(conn)
    finally:
        conn.close()
