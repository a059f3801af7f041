"""The semantic cache's figures on a labelled set (scripts/bench-semantic-cache.sh)."""

import json
import statistics
import sys
import time
import urllib.request


def post(url, body, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        answer = json.load(r)
        return answer, dict(r.headers), time.monotonic() - started


def wait_ready(base):
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    sys.exit("tandem up did not start")


def main():
    base, labelled, embeddings_url = sys.argv[1], sys.argv[2], sys.argv[3]
    items = json.load(open(labelled))["items"]
    wait_ready(base)
    # The text the cache embeds for a one-message chat (semantic_cache.rs, key_text).
    key = lambda q: f"user: {q}\n"
    url = embeddings_url or base + "/v1/embeddings"
    texts = [key(q) for item in items for q in item]
    vectors = []
    for i in range(0, len(texts), 32):
        answer, _, _ = post(url, {"input": texts[i:i + 32], "encoding_format": "float"})
        vectors += [d["embedding"] for d in answer["data"]]

    def distance(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        na = sum(x * x for x in a) ** 0.5
        nb = sum(x * x for x in b) ** 0.5
        return 1 - dot / (na * nb)

    para, alike = [], []
    for n in range(len(items)):
        q, p, f = vectors[3 * n:3 * n + 3]
        para.append(distance(q, p))
        alike.append(distance(q, f))
    print(f"{len(items)} labelled items; embeddings from {url}")
    print(f"paraphrase distance: median {statistics.median(para):.4f}, "
          f"max {max(para):.4f}; look-alike: median {statistics.median(alike):.4f}, "
          f"min {min(alike):.4f}")
    print("| threshold | hit rate (paraphrases) | false-hit rate (look-alikes) |")
    print("|---:|---:|---:|")
    for t in [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2]:
        hits = sum(d <= t for d in para) / len(para)
        false = sum(d <= t for d in alike) / len(alike)
        print(f"| {t} | {100 * hits:.0f} % | {100 * false:.0f} % |")

    # Latency: each of 10 questions asked twice through the chat API; the second is a hit.
    miss, hit = [], []
    for n, (q, _, _) in enumerate(items[:10]):
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": 32,
                "temperature": 0}
        _, h1, t1 = post(base + "/v1/chat/completions", body)
        _, h2, t2 = post(base + "/v1/chat/completions", body)
        said = (h1.get("x-tandem-semantic-cache"), h2.get("x-tandem-semantic-cache"))
        if said != ("miss", "hit"):
            print(f"item {n}: {said} (a hit from an earlier look-alike?)")
            continue
        miss.append(t1)
        hit.append(t2)
    if hit:
        print(f"latency over {len(hit)} questions, 32 tokens asked: miss median "
              f"{1000 * statistics.median(miss):.0f} ms, hit median "
              f"{1000 * statistics.median(hit):.0f} ms (the hit's embedding included)")


if __name__ == "__main__":
    main()
