#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Soft-RoCE job: prove the `rdma` (pyverbs) backend on a real ibverbs stack without an RDMA NIC.
#
# The build host's kernel has no RDMA, so we boot Debian's own kernel (CONFIG_RDMA_RXE=m) under
# qemu TCG with no NIC (-nic none) from a busybox initramfs holding rdma-core 44, Debian's
# python3.11 + python3-pyverbs and the project's pure-python transport package. Inside the VM:
# load rdma_rxe, create rxe0 on dummy0, run tests/rdma/rdma_cases.py, which prints one
# "RDMA-CASE PASS|FAIL <name>" line per case and "RDMA-SUITE DONE rc=N" on the serial console.
#
# Host needs (Debian 12): `apt-get update && apt-get install -y --no-install-recommends
# qemu-system-x86 cpio` (apt, dpkg-deb, python3 are already there; busybox-static, the kernel,
# python3.11 and python3-pyverbs are apt-get DOWNLOADED into the cache, not installed). Run as
# root for the chroot smoke check + byte-compiling the VM's python (else those steps are skipped).
# Where /sys/class/infiniband already has a device, the cases run natively instead (no VM).
#
# Usage: tests/rdma/run_softroce_vm.sh [--build-only] [--keep]   (exit code = suite result)
# Env: VLLM_DISAGG_SOFTROCE_CACHE (default ~/.cache/vllm-disagg/softroce), SOFTROCE_TIMEOUT_S (600),
#      SOFTROCE_ARGS (passed to rdma_cases.py in the VM, e.g. "--bench"), SOFTROCE_FORCE_VM=1 (use the VM even with a native device), SOFTROCE_PYTHON (native run: /usr/bin/python3),
#      SOFTROCE_KERNEL (default: newest linux-image-6.1.0-*-amd64 apt knows), SOFTROCE_MEM (1024).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${VLLM_DISAGG_SOFTROCE_CACHE:-$HOME/.cache/vllm-disagg/softroce}"
TIMEOUT_S="${SOFTROCE_TIMEOUT_S:-600}"
MEM="${SOFTROCE_MEM:-1024}"
BUILD_ONLY=0
for a in "$@"; do
  case "$a" in
    --build-only) BUILD_ONLY=1 ;;
    *) echo "usage: $0 [--build-only]" >&2; exit 2 ;;
  esac
done

log() { echo "[softroce $(date +%T)] $*" >&2; }
die() { echo "SOFTROCE-ERROR $*" >&2; exit 3; }

# A native ibverbs device (real NIC, or a stock kernel's rdma_rxe): run the same cases, no VM.
if [[ -z "${SOFTROCE_FORCE_VM:-}" && -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then
  log "native ibverbs device(s): $(ls /sys/class/infiniband | tr '\n' ' ')- running the cases without the VM"
  ((BUILD_ONLY)) && exit 0
  exec "${SOFTROCE_PYTHON:-/usr/bin/python3}" "$REPO/tests/rdma/rdma_cases.py"
fi

for tool in qemu-system-x86_64 apt-get apt-cache dpkg-deb cpio python3; do
  command -v "$tool" >/dev/null || die "missing host tool '$tool' (apt-get install qemu-system-x86 busybox-static cpio)"
done

KERNEL_PKG="${SOFTROCE_KERNEL:-}"
if [[ -z "$KERNEL_PKG" ]]; then
  KERNEL_PKG="$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' | cut -d' ' -f1 | sort -V | tail -1)"
  [[ -n "$KERNEL_PKG" ]] || die "apt knows no linux-image-6.1.0-*-amd64 (run apt-get update with Debian 12 sources)"
fi
KVER="${KERNEL_PKG#linux-image-}"

# Userland packages (Debian 12). The rdma tool needs only libmnl/libbsd/libcap from iproute2's deps.
PKGS=(
  busybox-static libc6 libgcc-s1
  python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11 libexpat1 zlib1g libssl3
  libffi8 libbz2-1.0 liblzma5 libcrypt1 libuuid1
  python3-pyverbs libibverbs1 librdmacm1 ibverbs-providers libnl-3-200 libnl-route-3-200
  iproute2 libmnl0 libbsd0 libmd0 libcap2
)
# Kernel modules to load, dependencies resolved from the kernel's modules.dep.
MODULES=(crc32_generic dummy rdma_rxe)

DEBS="$CACHE/debs"
KEY="$(printf '%s\n' "$KERNEL_PKG" "${PKGS[@]}" "${MODULES[@]}" v5 | sha256sum | cut -c1-16)"
BASE="$CACHE/base-$KEY"
mkdir -p "$DEBS"

download() {
  local missing=()
  for p in "$KERNEL_PKG" "${PKGS[@]}"; do
    compgen -G "$DEBS/${p}_*.deb" >/dev/null || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get download ${missing[*]}"
    (cd "$DEBS" && apt-get download "${missing[@]}" >/dev/null 2>&1) || die "apt-get download failed for: ${missing[*]}"
  fi
}

build_base() {
  [[ -f "$BASE/initramfs-base.cpio" && -f "$BASE/vmlinuz" ]] && return 0
  log "building base initramfs for $KERNEL_PKG in $BASE"
  find "$CACHE" -maxdepth 1 -name 'base-*' ! -name "base-$KEY" -exec rm -rf {} +  # stale package sets
  local stage="$BASE.tmp"
  rm -rf "$stage" && mkdir -p "$stage/root" "$stage/kernel"
  for p in "${PKGS[@]}"; do
    dpkg-deb -x "$(compgen -G "$DEBS/${p}_*.deb" | head -1)" "$stage/root"
  done
  dpkg-deb -x "$(compgen -G "$DEBS/${KERNEL_PKG}_*.deb" | head -1)" "$stage/kernel"
  local root="$stage/root" mdir="$stage/kernel/lib/modules/$KVER"
  # Trim what the VM never uses (docs, locales, the python test suite) to keep the cpio small.
  rm -rf "$root"/usr/share/{doc,man,locale,info,lintian} "$root"/usr/lib/python3.11/{test,idlelib,tkinter,ensurepip,lib2to3,pydoc_data}
  rm -rf "$root"/usr/lib/python3.11/{asyncio,email,xml,xmlrpc,unittest,sqlite3,dbm,curses,wsgiref,turtledemo,turtle.py,_pydecimal.py,pydoc.py}
  # Merged-/usr layout: /lib, /lib64, /bin, /sbin point into /usr.
  for d in lib lib64 bin sbin; do
    if [[ -d "$root/$d" && ! -L "$root/$d" ]]; then mkdir -p "$root/usr/$d"; cp -a "$root/$d/." "$root/usr/$d/"; rm -rf "${root:?}/$d"; fi
    ln -sfn "usr/$d" "$root/$d"
  done
  mkdir -p "$root"/{proc,sys,dev,tmp,run,work,etc,lib/modules}
  ln -sf python3.11 "$root/usr/bin/python3"
  # Kernel modules in load order (dependencies first), decompressed when shipped as .ko.xz.
  python3 - "$mdir" "$root/lib/modules" "${MODULES[@]}" <<'PY'
import os, re, shutil, sys
mdir, out, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
paths = {}  # module name -> path; modules.dep is generated by depmod at install, so read .modinfo
for dirpath, _, files in os.walk(os.path.join(mdir, "kernel")):
    for f in files:
        if f.endswith(".ko"):
            paths[f[:-3].replace("-", "_")] = os.path.join(dirpath, f)
def depends(name):
    m = re.search(rb"\0depends=([^\0]*)\0", open(paths[name], "rb").read())
    return [d.replace("-", "_") for d in m.group(1).decode().split(",") if d] if m else []
order = []
def visit(name):
    for n in depends(name):
        visit(n)
    if name not in order:
        order.append(name)
for w in wanted:
    visit(w)
with open(os.path.join(out, "load-order"), "w") as f:
    for name in order:
        shutil.copy(paths[name], os.path.join(out, name + ".ko"))
        f.write(name + "\n")
print("modules:", " ".join(order))
PY
  cp "$stage/kernel/boot/vmlinuz-$KVER" "$stage/vmlinuz"
  cat >"$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox mkdir -p /sbin /usr/sbin
/bin/busybox --install -s /bin 2>/dev/null
export PATH=/usr/bin:/bin:/usr/sbin:/sbin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev; mount -t tmpfs tmpfs /tmp
echo "SOFTROCE-BOOTED uptime=$(cut -d' ' -f1 /proc/uptime)"
for m in $(cat /lib/modules/load-order); do
  if [ "$m" = dummy ]; then insmod /lib/modules/$m.ko numdummies=1; else insmod /lib/modules/$m.ko; fi || echo "SOFTROCE-WARN insmod $m failed"
done
ip link set lo up; ip link set dummy0 up
ip addr add 10.77.0.1/24 dev dummy0
rdma link add rxe0 type rxe netdev dummy0 || echo "SOFTROCE-WARN rdma link add failed"
ls /sys/class/infiniband
echo "SOFTROCE-READY uptime=$(cut -d' ' -f1 /proc/uptime)"
cd /work && PYTHONPATH=/work python3 -X faulthandler tests/rdma/rdma_cases.py $(cat /work/cases.args 2>/dev/null)
echo "SOFTROCE-EXIT rc=$? uptime=$(cut -d' ' -f1 /proc/uptime)"
sync; poweroff -f
INIT
  chmod +x "$root/init"
  ln -sf busybox "$root/bin/sh" 2>/dev/null || true
  # Smoke check on the host (root only): the extracted userland resolves all its libraries.
  if [[ $EUID -eq 0 ]]; then
    chroot "$root" /usr/bin/python3.11 -c "import pyverbs.device, pyverbs.qp, pyverbs.mr, pyverbs.wr, pyverbs.addr, pyverbs.cq, hmac, hashlib, threading, ctypes, mmap, socket, select, queue, logging, random, subprocess, struct, traceback" \
      || die "chroot import check failed: the package list misses a library"
    chroot "$root" /usr/bin/rdma -V >/dev/null || die "chroot check: /usr/bin/rdma does not run"
    # Debian byte-compiles at install time (postinst), dpkg-deb -x does not: compile here, or every
    # import in the VM recompiles from source at TCG speed.
    chroot "$root" /usr/bin/python3.11 -m compileall -q /usr/lib/python3.11 /usr/lib/python3/dist-packages >/dev/null \
      || die "byte-compiling the VM's python failed"
  fi
  # Uncompressed: qemu loads it host-side; inflating gzip at TCG speed costs the guest seconds.
  (cd "$root" && find . -print0 | cpio --null -o -H newc --quiet) >"$stage/initramfs-base.cpio"
  rm -rf "$stage/kernel"
  rm -rf "$BASE" && mv "$stage" "$BASE"
  log "base initramfs: $(du -h "$BASE/initramfs-base.cpio" | cut -f1)"
}

build_overlay() {
  # The project's transport package, rebuilt every run (a second cpio archive appended to the base).
  local ov="$CACHE/overlay" out="$CACHE/initramfs-overlay.cpio"
  rm -rf "$ov" && mkdir -p "$ov/work/vllm_disagg/transport" "$ov/work/tests/rdma"
  cp "$REPO/vllm_disagg/__init__.py" "$REPO/vllm_disagg/errors.py" "$REPO/vllm_disagg/envs.py" "$ov/work/vllm_disagg/"
  cp "$REPO"/vllm_disagg/transport/{__init__,base,wire,server,msg}.py "$ov/work/vllm_disagg/transport/"
  cp -r "$REPO/vllm_disagg/transport/rdma" "$REPO/vllm_disagg/transport/onesided" "$ov/work/vllm_disagg/transport/"
  cp "$REPO/tests/rdma/rdma_cases.py" "$ov/work/tests/rdma/"
  echo "${SOFTROCE_ARGS:-}" >"$ov/work/cases.args"  # e.g. SOFTROCE_ARGS=--bench
  find "$ov" -name __pycache__ -prune -exec rm -rf {} +
  if [[ $EUID -eq 0 && -x "$BASE/root/usr/bin/python3.11" ]]; then  # byte-compile with the VM's python
    mkdir -p "$BASE/root/ov" && cp -a "$ov/work" "$BASE/root/ov/"
    chroot "$BASE/root" /usr/bin/python3.11 -m compileall -q /ov/work >/dev/null && cp -a "$BASE/root/ov/work/." "$ov/work/"
    rm -rf "$BASE/root/ov"
  fi
  (cd "$ov" && find . -print0 | cpio --null -o -H newc --quiet) >"$out"
  cat "$BASE/initramfs-base.cpio" "$out" >"$CACHE/initramfs.cpio"
}

t0=$(date +%s)
download
build_base
build_overlay
log "initramfs ready in $(($(date +%s) - t0)) s"
((BUILD_ONLY)) && exit 0

LOGF="$CACHE/console.log"
log "booting $KERNEL_PKG under qemu TCG (-nic none), console -> $LOGF"
t1=$(date +%s)
set +e
timeout --foreground "$TIMEOUT_S" qemu-system-x86_64 -machine q35,accel=tcg -cpu max -smp 2 -m "$MEM" \
  -nic none -nographic -no-reboot -monitor none -serial stdio \
  -kernel "$BASE/vmlinuz" -initrd "$CACHE/initramfs.cpio" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init" </dev/null | tee "$LOGF" | grep --line-buffered -E "^(SOFTROCE|RDMA-)"
qrc=${PIPESTATUS[0]}
set -e
log "VM ran $(($(date +%s) - t1)) s (qemu rc=$qrc)"
if ! grep -q "^RDMA-SUITE DONE rc=0" "$LOGF"; then
  grep -q "^RDMA-SUITE DONE" "$LOGF" || echo "SOFTROCE-ERROR the suite did not finish (qemu rc=$qrc; see $LOGF)"
  exit 1
fi
exit 0
