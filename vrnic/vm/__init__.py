"""VM attachment of a vRNIC: libvirt/QEMU domains whose RAM file is the guest memory vrnicd maps.

domain_xml.py (pure): typed domain description -> libvirt domain XML.
domain_edit.py (pure): what `vrnic vm attach` adds to an existing domain's XML, and detach removes.
libvirt_edge.py: the thin libvirt-python edge (look up, read, define, hot-plug; errors translated).
guest_ram.py: guest-physical address -> RAM file offset, libvirt's RAM file path, and the RAM file
    mapped shared for inspection (GuestRamFile); vrnicd maps it with GuestMemory.from_vm_ram.
hook.py: the libvirt qemu hook: (argv, stdin XML) -> a typed event -> admission, bind, unbind
    through the REST API.

Seen in the lab (tests/kernel/test_vm_nested.py, test_vm_hook.py; libvirt 9.0, QEMU 7.2, nested KVM):
- With memory_backing_dir set, the RAM file is <dir>/libvirt/qemu/<id>-<name[:20]>/pc.ram; the
  per-domain directory is mode 0700 (owned by root here, where QEMU runs as root). The hook already
  sees the live id at prepare; the file exists from `started`; at stopped/release the XML carries
  id -1, so remember the path from `started`.
- A refused prepare still gets stopped/end and release/end calls: cleanup must be idempotent.
- libvirtd runs the hook with only LC_ALL, PATH and HOME: the hook script sets PYTHONPATH itself.
- An rxe MR over a MAP_SHARED mapping of the RAM file takes RDMA WRITEs the guest then reads.
"""
