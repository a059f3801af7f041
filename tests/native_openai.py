"""The official `openai` client against `tandem up --model` (tests/native.rs): a streamed chat
with usage and logprobs, top_k / min_p that make a draw greedy, completions logprobs, a
repeated long prompt's cached tokens, and embeddings (base64 as the client asks by default,
and float). Asserts on the client's parsed objects; prints what the
Rust test checks too, as JSON."""

import json
import math
import sys
import time

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id
question = [{"role": "user", "content": "Name three colors."}]
out = {}

# A streamed greedy chat with usage and three alternatives per token.
stream = client.chat.completions.create(
    model=model, messages=question, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True}, logprobs=True, top_logprobs=3)
text, entries, usage = "", [], None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        text += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            entries.extend(choice.logprobs.content)
assert usage is not None and usage.completion_tokens == len(entries), (usage, len(entries))
assert b"".join(bytes(e.bytes) for e in entries).decode() == text, (entries, text)
for e in entries:
    assert e.logprob <= 0.0, e
    top = [t.logprob for t in e.top_logprobs]
    assert len(top) == 3 and top == sorted(top, reverse=True), e
    # Greedy: the token drawn is the most likely one.
    assert e.top_logprobs[0].token == e.token, e
    assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5, e
out["text"] = text
out["logprobs"] = [e.logprob for e in entries]

# top_k 1, and min_p 1, leave only the most likely token: at temperature 1 the draw is greedy.
for extra in ({"top_k": 1}, {"min_p": 1.0}):
    r = client.chat.completions.create(
        model=model, messages=question, max_tokens=24, temperature=1.0, seed=7, extra_body=extra)
    assert r.choices[0].message.content == text, (extra, r.choices[0].message.content, text)
    assert r.choices[0].logprobs is None

# Completions logprobs: tokens spell the text, offsets index it, the chosen one is in its top.
r = client.completions.create(
    model=model, prompt="The three primary colors are", max_tokens=8, temperature=0, logprobs=2)
lp = r.choices[0].logprobs
assert "".join(lp.tokens) == r.choices[0].text, (lp.tokens, r.choices[0].text)
assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
at = 0
for token, offset, top in zip(lp.tokens, lp.text_offset, lp.top_logprobs):
    assert offset == at and token in top and len(top) <= 3, (token, offset, top)
    at += len(token)

# A long prompt twice: the second finds it cached (all but its last, partial, block).
long = [{"role": "user", "content": " ".join(f"item {i} is number {i * 7 % 100};" for i in range(90))}]
times = []
for _ in range(2):
    started = time.monotonic()
    r = client.chat.completions.create(model=model, messages=long, max_tokens=1, temperature=0)
    times.append(time.monotonic() - started)
    out.setdefault("cached", []).append(r.usage.prompt_tokens_details.cached_tokens)
out["long_prompt_tokens"] = r.usage.prompt_tokens
out["long_seconds"] = times

# Embeddings: three inputs in one request (the client asks for base64 and decodes it), then
# the first again as floats; a paraphrase lies closer than an unrelated sentence.
texts = ["How do I reset my password?", "What is the way to change my password?",
         "The weather in Paris is sunny today."]
e = client.embeddings.create(model=model, input=texts)
assert [d.index for d in e.data] == [0, 1, 2], e.data
vectors = [list(d.embedding) for d in e.data]
dim = len(vectors[0])
assert all(len(v) == dim for v in vectors)
for v in vectors:
    assert abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-4
assert e.usage.prompt_tokens == e.usage.total_tokens > 0, e.usage
f = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
assert max(abs(a - b) for a, b in zip(f.data[0].embedding, vectors[0])) < 1e-6


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b))


out["embedding_dim"] = dim
out["cosines"] = [cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])]
assert out["cosines"][0] > out["cosines"][1], out["cosines"]
# The model's embeddings cannot be shortened: a 400 the client raises.
try:
    client.embeddings.create(model=model, input="x", dimensions=8)
    raise AssertionError("dimensions=8 was accepted")
except openai.BadRequestError as err:
    assert "dimensions" in str(err), err
print(json.dumps(out))
