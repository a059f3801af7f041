"""Disaggregated == aggregated through `tandem up`, bit for bit: the same requests (completions
of 10 to 3,000 tokens, greedy and seeded at temperature 0.8, with logprobs) against an
aggregated cluster and against disaggregated ones over each KV transport; every choice,
text and logprobs included, must be the same JSON. Prints a line per configuration and the
time each took; exits 1 on the first difference.

    python3 scripts/lib/served_identity.py TANDEM MODEL [UP FLAGS…]

The UP FLAGS go to every cluster (`--device cuda`, `--threads 2`…); SIZES=10,100 picks the
prompt lengths."""

import http.client
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tandem_up  # noqa: E402

tandem, model, extra = sys.argv[1], sys.argv[2], sys.argv[3:]


def prompt(seed, n):
    return [200 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]


REQUESTS = []
SIZES = [int(n) for n in os.environ.get("SIZES", "10,100,700,1500,3000").split(",")]
for i, n in enumerate(SIZES):
    for seeded in (False, True):
        body = {"prompt": prompt(i, n), "max_tokens": 24, "logprobs": 2, "ignore_eos": True}
        if seeded:
            body.update(temperature=0.8, seed=1000 + i)
        else:
            body.update(temperature=0)
        REQUESTS.append(body)
# A cached prefix: the second prompt extended (its blocks are on the decode worker).
REQUESTS.append({"prompt": prompt(1, SIZES[1]) + prompt(9, 300), "max_tokens": 24,
                 "temperature": 0, "logprobs": 2, "ignore_eos": True})


def run(flags):
    p, port = tandem_up.start(tandem, ["--model", model, *flags, *extra],
                              roles=tuple(r for r, k in (("prefill", "--prefill"),
                                                         ("decode", "--decode"))
                                          if flags[flags.index(k) + 1] != "0"))
    out = []
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("GET", "/v1/models")
        name = json.loads(c.getresponse().read())["data"][0]["id"]
        start = time.time()
        for body in REQUESTS:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            c.request("POST", "/v1/completions", json.dumps({"model": name, **body}),
                      {"content-type": "application/json"})
            r = c.getresponse()
            text = r.read().decode()
            if r.status != 200:
                sys.exit(f"{flags}: HTTP {r.status}: {text}")
            out.append(json.loads(text))
        took = time.time() - start
        c = http.client.HTTPConnection("127.0.0.1", tandem_up.admin_port(port), timeout=60)
        c.request("GET", "/metrics")
        prefills = {line.split('"')[1]: float(line.split()[-1])
                    for line in c.getresponse().read().decode().splitlines()
                    if line.startswith("tandem_prefills_total{")}
    finally:
        tandem_up.stop(p)
    return out, took, prefills


want, took, _ = run(["--prefill", "0", "--decode", "1"])
print(f"aggregated: {len(want)} requests in {took:.1f} s; first text {want[0]['choices'][0]['text']!r}")
failed = False
for transport in (None, "tcp"):
    flags = ["--prefill", "1", "--decode", "1", "--disagg", "always"]
    if transport:
        flags += ["--kv-transport", transport]
    got, took, prefills = run(flags)
    same = all(g["choices"] == w["choices"] for g, w in zip(got, want))
    remote = prefills.get("remote", 0) == len(REQUESTS)
    name = transport or "in-process copy"
    print(f"disaggregated ({name}): {len(got)} requests in {took:.1f} s, prefills {prefills}: "
          f"{'identical' if same else 'DIFFERENT'}")
    if not remote:
        failed = True
        print("  not every prefill was remote")
    if not same:
        failed = True
        for i, (g, w) in enumerate(zip(got, want)):
            if g["choices"] != w["choices"]:
                print(f"  request {i}: {json.dumps(g['choices'])[:300]}\n"
                      f"  aggregated: {json.dumps(w['choices'])[:300]}")
                break
sys.exit(1 if failed else 0)
