"""Both ends QEMU gives vrnicd, played by unit tests: a RAM file laid out like a q35 VM's, a listening Unix
socket for the virtio-serial port, and the guest's end of both (the real frontend over that socket, with an
arena that is a window of the RAM file addressed by guest-physical address)."""

from __future__ import annotations

import mmap
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vrnic.core.rings import index_words
from vrnic.core.specs import VmBinding, VmVrnic
from vrnic.frontend import Context
from vrnic.frontend.channel import Channel
from vrnic.frontend.memory import Arena, ArenaAllocator

RAM = 4 << 20
WINDOW = (0x200000, 1 << 20)  # the guest's arena: 1 MiB at GPA 2 MiB


class SocketChannel(Channel):
    """The guest's end of the port, here the other end of QEMU's socket."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    def _send(self, data: bytes, fds: list[int] | None) -> None:
        self.sock.sendall(data)

    def _recv(self) -> bytes:
        return self.sock.recv(65536)

    def close(self) -> None:
        pass  # the port stays: the next guest program opens it again


class RamWindow(Arena):
    """A window of the VM's RAM file, addressed by guest-physical address."""

    def __init__(self, path: Path, gpa: int, size: int) -> None:
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.gpa, self.size = gpa, size
        self.view = memoryview(self._map)[gpa:gpa + size]
        self.words = index_words(self.view)
        self.allocator = ArenaAllocator(size)

    def wire(self, offset: int) -> int:
        return self.gpa + offset

    def close(self) -> None:
        self.words.release()
        self.view.release()
        self._map.close()


@dataclass
class Vm:
    """What QEMU provides: the RAM file and the channel socket vrnicd connects to."""

    name: str
    ram: Path
    listener: socket.socket
    socket_path: Path
    port: socket.socket | None = None

    def binding(self, vrnic_id: str) -> VmBinding:
        return VmBinding(domain=self.name, ram_path=str(self.ram), machine="q35",
                         vrnics=[VmVrnic(vrnic_id=vrnic_id, channel_socket=str(self.socket_path))])

    def accept(self) -> socket.socket:
        self.listener.settimeout(5)
        self.port, _ = self.listener.accept()
        self.port.settimeout(10)
        return self.port

    def guest(self, busy_poll: bool = False) -> Context:
        assert self.port is not None
        port = self.port
        return Context.over_channel(RamWindow(self.ram, *WINDOW), lambda: SocketChannel(port), busy_poll)

    def read_gpa(self, gpa: int, length: int) -> bytes:
        with self.ram.open("rb") as f:
            f.seek(gpa)
            return f.read(length)


def vm_factory(tmp_path: Path) -> Iterator[Callable[[str], Vm]]:
    vms: list[Vm] = []

    def make(name: str = "vm1") -> Vm:
        ram = tmp_path / f"{name}.ram"
        with ram.open("wb") as f:
            f.truncate(RAM)
        path = tmp_path / f"{name}.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(4)
        vm = Vm(name, ram, listener, path)
        vms.append(vm)
        return vm

    yield make
    for vm in vms:
        if vm.port is not None:
            vm.port.close()
        vm.listener.close()


