#!/usr/bin/env bash
# Build netdevsim out of tree for the lab kernel. Debian does not ship it
# (CONFIG_NETDEVSIM is unset), but the SR-IOV mode is proven on its VFs.
# Usage: build.sh KVER OUTDIR   -> OUTDIR/netdevsim.ko (skipped if present)
set -euo pipefail
kver=${1:?kernel version}
out=${2:?output dir}
ko="$out/netdevsim.ko"
if [[ -f $ko ]]; then echo "netdevsim: cached at $ko"; exit 0; fi

series=$(echo "$kver" | cut -d. -f1,2)            # 6.1.0-56-amd64 -> 6.1
src_tar=/usr/src/linux-source-$series.tar.xz
[[ -f $src_tar ]] || { echo "netdevsim: $src_tar missing (apt install linux-source-$series)" >&2; exit 1; }
[[ -d /lib/modules/$kver/build ]] || { echo "netdevsim: headers for $kver missing (apt install linux-headers-$kver)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "netdevsim: extracting sources from $src_tar"
tar -C "$work" -xJf "$src_tar" --wildcards "linux-source-$series/drivers/net/netdevsim/*"
moddir="$work/linux-source-$series/drivers/net/netdevsim"
echo "netdevsim: building against /lib/modules/$kver/build"
make -s -C "/lib/modules/$kver/build" M="$moddir" CONFIG_NETDEVSIM=m modules
mkdir -p "$out"
install -m 0644 "$moddir/netdevsim.ko" "$ko.tmp" && mv "$ko.tmp" "$ko"
echo "netdevsim: built $ko"
