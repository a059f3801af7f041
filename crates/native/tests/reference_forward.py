"""An independent forward pass for tests/logits.rs: NumPy over weights the GGUF authors' own
`gguf` package reads and dequantizes.

    python3 reference_forward.py MODEL.gguf PROMPTS.json OUT_DIR

PROMPTS.json is a list of token-id lists; for prompt i, OUT_DIR/i.f32 receives the logits of
its last position (little-endian float32, n_vocab values), OUT_DIR/i.hidden.f32 that
position's final (output-normed) hidden state scaled to length 1 (its embedding, n_embd
values), and OUT_DIR/i.argmax.json the most
likely next token at every position (teacher forcing) with its margin over the second. Computed in float64, with K and V
rounded to float16 as a KV cache in half precision holds them (tandem's and llama.cpp's).
Llama architecture only: RMSNorm, RoPE on adjacent pairs (ggml's normal mode), grouped-query
attention, SwiGLU, the output tied to the embedding when the file has no output.weight.
"""

import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    path, prompts_path, out_dir = sys.argv[1:4]
    reader = GGUFReader(path)

    def field(key):
        return reader.fields[key].contents()

    arch = field("general.architecture")
    assert arch == "llama", arch
    n_layer = field(f"{arch}.block_count")
    n_head = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv")
    eps = field(f"{arch}.attention.layer_norm_rms_epsilon")
    base = field(f"{arch}.rope.freq_base")
    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        t = tensors[name]
        values = dequantize(t.data, t.tensor_type)
        return np.asarray(values, dtype=np.float64).reshape(-1, int(t.shape[0]))

    def vector(name):
        return weight(name).reshape(-1)

    embed = weight("token_embd.weight")
    output = weight("output.weight") if "output.weight" in tensors else embed
    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        layers.append({k: weight(p + k + ".weight") for k in
                       ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]})
        layers[-1]["attn_norm"] = vector(p + "attn_norm.weight")
        layers[-1]["ffn_norm"] = vector(p + "ffn_norm.weight")
    out_norm = vector("output_norm.weight")
    d = embed.shape[1]
    hd = d // n_head
    group = n_head // n_kv

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x, pos):
        # x: [tokens, heads, hd]; pairs (2i, 2i+1).
        i = np.arange(hd // 2)
        theta = pos[:, None] * base ** (-2.0 * i / hd)
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    with open(prompts_path) as f:
        prompts = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    for n, ids in enumerate(prompts):
        t = len(ids)
        pos = np.arange(t, dtype=np.float64)
        x = embed[np.array(ids)]
        mask = np.triu(np.full((t, t), -np.inf), k=1)
        for L in layers:
            h = rms(x, L["attn_norm"])
            q = rope((h @ L["attn_q"].T).reshape(t, n_head, hd), pos)
            k = rope((h @ L["attn_k"].T).reshape(t, n_kv, hd), pos)
            v = (h @ L["attn_v"].T).reshape(t, n_kv, hd)
            k = k.astype(np.float16).astype(np.float64)
            v = v.astype(np.float16).astype(np.float64)
            att = np.empty((t, n_head, hd))
            for head in range(n_head):
                kh, vh = k[:, head // group], v[:, head // group]
                scores = q[:, head] @ kh.T / np.sqrt(hd) + mask
                scores -= scores.max(axis=-1, keepdims=True)
                w = np.exp(scores)
                w /= w.sum(axis=-1, keepdims=True)
                att[:, head] = w @ vh
            x = x + att.reshape(t, d) @ L["attn_output"].T
            h = rms(x, L["ffn_norm"])
            g = h @ L["ffn_gate"].T
            u = h @ L["ffn_up"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ L["ffn_down"].T
        hidden = rms(x, out_norm)
        logits = hidden @ output.T
        logits[-1].astype("<f4").tofile(os.path.join(out_dir, f"{n}.f32"))
        last = hidden[-1] / np.linalg.norm(hidden[-1])
        last.astype("<f4").tofile(os.path.join(out_dir, f"{n}.hidden.f32"))
        top2 = np.sort(logits, axis=-1)[:, -2:]
        with open(os.path.join(out_dir, f"{n}.argmax.json"), "w") as f:
            json.dump({"argmax": [int(i) for i in logits.argmax(axis=-1)],
                       "margin": [float(m) for m in top2[:, 1] - top2[:, 0]]}, f)


if __name__ == "__main__":
    main()
