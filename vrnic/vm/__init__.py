"""VM attachment of a vRNIC: libvirt/QEMU domains whose RAM file is the guest memory vrnicd maps.

domain_xml.py (pure): typed domain description -> libvirt domain XML.
guest_ram.py: guest-physical address -> RAM file offset, libvirt's RAM file path, and the RAM file
    mapped shared for inspection (GuestRamFile); vrnicd maps it with GuestMemory.from_vm_ram.
hook.py (pure + a small entry point): the libvirt qemu hook's (argv, stdin XML) -> a typed event,
    and admission at prepare.

Seen in the lab (tests/kernel/test_vm_nested.py, test_vm_hook.py; libvirt 9.0, QEMU 7.2, nested KVM):
- With memory_backing_dir set, the RAM file is <dir>/libvirt/qemu/<id>-<name[:20]>/pc.ram; the
  per-domain directory is mode 0700 (owned by root here, where QEMU runs as root). The hook already
  sees the live id at prepare; the file exists from `started`; at stopped/release the XML carries
  id -1, so remember the path from `started`.
- A refused prepare still gets stopped/end and release/end calls: cleanup must be idempotent.
- libvirtd runs the hook with only LC_ALL, PATH and HOME: the hook script sets PYTHONPATH itself.
- An rxe MR over a MAP_SHARED mapping of the RAM file takes RDMA WRITEs the guest then reads.

What the container path has that a VM attach lacks (for issue 9):
- The arena memfd and the doorbell/notify eventfds arrive over the unix socket with SCM_RIGHTS;
  virtio-serial carries bytes only. vrnicd must open the RAM file itself (path from the hook) and
  needs another doorbell (a channel message, or ivshmem-doorbell / an ioeventfd).
- The RAM file is not sealed: GuestMemory.from_vm_ram maps it without the seal check (QEMU, not the guest,
  owns its size).
- Guest addresses are guest-physical; linear in the file only below the 4 GiB split.
"""
