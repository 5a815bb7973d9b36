#!/bin/sh
# QEMU 10 from bookworm-backports, unpacked beside Debian 12's QEMU 7.2 (still the lab's default),
# for --sriov-nic: QEMU 7.2 has no SR-IOV NIC model. It would load the system's 7.2 modules from the
# shared module path, so bind its own over that path in a private mount namespace.
root=$(dirname "$(readlink -f "$0")")/root
exec unshare -m sh -c 'mount --bind "$0/usr/lib/x86_64-linux-gnu/qemu" /usr/lib/x86_64-linux-gnu/qemu &&
  exec "$0/usr/bin/qemu-system-x86_64" -L "$0/usr/share/qemu" "$@"' "$root" "$@"
