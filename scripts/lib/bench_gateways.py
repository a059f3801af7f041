"""Runs scripts/bench-gateways.sh's comparison (see there); stdlib only."""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The profile scripts/bench-gateways.sh built (`dist` unless PROFILE says otherwise).
BIN = os.path.join(ROOT, "target", os.environ.get("PROFILE", "dist"))
VENV = os.path.join(ROOT, "target", "python", "gateways", "bin")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
LATENCY_S = int(os.environ.get("SECONDS_LATENCY", "10"))
RAMP_S = int(os.environ.get("SECONDS_RAMP", "4"))
RAMP_CONNS = [int(c) for c in os.environ.get("RAMP_CONNS", "8 32 64").split()]
THINK_MS = int(os.environ.get("THINK_MS", "20"))
CONNS = int(os.environ.get("CONNS", "8"))
GATEWAYS = os.environ.get(
    "GATEWAYS", "direct vllm-rr smg-rr smg-cache tandem-kv tandem-rr tandem-up"
).split()
# Another `tandem` binary (an older build): each tandem row runs on it too, as
# "<row>@baseline" right after it in every round, for a before/after within one run.
BASELINE = os.environ.get("BASELINE")
if BASELINE:
    GATEWAYS = [x for g in GATEWAYS
                for x in ([g, g + "@baseline"] if g.startswith("tandem") else [g])]
OUT = os.environ.get("OUT") or tempfile.mkdtemp(prefix="tandem-gateways-")
os.makedirs(OUT, exist_ok=True)
TICK = os.sysconf("SC_CLK_TCK")

# One chat a client might send: a system prompt of ~500 bytes and a question, 16 tokens out,
# not streamed.
SYSTEM = (
    "You are a careful assistant for a company that runs language models on GPU clusters. "
    "Answer in short sentences, cite the document you used, and say when you do not know. "
) * 3
BODY = json.dumps(
    {
        "model": "mocker",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "How do I read the router's cache hit rate?"},
        ],
        "max_tokens": 16,
        "temperature": 0,
    }
)

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = %s
local think = %d
if think > 0 then
  function delay() return think end
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests":%%d,"duration_us":%%d,"status_errors":%%d,"other_errors":%%d,' ..
    '"p50_us":%%d,"p99_us":%%d}\\n',
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


TAKEN = set()


def free_port():
    """A free loopback port, never one handed out before in this run."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in TAKEN:
            TAKEN.add(port)
            return port


def cpu_ticks(root):
    """utime + stime of `root` and every process under it."""
    parents = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    total, tree = 0, {root}
    changed = True
    while changed:
        changed = False
        for pid, (ppid, _) in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    for pid in tree:
        if pid in parents:
            total += parents[pid][1]
    return total


def wait_ready(url, proc, name, timeout=120):
    end = time.time() + timeout
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=BODY.encode(),
        headers={"content-type": "application/json"},
    )
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"{name} exited: see {OUT}/{name}.log")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.3)
    sys.exit(f"{name} not ready in {timeout} s: see {OUT}/{name}.log")


def start(name, argv):
    log = open(os.path.join(OUT, f"{name}.log"), "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wrk(url, conns, seconds, think, tag):
    script = os.path.join(OUT, f"wrk-{think}.lua")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(LUA % (json.dumps(BODY), think))
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--timeout", "10s", "-s", script,
         url + "/v1/chat/completions"],
        capture_output=True, text=True, check=True,
    ).stdout
    with open(os.path.join(OUT, f"{tag}.txt"), "w") as f:
        f.write(out)
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def tandem_commands(tandem, stub_url):
    """The tandem rows, run with the binary `tandem`."""
    return {
        "tandem-kv": lambda p: [tandem, "frontend", "--listen", f"127.0.0.1:{p}",
                                "--admin-listen", "off", "--backend-url", stub_url],
        "tandem-rr": lambda p: [tandem, "frontend", "--listen", f"127.0.0.1:{p}",
                                "--admin-listen", "off", "--backend-url", stub_url,
                                "--policy", "round-robin"],
        # No server behind it: one in-process mocker worker answering at once, as the stub
        # does. Its CPU is the frontend's and the engine's together (compare with direct).
        "tandem-up": lambda p: [tandem, "up", "--port", str(p), "--admin-listen",
                                "off", "--prefill", "0", "--decode", "1",
                                "--engine", "mocker", "--speedup-ratio", "1e9"],
    }


def main():
    procs = {}
    stub_port = free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    procs["stub"] = start("stub", [f"{BIN}/tandem-standin", "--listen", f"127.0.0.1:{stub_port}",
                                   "--speedup-ratio", "1e9"])
    urls = {"direct": stub_url}
    roots = {"direct": procs["stub"].pid}
    commands = {
        # The least a proxy on hyper costs (src/bin/tandem-floor-proxy.rs): the floor under
        # every gateway here, parsing nothing.
        "floor": lambda p: [f"{BIN}/tandem-floor-proxy", f"127.0.0.1:{p}",
                            f"127.0.0.1:{stub_port}", "2"],
        "vllm-rr": lambda p: [f"{VENV}/vllm-router", "--host", "127.0.0.1", "--port", str(p),
                              "--worker-urls", stub_url, "--policy", "round_robin",
                              "--log-level", "warning", "--prometheus-port", str(free_port())],
        "smg-rr": lambda p: [f"{VENV}/smg", "launch", "--host", "127.0.0.1", "--port", str(p),
                             "--worker-urls", stub_url, "--policy", "round_robin",
                             "--log-level", "warn", "--prometheus-port", str(free_port())],
        "smg-cache": lambda p: [f"{VENV}/smg", "launch", "--host", "127.0.0.1", "--port", str(p),
                                "--worker-urls", stub_url, "--policy", "cache_aware",
                                "--log-level", "warn", "--prometheus-port", str(free_port())],
    }
    for suffix, tandem in [("", f"{BIN}/tandem"), ("@baseline", BASELINE)]:
        if tandem:
            commands.update({g + suffix: c for g, c in tandem_commands(tandem, stub_url).items()})
    try:
        wait_ready(stub_url, procs["stub"], "stub")
        for g in GATEWAYS:
            if g == "direct":
                continue
            port = free_port()
            procs[g] = start(g, commands[g](port))
            urls[g] = f"http://127.0.0.1:{port}"
            roots[g] = procs[g].pid
        for g in GATEWAYS:
            wait_ready(urls[g], procs[g if g != "direct" else "stub"], g)
            wrk(urls[g], CONNS, 2, 0, f"warmup-{g}")
        rows = {g: [] for g in GATEWAYS}
        for r in range(ROUNDS):
            for g in GATEWAYS:
                t0 = cpu_ticks(roots[g])
                lat = wrk(urls[g], CONNS, LATENCY_S, THINK_MS, f"{g}-latency-r{r}")
                cpu = (cpu_ticks(roots[g]) - t0) / TICK
                best = 0.0
                for c in RAMP_CONNS:
                    ramp = wrk(urls[g], c, RAMP_S, 0, f"{g}-ramp-c{c}-r{r}")
                    best = max(best, ramp["requests"] / (ramp["duration_us"] / 1e6))
                    if ramp["status_errors"] or ramp["other_errors"]:
                        print(f"{g}: errors in ramp at {c} connections", file=sys.stderr)
                if lat["status_errors"] or lat["other_errors"]:
                    print(f"{g}: errors in latency run", file=sys.stderr)
                rows[g].append((lat["p50_us"] / 1e3, lat["p99_us"] / 1e3,
                                cpu / lat["requests"] * 1e6, best))
                print(f"round {r + 1} {g}: {rows[g][-1]}", file=sys.stderr)
        med = {g: [statistics.median(x[i] for x in rows[g]) for i in range(4)] for g in GATEWAYS}
        base = med.get("direct")
        print(f"\n{CONNS} connections, {THINK_MS} ms think time, {LATENCY_S} s per run; "
              f"ramp {RAMP_CONNS} connections, no think time; medians of {ROUNDS} rounds; "
              f"output under {OUT}\n")
        # The machine drifts between rounds by more than the gateways differ, so each
        # round's CPU is also read against vllm-router's in that same round.
        ref = rows.get("vllm-rr")
        print("| gateway | p50 ms | p99 ms | added p50 | added p99 | CPU per request "
              "| CPU / vllm-router's, by round | most req/s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for g in GATEWAYS:
            p50, p99, cpu, best = med[g]
            behind_stub = base and g != "direct" and not g.startswith("tandem-up")
            added = (f"+{p50 - base[0]:.2f} ms", f"+{p99 - base[1]:.2f} ms") if behind_stub else ("", "")
            cpu_s = f"{cpu:.0f} µs"
            by_round = ""
            if ref and g not in ("vllm-rr", "direct"):
                ratios = sorted(x[2] / y[2] for x, y in zip(rows[g], ref))
                by_round = (f"{statistics.median(ratios):.2f} "
                            f"({ratios[0]:.2f}–{ratios[-1]:.2f})")
            print(f"| {g} | {p50:.2f} | {p99:.2f} | {added[0]} | {added[1]} | {cpu_s} "
                  f"| {by_round} | {best:,.0f} |")
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
