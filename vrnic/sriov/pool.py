"""The VF pool: which VF of a PF a new vRNIC gets. Pure: built from the PFs' VF counts and the allocations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vrnic.errors import Conflict, InvalidArgument, NotFound, QuotaExceeded
from vrnic.sriov.vf_types import Allocation, VfAddress, VfConfig


class VfPool:
    def __init__(self, num_vfs: Mapping[str, int], allocations: Iterable[Allocation] = ()) -> None:
        self._num_vfs = dict(num_vfs)
        self._by_id: dict[str, Allocation] = {}
        for allocation in allocations:
            self._by_id[allocation.vrnic_id] = allocation

    def pfs(self) -> list[str]:
        return sorted(self._num_vfs)

    def num_vfs(self, pf: str) -> int:
        try:
            return self._num_vfs[pf]
        except KeyError:
            known = ", ".join(self.pfs()) or "none"
            raise NotFound(f"no SR-IOV PF {pf!r} (known: {known})") from None

    def allocations(self, pf: str | None = None) -> list[Allocation]:
        found = [a for a in self._by_id.values() if pf is None or a.address.pf == pf]
        return sorted(found, key=lambda a: (a.address.pf, a.address.index))

    def get(self, vrnic_id: str) -> Allocation:
        try:
            return self._by_id[vrnic_id]
        except KeyError:
            raise NotFound(f"no SR-IOV vRNIC {vrnic_id}") from None

    def holder(self, address: VfAddress) -> Allocation | None:
        """Who holds the VF now; a vanished allocation holds nothing (its VF went away with a count change)."""
        return next((a for a in self._by_id.values() if a.address == address and not a.vanished), None)

    def free(self, pf: str) -> list[int]:
        taken = {a.address.index for a in self.allocations(pf) if not a.vanished}
        return [i for i in range(self.num_vfs(pf)) if i not in taken]

    def check_index(self, pf: str, index: int) -> None:
        count = self.num_vfs(pf)
        if not 0 <= index < count:
            raise InvalidArgument(f"VF index {index} is out of range for {pf} ({count} VFs: 0..{count - 1})"
                                  if count else f"VF index {index} is out of range: {pf} has no VFs enabled")

    def allocate(self, vrnic_id: str, tenant: str, pf: str, config: VfConfig,
                 index: int | None = None) -> Allocation:
        """Pick a VF (the lowest free one unless index is given) and return the new allocation.

        Raises before anything changes: unknown PF, index out of range or taken, pool exhausted,
        duplicate vRNIC id, or a MAC already used on the same PF (the embedded switch forwards by MAC).
        """
        if vrnic_id in self._by_id:
            raise Conflict(f"vRNIC {vrnic_id} already holds {self._by_id[vrnic_id].address}",
                           current_state="allocated")
        count = self.num_vfs(pf)
        clash = next((a for a in self.allocations(pf) if a.config.mac == config.mac and not a.vanished), None)
        if clash is not None:
            raise Conflict(f"MAC {config.mac} is already used by {clash.vrnic_id} on {clash.address}",
                           current_state="allocated")
        if index is None:
            free = self.free(pf)
            if not free:
                raise QuotaExceeded(f"free VFs on {pf}", count, count + 1)
            index = free[0]
        else:
            self.check_index(pf, index)
            holder = self.holder(VfAddress(pf, index))
            if holder is not None:
                raise Conflict(f"{pf}/vf{index} is allocated to {holder.vrnic_id} (tenant {holder.tenant})",
                               current_state="allocated")
        allocation = Allocation(vrnic_id=vrnic_id, tenant=tenant, address=VfAddress(pf, index), config=config)
        self._by_id[vrnic_id] = allocation
        return allocation

    def release(self, vrnic_id: str) -> Allocation:
        allocation = self.get(vrnic_id)
        del self._by_id[vrnic_id]
        return allocation
