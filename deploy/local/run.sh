#!/usr/bin/env bash
# The Kubernetes topology of deploy/base as processes on this machine: etcd and nats-server
# on free loopback ports, frontend replicas with replica sync, a prefill pool and a decode
# pool — each tandem process configured from the same env files as the pods
# (deploy/base/{cluster,frontend,prefill,decode}.env), with only the addresses (and
# TANDEM_KV_MEMORY=host: no GPU here) set here instead of in the pod specs.
#
#   deploy/local/run.sh [--bin PATH] [--dir DIR] [--frontends N] [--prefill N] [--decode N]
#
# --bin: the tandem binary (default: `tandem` on PATH); --dir: logs, etcd's data and the
# files below (default: a new temporary directory); counts default to 2 frontends, 1 prefill
# and 2 decode workers. Needs `etcd` and `nats-server` on PATH (Debian: etcd-server,
# nats-server). When every frontend answers /health, it writes DIR/frontends (one
# HOST:PORT per line), DIR/admins (each frontend's admin listener: its status page and
# /metrics, in the same order), DIR/pids (name pid, one per line) and prints "ready". It runs until
# SIGINT or SIGTERM, then stops the frontends (they drain), the workers, NATS and etcd, in
# that order, and exits 0; if any process exits on its own it stops the rest and exits 1.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
base="$here/../base"
bin=tandem dir="" frontends=2 prefill=1 decode=2
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --frontends) frontends="$2"; shift 2 ;;
    --prefill) prefill="$2"; shift 2 ;;
    --decode) decode="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for tool in "$bin" etcd nats-server; do
  command -v "$tool" >/dev/null || { echo "run.sh: $tool not found" >&2; exit 1; }
done
[ -n "$dir" ] || dir="$(mktemp -d -t tandem-local.XXXXXX)"
mkdir -p "$dir"
rm -f "$dir/frontends" "$dir/admins" "$dir/pids"

names=() pids=() taken=" "
# A loopback port nothing listens on (and that this script has not handed out yet), below the
# kernel's ephemeral range: the workers listen on port 0 and every process connects out, and
# either can be handed a port in that range after we checked it (a frontend then fails to bind).
ephemeral_low=32768
read -r ephemeral_low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
[ "$ephemeral_low" -gt 12000 ] 2>/dev/null || ephemeral_low=32768
free_port() {
  local p
  while :; do
    p=$((10000 + RANDOM % (ephemeral_low - 10000)))
    case "$taken" in *" $p "*) continue ;; esac
    if ! (: </dev/tcp/127.0.0.1/$p) 2>/dev/null; then
      taken="$taken$p "
      echo "$p"
      return
    fi
  done
}
# The status code of GET http://127.0.0.1:PORT/PATH, or nothing when it does not answer.
http_status() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
    printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "$2" >&3
    IFS=' ' read -r -t 5 _ code _ <&3 && echo "$code"
  ) 2>/dev/null || true
}
# The KEY=VALUE lines of env files, as kustomize's configMapGenerator reads them.
env_of() {
  grep -hv -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$@"
}
# start NAME COMMAND...: in the background, output in DIR/NAME.log.
start() {
  local name="$1"; shift
  "$@" >"$dir/$name.log" 2>&1 </dev/null &
  names+=("$name"); pids+=("$!")
}
# wait_until WHAT SECONDS COMMAND...: polls COMMAND every 0.1 s.
wait_until() {
  local what="$1" deadline=$((SECONDS + $2)); shift 2
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "run.sh: timed out waiting for $what (logs in $dir)" >&2
      stop_all; exit 1
    fi
    sleep 0.1
  done
}
# Stops the processes started under names matching PATTERN, SIGTERM then (after SECONDS)
# SIGKILL, and reaps them.
stop_matching() {
  local pattern="$1" limit="$2" i deadline alive
  for i in "${!pids[@]}"; do
    [[ "${names[$i]}" == $pattern ]] && kill -TERM "${pids[$i]}" 2>/dev/null || true
  done
  deadline=$((SECONDS + limit))
  for i in "${!pids[@]}"; do
    [[ "${names[$i]}" == $pattern ]] || continue
    alive=1
    while [ "$SECONDS" -lt "$deadline" ]; do
      kill -0 "${pids[$i]}" 2>/dev/null || { alive=0; break; }
      sleep 0.1
    done
    [ "$alive" = 0 ] || kill -KILL "${pids[$i]}" 2>/dev/null || true
    wait "${pids[$i]}" 2>/dev/null || true
  done
}
stop_all() {
  trap - INT TERM
  stop_matching 'frontend*' 40
  stop_matching 'prefill*' 70
  stop_matching 'decode*' 70
  stop_matching 'nats' 10
  stop_matching 'etcd' 10
}
stopping=0
trap 'stopping=1' INT TERM

etcd_port="$(free_port)" peer_port="$(free_port)" nats_port="$(free_port)"
start etcd etcd --name local --data-dir "$dir/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" \
  --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "local=http://127.0.0.1:$peer_port"
start nats nats-server -a 127.0.0.1 -p "$nats_port"
etcd_ready() { [ "$(http_status "$etcd_port" /health)" = 200 ]; }
nats_ready() { (: </dev/tcp/127.0.0.1/"$nats_port") 2>/dev/null; }
wait_until etcd 30 etcd_ready
wait_until nats-server 30 nats_ready

# What the pods get from their spec rather than from the env files: addresses.
cluster=(TANDEM_ETCD_ENDPOINTS="http://127.0.0.1:$etcd_port" TANDEM_NATS_URL="nats://127.0.0.1:$nats_port")
worker() { # ROLE INDEX
  local env
  mapfile -t env < <(env_of "$base/cluster.env" "$base/$1.env")
  start "$1-$2" env "${env[@]}" "${cluster[@]}" \
    TANDEM_LISTEN=127.0.0.1:0 TANDEM_ADVERTISE_HOST=127.0.0.1 \
    TANDEM_KV_LISTEN=127.0.0.1:0 TANDEM_KV_ADVERTISE_HOST=127.0.0.1 \
    TANDEM_METRICS_ADDR="127.0.0.1:$(free_port)" TANDEM_KV_MEMORY=host \
    "$bin" "$1"
}
for i in $(seq 1 "$prefill"); do worker prefill "$i"; done
for i in $(seq 1 "$decode"); do worker decode "$i"; done
ports=() admins=()
mapfile -t fenv < <(env_of "$base/cluster.env" "$base/frontend.env")
for i in $(seq 1 "$frontends"); do
  port="$(free_port)" admin="$(free_port)"
  ports+=("$port") admins+=("$admin")
  start "frontend-$i" env "${fenv[@]}" "${cluster[@]}" TANDEM_LISTEN="127.0.0.1:$port" \
    TANDEM_ADMIN_LISTEN="127.0.0.1:$admin" "$bin" frontend
done
for port in "${ports[@]}"; do
  frontend_ready() { [ "$(http_status "$port" /health)" = 200 ]; }
  wait_until "the frontend on port $port" 120 frontend_ready
done

for port in "${ports[@]}"; do echo "127.0.0.1:$port"; done >"$dir/frontends.tmp"
for port in "${admins[@]}"; do echo "127.0.0.1:$port"; done >"$dir/admins"
for i in "${!pids[@]}"; do echo "${names[$i]} ${pids[$i]}"; done >"$dir/pids"
mv "$dir/frontends.tmp" "$dir/frontends"
echo "ready: frontends $(tr '\n' ' ' <"$dir/frontends")(logs in $dir)"

while [ "$stopping" = 0 ]; do
  for i in "${!pids[@]}"; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      echo "run.sh: ${names[$i]} exited on its own (log: $dir/${names[$i]}.log)" >&2
      stop_all; exit 1
    fi
  done
  sleep 0.5 &
  wait $! || true
done
stop_all
echo "stopped"
