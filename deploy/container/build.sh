#!/usr/bin/env bash
# Lays out the root filesystem of the tandem image: the Containerfile's build stage runs this,
# and tests/deploy.rs runs it as a plain script (with the debug binary) to check the layout.
#
#   build.sh --out DIR [--features LIST] [--binary PATH] [--no-strip]
#
# Without --binary it builds `tandem` with the shipping profile (`cargo build --profile dist
# --locked`: release with whole-program LTO, Cargo.toml says why), with --features when given,
# e.g. `cuda`. DIR then holds a complete image root for a `FROM scratch` stage:
#   /usr/local/bin/tandem           the binary (debug info stripped unless --no-strip; the
#                                   symbols stay, so backtraces keep function names)
#   /lib..., /lib64/ld-linux-...    the shared libraries the binary links (glibc, libgcc_s,
#                                   libm: whatever `ldd` lists), at the paths ldd resolves
#   /etc/passwd, /etc/group         root, and the user `tandem` (65532:65532) the image runs as
#   /etc/nsswitch.conf              hosts from files, then DNS (glibc's own resolver)
#   /home/tandem, /tmp              the user's home (owned by it), a world-writable /tmp
# Libraries loaded at run time only when asked for are not included: UCX (`libucp`; without
# it workers use the TCP KV transport) and the CUDA driver (`libcuda`, which the NVIDIA
# container toolkit mounts into GPU pods).
set -euo pipefail

usage() { sed -n '5,6p' "$0" >&2; exit 2; }
out="" features="" binary="" strip=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --features) features="${2-}"; shift 2 ;;
    --binary) binary="${2:?--binary needs a path}"; shift 2 ;;
    --no-strip) strip=0; shift ;;
    -h|--help) usage ;;
    *) echo "build.sh: unknown argument $1" >&2; usage ;;
  esac
done
[ -n "$out" ] || usage
out="$(realpath -m "$out")"
[ -z "$binary" ] || binary="$(realpath -m "$binary")"

cd "$(dirname "$0")/../.."
if [ -z "$binary" ]; then
  cargo build --profile dist --locked --bin tandem ${features:+--features "$features"}
  binary="${CARGO_TARGET_DIR:-target}/dist/tandem"
fi
[ -x "$binary" ] || { echo "build.sh: $binary is not an executable" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/usr/local/bin" "$out/etc" "$out/home/tandem" "$out/tmp"
if [ "$strip" = 1 ]; then
  objcopy --strip-debug "$binary" "$out/usr/local/bin/tandem"
else
  cp "$binary" "$out/usr/local/bin/tandem"
fi
chmod 0755 "$out/usr/local/bin/tandem"

# Shared libraries: each path ldd resolves (and the program interpreter), copied as a file.
libs="$(ldd "$binary")"
if grep -q 'not found' <<<"$libs"; then
  echo "build.sh: $binary needs libraries this machine lacks:" >&2
  grep 'not found' <<<"$libs" >&2
  exit 1
fi
for lib in $(awk '/=> \// { print $3; next } /^[[:space:]]*\// { print $1 }' <<<"$libs"); do
  mkdir -p "$out$(dirname "$lib")"
  cp -L "$lib" "$out$lib"
done

cat >"$out/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/sbin/nologin
tandem:x:65532:65532:tandem:/home/tandem:/sbin/nologin
PASSWD
cat >"$out/etc/group" <<'GROUP'
root:x:0:
tandem:x:65532:
GROUP
echo 'hosts: files dns' >"$out/etc/nsswitch.conf"
chmod 1777 "$out/tmp"
if [ "$(id -u)" = 0 ]; then
  chown 65532:65532 "$out/home/tandem"
else
  echo "build.sh: not root: /home/tandem stays owned by $(id -u)" >&2
fi
echo "build.sh: image root in $out ($(du -sh "$out" | cut -f1))"
