#!/usr/bin/env bash
# Checks the README's main command on a fresh machine: a minimal Debian 12 made with
# debootstrap (plus a C compiler, CA certificates and git; no protoc, no UCX, no libclang, no
# pkg-config), the host's Rust toolchain mounted in read-only, an empty CARGO_HOME. It clones
# this repository's HEAD into it, runs `cargo run --release -- up`, sends one chat completion
# and stops the cluster with SIGTERM.
#
#   sudo bash scripts/fresh-machine.sh [ROOT]      # ROOT: where the Debian lives (reused)
#
# Needs root (debootstrap, chroot, mounts), debootstrap and curl on the host, and a rustup
# toolchain under $RUSTUP_HOME (default /root/.rustup). Host CA certificates from
# /usr/local/share/ca-certificates are copied in, for networks behind a TLS-inspecting proxy.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${1:-/var/tmp/tandem-fresh-debian}
rustup_home=${RUSTUP_HOME:-/root/.rustup}
toolchain=$(ls -d "$rustup_home"/toolchains/stable-* | head -1)
port=${PORT:-18000}

if [ ! -x "$root/usr/bin/gcc" ]; then
  debootstrap --variant=minbase --include=gcc,libc6-dev,ca-certificates,git \
    bookworm "$root" http://deb.debian.org/debian
fi
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
mkdir -p "$root/opt/rust" "$root/src"
cleanup() {
  if [ -f "$root/root/up.pid" ]; then
    pid=$(cat "$root/root/up.pid")
    kill -TERM "$pid" 2>/dev/null || true
    # The cluster drains, then exits; the mounts can go once nothing in the root uses them.
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  for m in opt/rust src proc dev; do umount "$root/$m" 2>/dev/null || umount -l "$root/$m" || true; done
}
trap cleanup EXIT
mount --bind "$toolchain" "$root/opt/rust" && mount -o remount,bind,ro "$root/opt/rust"
mount --bind "$repo" "$root/src" && mount -o remount,bind,ro "$root/src"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"

chroot "$root" /bin/bash -s "$port" <<'INSIDE'
set -euo pipefail
port=$1
export PATH=/opt/rust/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root CARGO_HOME=/root/.cargo
echo "== what the machine has"
for t in protoc pkg-config clang; do printf '%s: ' "$t"; command -v "$t" || echo absent; done
[ -e /usr/include/ucp/api/ucp.h ] && echo "UCX headers: present" || echo "UCX headers: absent"
ldconfig -p | grep -E 'libucp|libclang|libprotobuf' || echo "libucp, libclang, libprotobuf: absent"
cargo --version && gcc --version | head -1
rm -rf /build && mkdir -p /build && cd /build
git clone -q /src tandem && cd tandem && git log --oneline -1
echo "== cargo run --release -- up --port $port"
cargo run --release -- up --port "$port" > /root/up.log 2>&1 &
echo $! > /root/up.pid
INSIDE

echo "== waiting for the cluster (the release build takes minutes)"
for _ in $(seq 1 1800); do
  grep -q "tandem up: http" "$root/root/up.log" 2>/dev/null && break
  if ! kill -0 "$(cat "$root/root/up.pid")" 2>/dev/null; then
    tail -30 "$root/root/up.log"; echo "the main command failed"; exit 1
  fi
  sleep 2
done
grep "tandem up: http" "$root/root/up.log"
curl -sS -D - "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'
echo
grep -iE "ucx|transport" "$root/root/up.log" | head -3 || true
