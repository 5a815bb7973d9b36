"""The seam between the direct engine and a device: one QueueFormat per device family.

A guest on the direct engine writes work requests in the NIC's own format into
queues it maps, and reads the NIC's own completions. Everything device-specific
about that (WQE and CQE layouts, index arithmetic, the doorbell's bytes) sits
behind this interface. Pure data and struct packing only; the standard library
only, because the frontend runs it, also inside VMs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class PhysWr:
    """A send WR in physical terms (keys, QPNs and addresses as the NIC knows them)."""

    wr_id: int
    opcode: int  # ibv_wr_opcode numbering (vrnic.core.rings.WrOpcode)
    sges: list[tuple[int, int, int]] = field(default_factory=list)  # (address, length, lkey)
    signaled: bool = True
    imm: int = 0
    remote_addr: int = 0
    rkey: int = 0
    compare_add: int = 0
    swap: int = 0


@dataclass(slots=True)
class RawCompletion:
    """A completion as the NIC wrote it (ibv_wc numbering); qp_num is the physical QPN."""

    wr_id: int
    status: int
    opcode: int
    byte_len: int = 0
    imm_data: int = 0
    qp_num: int = 0
    src_qp: int = 0
    wc_flags: int = 0
    vendor_err: int = 0


class QueueFormat(ABC):
    name: ClassVar[str]

    @abstractmethod
    def send_wqe(self, buf: memoryview, at: int, wr: PhysWr, ssn: int) -> None:
        """Encode one send WQE into the slot that starts at byte `at` of buf."""

    @abstractmethod
    def recv_wqe(self, buf: memoryview, at: int, wr_id: int, sges: list[tuple[int, int, int]]) -> None:
        """Encode one receive WQE into the slot at `at`."""

    @abstractmethod
    def parse_cqe(self, buf: memoryview, at: int) -> RawCompletion:
        """Decode the CQE in the slot at `at`."""
