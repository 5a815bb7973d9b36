#!/bin/sh
# QEMU 10 from bookworm-backports, unpacked beside Debian 12's QEMU 7.2 (still the lab's default),
# for --sriov-nic: QEMU 7.2 has no SR-IOV NIC model. Its module path is compiled in and absolute
# (/usr/lib/x86_64-linux-gnu/qemu, where the system's 7.2 modules live); QEMU_MODULE_DIR is searched
# before it, so it loads its own. Not a bind mount over the system path: the lab exports the host root
# over 9p from this very process, and the lab guest's own QEMU 7.2 (libvirt's, for nested VMs) needs
# the 7.2 modules there (under the bind mount it died with "could not load module for type
# 'tcg-accel-ops'" and libvirtd offered no domain types).
root=$(dirname "$(readlink -f "$0")")/root
QEMU_MODULE_DIR="$root/usr/lib/x86_64-linux-gnu/qemu" exec "$root/usr/bin/qemu-system-x86_64" \
  -L "$root/usr/share/qemu" "$@"
