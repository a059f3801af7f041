"""A GGUF of a real model's shape and metadata (tokenizer, template, hyperparameters) with
seeded random weights: for speed and identity checks on a machine the real file cannot reach
(the GPU machines here take 64 MiB per call; the SmolLM2 file is 98 MB). Its text is noise;
its timing and every exactness property (batch invariance, disaggregated == aggregated) are
the real model's.

    python3 synthetic_gguf.py --skeleton REAL.gguf SKEL   header + tensor table (needs gguf-py)
    python3 synthetic_gguf.py --fill SKEL OUT.gguf        the file, from the skeleton (numpy)
"""

import json
import struct
import sys


def skeleton(real, out):
    import gguf

    r = gguf.GGUFReader(real)
    table = [{"type": t.tensor_type.name, "offset": int(t.data_offset), "bytes": int(t.n_bytes)}
             for t in r.tensors]
    with open(real, "rb") as f:
        header = f.read(r.data_offset)
    meta = json.dumps(table).encode()
    with open(out, "wb") as f:
        f.write(struct.pack("<QQ", len(header), len(meta)))
        f.write(header)
        f.write(meta)


def fill(skel, out):
    import numpy as np

    with open(skel, "rb") as f:
        n_header, n_meta = struct.unpack("<QQ", f.read(16))
        header = f.read(n_header)
        table = json.loads(f.read(n_meta))
    rng = np.random.default_rng(1)

    def scales(n, lo, hi):
        return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)

    with open(out, "wb") as f:
        f.write(header)
        for t in sorted(table, key=lambda t: t["offset"]):
            f.write(b"\0" * (t["offset"] - f.tell()))
            n = t["bytes"]
            if t["type"] == "F32":
                # Norm weights: about one.
                data = rng.uniform(0.8, 1.2, n // 4).astype(np.float32).tobytes()
            elif t["type"] == "Q8_0":
                blocks = n // 34
                q = rng.integers(0, 256, (blocks, 32), dtype=np.uint8)
                data = np.concatenate([scales(blocks, 0.002, 0.01), q], axis=1).tobytes()
            elif t["type"] == "Q4_1":
                # d in [0.005, 0.02], m = -8 d: weights centred on zero.
                blocks = n // 20
                d = rng.uniform(0.005, 0.02, blocks).astype(np.float16)
                m = (-8 * d.astype(np.float32)).astype(np.float16)
                q = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
                dm = np.stack([d, m], axis=1).view(np.uint8).reshape(blocks, 4)
                data = np.concatenate([dm, q], axis=1).tobytes()
            else:
                sys.exit(f"synthetic_gguf: no generator for {t['type']}")
            assert len(data) == n, (t, len(data))
            f.write(data)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--skeleton":
        skeleton(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "--fill":
        fill(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
