"""Instructions a request costs each tandem row of scripts/bench-gateways.sh, counted by
callgrind (valgrind): the gateway runs under callgrind with its instrumentation off while it
starts and warms up, then on for a wrk run at 8 connections with no think time. Unlike CPU
time, the count barely moves between runs (0.02 % between two runs of one binary on the VM
whose CPU time per request drifts by a fifth), so a change of a few percent reads in one run.
It counts instructions, not time: a cache miss or a system call counts as little as any
instruction, and `rep movsb` counts once per byte moved.

Environment: ROWS (default "tandem-kv tandem-up"; also "vllm-rr", vLLM's router from the venv
scripts/bench-gateways.sh installs, and "floor", the bare hyper proxy), SECONDS_RUN (default
10), BASELINE (another `tandem` binary: each tandem row runs on it too, right after).
"""

import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import bench_gateways as g  # noqa: E402  (the body, the wrk script and the rows' commands)

ROWS = os.environ.get("ROWS", "tandem-kv tandem-up").split()
SECONDS_RUN = int(os.environ.get("SECONDS_RUN", "10"))
BIN = os.path.join("target", os.environ.get("PROFILE", "dist"))


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(name, argv):
    """(requests, instructions) of `argv` serving wrk for SECONDS_RUN seconds."""
    out = os.path.join(g.OUT, f"{name}.callgrind")
    port = g.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = g.start(name, ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                          f"--callgrind-out-file={out}", *argv(port)])
    try:
        g.wait_ready(url, proc, name, timeout=300)
        g.wrk(url, 8, 3, 0, f"{name}-warm")
        control = ["callgrind_control"]
        subprocess.run([*control, "-i", "on", str(proc.pid)], check=True, capture_output=True)
        requests = g.wrk(url, 8, SECONDS_RUN, 0, name)["requests"]
        subprocess.run([*control, "-i", "off", str(proc.pid)], check=True, capture_output=True)
        subprocess.run([*control, "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        stop(proc)
    # The dump is the file with a part number (`<out>.1`); its `totals:` line is the count.
    with open(out + ".1") as f:
        total = next(int(l.split()[1]) for l in f if l.startswith("totals:"))
    return requests, total


def main():
    stub_port = g.free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    stub = g.start("stub", [f"{BIN}/tandem-standin", "--listen", f"127.0.0.1:{stub_port}",
                            "--speedup-ratio", "1e9"])
    try:
        g.wait_ready(stub_url, stub, "stub")
        commands = {
            "floor": lambda p: [f"{BIN}/tandem-floor-proxy", f"127.0.0.1:{p}",
                                f"127.0.0.1:{stub_port}", "2"],
            "vllm-rr": lambda p: [f"{g.VENV}/vllm-router", "--host", "127.0.0.1", "--port",
                                  str(p), "--worker-urls", stub_url, "--policy",
                                  "round_robin", "--log-level", "warning",
                                  "--prometheus-port", str(g.free_port())],
        }
        builds = [("", f"{BIN}/tandem")] + ([("@baseline", g.BASELINE)] if g.BASELINE else [])
        for suffix, tandem in builds:
            commands.update({r + suffix: c for r, c in g.tandem_commands(tandem, stub_url).items()})
        print("| row | requests | instructions per request |")
        print("|---|---:|---:|")
        for row in ROWS:
            for name in [row] + ([row + "@baseline"] if row + "@baseline" in commands else []):
                requests, total = measure(name, commands[name])
                print(f"| {name} | {requests:,} | {total // requests:,} |", flush=True)
    finally:
        stop(stub)
    print(f"\ncallgrind's files and wrk's output under {g.OUT}")


if __name__ == "__main__":
    main()
