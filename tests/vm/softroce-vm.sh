#!/bin/bash
# A qemu VM with real RDMA verbs (Soft-RoCE, rdma_rxe) for hosts whose kernel has no RDMA.
#
#   tests/vm/softroce-vm.sh build          build the image if it is missing or stale (~3 min)
#   tests/vm/softroce-vm.sh run CMD...     boot it (TCG), the repository at /host, run CMD there
#
# The exit status of `run` is CMD's status inside the guest, carried out by qemu's
# isa-debug-exit device; 125 means the guest never reported one (it hung or crashed).
# The image is cached in $IRDMA_VM_DIR (default /var/cache/irdma-vm) and rebuilt when this
# script's package list changes. The guest has no network device (-nic none): every address
# used by the tests lives only inside it. Recipe and pitfalls: ../shared/reference/SOFTROCE.md.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
W=${IRDMA_VM_DIR:-/var/cache/irdma-vm}
MIRROR=${MIRROR:-$(sed -n "s/^URIs: *//p" /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
# Everything the guest needs comes from Debian: verbs, FUSE and the project's Python deps.
PACKAGES=python3-pyverbs,ibverbs-providers,ibverbs-utils,rdma-core,iproute2,kmod,linux-image-amd64,fuse3,python3-trio,python3-pyfuse3,python3-numpy,python3-click,python3-rich,python3-cryptography,python3-cffi-backend,python3-pytest,python3-prometheus-client,python3-psutil
STAMP="$(echo "$PACKAGES v1" | sha256sum | cut -c1-16)"

host_deps() {
  command -v qemu-system-x86_64 >/dev/null && command -v debootstrap >/dev/null && command -v mkfs.ext4 >/dev/null && return 0
  echo "== installing qemu-system-x86, debootstrap, e2fsprogs"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    qemu-system-x86 debootstrap e2fsprogs >/dev/null
}

build() {
  host_deps
  if [ -f "$W/rootfs.ext4" ] && [ "$(cat "$W/stamp" 2>/dev/null)" = "$STAMP" ]; then
    echo "== VM image cached in $W (stamp $STAMP)"; return 0
  fi
  echo "== building the Soft-RoCE VM image in $W (debootstrap, about 3 minutes)"
  mkdir -p "$W"; rm -rf "$W/rootfs" "$W/stamp"
  debootstrap --variant=minbase --include="$PACKAGES" bookworm "$W/rootfs" "$MIRROR" \
    > "$W/debootstrap.log" 2>&1 || { tail -20 "$W/debootstrap.log"; echo "debootstrap failed: see $W/debootstrap.log"; exit 1; }
  cat > "$W/rootfs/sbin/irdma-init" <<'INIT'
#!/bin/sh
# PID 1: mount the basics and the host share, then hand over to the repository's guest script.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp; mount -t tmpfs run /run
modprobe -a 9pnet_virtio 9p
mkdir -p /host && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 host0 /host
exec /bin/sh /host/tests/vm/guest-init.sh
INIT
  chmod +x "$W/rootfs/sbin/irdma-init"
  rm -rf "$W"/rootfs/var/cache/apt/archives/*.deb "$W"/rootfs/var/lib/apt/lists/*
  cp "$W"/rootfs/boot/vmlinuz-* "$W/vmlinuz"
  cp "$W"/rootfs/boot/initrd.img-* "$W/initrd.img"
  local mb; mb=$(du -sm "$W/rootfs" | cut -f1)
  mkfs.ext4 -q -F -L irdmaroot -d "$W/rootfs" "$W/rootfs.ext4" $((mb + mb / 4 + 128))M
  rm -rf "$W/rootfs"
  echo "$STAMP" > "$W/stamp"
  echo "== VM image ready"
}

run() {
  [ -f "$W/rootfs.ext4" ] || { echo "no VM image in $W: run '$0 build' first"; exit 2; }
  printf '%q ' "$@" > "$REPO/.vm-cmd"
  local rc=0
  # /dev/kvm opens on these hosts but cannot run a stock kernel: TCG it is.
  timeout "${IRDMA_VM_TIMEOUT:-900}" qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 3072 \
    -nographic -no-reboot -nic none \
    -kernel "$W/vmlinuz" -initrd "$W/initrd.img" \
    -drive file="$W/rootfs.ext4",format=raw,if=virtio,snapshot=on \
    -virtfs local,path="$REPO",mount_tag=host0,security_model=none,id=host0 \
    -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
    -append "root=/dev/vda rw console=ttyS0 quiet init=/sbin/irdma-init panic=-1" || rc=$?
  rm -f "$REPO/.vm-cmd"
  if [ $rc -eq 0 ] || [ $((rc & 1)) -eq 0 ]; then echo "VM did not report a status (qemu rc=$rc)"; return 125; fi
  return $((rc >> 1))
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 build | run CMD..." >&2; exit 2 ;;
esac
