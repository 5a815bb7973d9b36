#!/usr/bin/env bash
# make setup: idempotent. Debian packages, the venv, the vrnic command on PATH, netdevsim.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VRNIC_LAB_VENV:-/opt/vrnic/venv}
CACHE=${VRNIC_LAB_CACHE_DIR:-/var/cache/vrnic}

packages=(
  # the lab: QEMU, Debian's kernel and a busybox initramfs
  qemu-system-x86 linux-image-amd64 busybox-static cpio kmod xz-utils
  # the RDMA stack (used inside the lab, off the read-only host root)
  rdma-core ibverbs-utils ibverbs-providers python3-pyverbs perftest rdmacm-utils iproute2
  # the RoCEv2 packet guard of the direct data path (kernel/roce_guard), and its kernel test
  nftables
  # libvirt (the libvirt tier and the VM hook) and what libvirt-python builds with
  libvirt-daemon-system libvirt-clients libvirt-dev pkg-config
  # Python from Debian (pyverbs is built for it), and the netdevsim build
  python3 python3-venv python3-dev gcc make linux-source-6.1 procps
  # the API tier runs its suite against a throw-away PostgreSQL cluster too (started by the tests)
  postgresql
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The venv sees Debian's pyverbs and lives outside the work dir (9p imports are slow under TCG).
if [[ ! -x $VENV/bin/python ]]; then
  echo "setup: creating $VENV"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
stamp=$VENV/.vrnic-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)-$(pwd -P)
# Ask the venv where it imports vrnic from (from /, so this directory is not on sys.path): a venv installed
# from another checkout would run that checkout's code on the host, and the lab would share that directory.
installed=$(cd / && "$VENV/bin/python" -c 'import vrnic.config as c; print(c.PROJECT_DIR)' 2>/dev/null || true)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" || $installed != "$(pwd -P)" ]]; then
  echo "setup: installing vrnic (editable) and its dependencies into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
ln -sf "$VENV/bin/vrnic" /usr/local/bin/vrnic

# QEMU 10 for the lab's SR-IOV NIC (--sriov-nic): Debian 12's QEMU 7.2 has no SR-IOV NIC model.
# Unpacked beside 7.2 from bookworm-backports, so the proven default lab is untouched.
QEMU_SRIOV=${VRNIC_LAB_SRIOV_QEMU_DIR:-/opt/vrnic/qemu10}
if [[ ! -x $QEMU_SRIOV/root/usr/bin/qemu-system-x86_64 ]]; then
  echo "setup: unpacking QEMU 10 from bookworm-backports into $QEMU_SRIOV (for the SR-IOV NIC)"
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lists/partial"
  echo "deb http://deb.debian.org/debian bookworm-backports main" > "$tmp/sources.list"
  apt_bp=(-o "Dir::Etc::sourcelist=$tmp/sources.list" -o Dir::Etc::sourceparts=/nonexistent
          -o "Dir::State::Lists=$tmp/lists" -o APT::Sandbox::User=root)
  apt-get "${apt_bp[@]}" update -qq
  (cd "$tmp" && apt-get "${apt_bp[@]}" download -qq qemu-system-x86/bookworm-backports \
     qemu-system-data/bookworm-backports qemu-system-common/bookworm-backports 2>/dev/null)
  mkdir -p "$QEMU_SRIOV/root"
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$QEMU_SRIOV/root"; done
  rm -rf "$tmp"
fi
install -m 0755 scripts/qemu-sriov.sh "$QEMU_SRIOV/qemu-system-x86_64"

# netdevsim is not in Debian's kernel: build it once against the lab kernel's headers.
kver=$("$VENV/bin/python" -c 'from vrnic.lab.kernel import choose_kernel, installed_kernels as k; print(choose_kernel(k()))')
dpkg-query -W -f='${Status}' "linux-headers-$kver" 2>/dev/null | grep -q "ok installed" || {
  echo "setup: installing linux-headers-$kver"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "linux-headers-$kver" >/dev/null
}
kernel/netdevsim/build.sh "$kver" "$CACHE/$kver"
echo "setup: ready (lab kernel $kver, venv $VENV)"
