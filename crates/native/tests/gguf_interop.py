"""The independent side of tests/gguf_interop.rs and tests/smollm2.rs: gguf-py, the GGUF
authors' own Python package (it lives in llama.cpp's repository), writes and reads the files
and dequantizes their tensors; the Rust tests compare tandem-native's reading with what this
script reports.

    python3 gguf_interop.py synthetic OUT_DIR
        Writes OUT_DIR/synthetic.gguf with gguf-py's GGUFWriter (metadata of every value
        type, tensors of every type tandem loads), and for each tensor gguf-py's dequantized
        values as raw little-endian f32 (OUT_DIR/<name>.f32).
    python3 gguf_interop.py model MODEL.gguf OUT_DIR
        Reads MODEL.gguf with GGUFReader and dequantizes a few of its tensors.

Both write OUT_DIR/manifest.json: the metadata (each value as a node {"type", "value"}; f32
and f64 as their IEEE bits, so that nothing is lost in JSON), the tensors, and the expected
value files. Needs the gguf and numpy packages (scripts/test.sh installs them into
target/python/gguf).
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFValueType as VT, GGUFWriter
from gguf.quants import dequantize, quantize

TYPE_NAMES = {
    VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32",
    VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool", VT.STRING: "string",
    VT.ARRAY: "array", VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT64: "f64",
}


def encode(vtype, val, sub_type=None):
    """One metadata value as a JSON node, choosing array item types as GGUFWriter._pack_val
    does (sub_type if given, u8 for bytes, else the first item's type)."""
    name = TYPE_NAMES[vtype]
    if vtype == VT.FLOAT32:
        return {"type": name, "bits": struct.unpack("<I", struct.pack("<f", val))[0]}
    if vtype == VT.FLOAT64:
        return {"type": name, "bits": struct.unpack("<Q", struct.pack("<d", val))[0]}
    if vtype == VT.BOOL:
        return {"type": name, "value": bool(val)}
    if vtype == VT.STRING:
        return {"type": name, "value": val if isinstance(val, str) else val.decode("utf-8")}
    if vtype == VT.ARRAY:
        if sub_type is not None:
            item = sub_type
        elif isinstance(val, (bytes, bytearray)):
            item = VT.UINT8
        else:
            item = VT.get_type(val[0])
        return {"type": name, "items": TYPE_NAMES[item], "values": [encode(item, v) for v in val]}
    return {"type": name, "value": int(val)}


def write_f32(path, values):
    np.ascontiguousarray(values, dtype="<f4").tofile(path)


def synthetic(out):
    rng = np.random.default_rng(20240611)
    path = out / "synthetic.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)

    w.add_uint8("test.u8", 255)
    w.add_int8("test.i8", -128)
    w.add_uint16("test.u16", 65535)
    w.add_int16("test.i16", -32768)
    w.add_uint32("test.u32", 2**32 - 1)
    w.add_int32("test.i32", -(2**31))
    w.add_float32("test.f32", 3.14159)
    w.add_float32("test.f32.neg_zero", -0.0)
    w.add_float32("test.f32.inf", float("inf"))
    w.add_float32("test.f32.subnormal", 1e-40)
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -(2**63))
    w.add_float64("test.f64", 2.718281828459045)
    w.add_bool("test.bool.true", True)
    w.add_bool("test.bool.false", False)
    w.add_string("test.string", "héllo wörld — 你好 🦀 \n\t\"quoted\"")
    # add_string skips empty strings; the generic call writes one.
    w.add_key_value("test.string.empty", "", VT.STRING)
    typed = [
        (VT.UINT8, [0, 1, 255]), (VT.INT8, [-128, 0, 127]), (VT.UINT16, [0, 65535]),
        (VT.INT16, [-32768, 32767]), (VT.UINT32, [0, 2**32 - 1]), (VT.INT32, [-(2**31), 7]),
        (VT.FLOAT32, [float(x) for x in rng.standard_normal(5).astype(np.float32)]),
        (VT.BOOL, [True, False, True]), (VT.UINT64, [0, 2**64 - 1]),
        (VT.INT64, [-(2**63), 2**63 - 1]), (VT.FLOAT64, [0.1, -1e300, 5e-324]),
        (VT.STRING, ["a", "", "ü€", "<|im_start|>", "Ġ t"]),
    ]
    for item, values in typed:
        w.add_key_value(f"test.array.{TYPE_NAMES[item]}", values, VT.ARRAY, sub_type=item)
    w.add_array("test.array.bytes", b"\x00\x7f\xff")
    # Arrays of arrays, each inner one typed by its first item (int -> i32, float -> f32).
    w.add_array("test.array.nested", [[1, 2, 3], [4], ["x", "yz"], [[1.5], [2.5, -3.5]], [True]])

    tensors = []  # (name, data as written, raw ggml type or None, expected f32 values)

    def add(name, data, qtype, raw):
        w.add_tensor(name, data, raw_dtype=qtype if raw else None)
        tensors.append((name, qtype, dequantize(data, qtype)))

    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -1.0], np.float32)
    f32 = rng.standard_normal(2 * 3 * 40).astype(np.float32)
    f32[: len(specials)] = specials
    add("f32.cube", f32.reshape(2, 3, 40), Q.F32, False)

    # f16 specials: quiet NaN, infinities, -0, the smallest subnormal, the largest normal. No
    # signalling NaN: numpy's f16 -> f32 keeps it signalling, ggml's conversions (and
    # tandem's) make it quiet; tandem's unit tests check ggml's behaviour there.
    f16 = (rng.standard_normal(4 * 48) * 10).astype(np.float16)
    f16[:7] = np.array([0x7E00, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x7BFF, 0x3C00], np.uint16).view(
        np.float16
    )
    add("f16.mat", f16.reshape(4, 48), Q.F16, False)

    bf16_src = rng.standard_normal(3 * 64).astype(np.float32) * 100
    bf16_src[: len(specials)] = specials
    add("bf16.mat", quantize(bf16_src.reshape(3, 64), Q.BF16), Q.BF16, True)

    for name, qtype, shape in [
        ("q8_0.mat", Q.Q8_0, (8, 256)),
        ("q4_0.mat", Q.Q4_0, (4, 128)),
        ("q4_1.mat", Q.Q4_1, (5, 96)),
    ]:
        x = rng.standard_normal(shape).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block: scale 0
        add(name, quantize(x, qtype), qtype, True)

    # K-quants: gguf-py cannot quantize them, so random blocks with sane f16 scales. Every
    # other byte (6-bit scales, quants, high bits, Q6_K's i8 scales) is random.
    for name, qtype, rows, blocks_per_row, f16_at in [
        ("q4_k.mat", Q.Q4_K, 3, 2, (0, 2)),
        ("q5_k.mat", Q.Q5_K, 2, 3, (0, 2)),
        ("q6_k.mat", Q.Q6_K, 3, 2, (208,)),
    ]:
        _, type_size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
        for at in f16_at:
            scale = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16)
            raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
        add(name, raw.reshape(rows, blocks_per_row * type_size), qtype, True)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    metadata = [
        {"key": key, "node": encode(v.type, v.value, v.sub_type)} for key, v in w.kv_data[0].items()
    ]
    manifest_tensors = []
    for name, qtype, expected in tensors:
        file = f"{name}.f32"
        write_f32(out / file, expected)
        manifest_tensors.append({
            "name": name,
            "type": qtype.name,
            "type_id": int(qtype),
            "dims": list(reversed(expected.shape)),
            "expected": file,
        })
    types = [
        {"name": t.name, "id": int(t), "block_size": bs, "type_size": ts}
        for t, (bs, ts) in GGML_QUANT_SIZES.items()
    ]
    return {
        "file": path.name,
        "version": 3,
        "alignment": 64,
        "metadata": metadata,
        "tensors": manifest_tensors,
        "types": types,
    }


# The model's tensors to dequantize: all of a tensor, or some of its rows (the token
# embedding is 28M values; its first, last and a few middle rows are enough).
MODEL_SAMPLES = [
    ("token_embd.weight", [0, 1, 2, 1000, 30000, 49151]),
    ("blk.0.attn_q.weight", None),
    ("blk.29.ffn_down.weight", None),
    ("blk.0.attn_norm.weight", None),
    ("output_norm.weight", None),
]


def model(path, out):
    r = GGUFReader(str(path))
    metadata = []
    for key, field in r.fields.items():
        if key.startswith("GGUF."):  # the reader's own pseudo-fields for the header
            continue
        vtype = field.types[0]
        if vtype == VT.ARRAY:
            assert len(field.types) == 2, f"{key}: nested arrays are not read by GGUFReader"
            node = encode(vtype, field.contents(), field.types[1])
        else:
            node = encode(vtype, field.contents())
        metadata.append({"key": key, "node": node})
    manifest_tensors = []
    for t in r.tensors:
        manifest_tensors.append({
            "name": t.name,
            "type": t.tensor_type.name,
            "type_id": int(t.tensor_type),
            "dims": [int(d) for d in t.shape],
            "file_offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        })
    by_name = {t.name: t for t in r.tensors}
    samples = []
    for name, rows in MODEL_SAMPLES:
        t = by_name[name]
        data = t.data if rows is None else t.data[rows]
        file = f"{name}.f32"
        write_f32(out / file, dequantize(data, t.tensor_type))
        samples.append({"name": name, "rows": rows, "expected": file})
    version = int(r.fields["GGUF.version"].contents())
    return {
        "version": version,
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "metadata": metadata,
        "tensors": manifest_tensors,
        "samples": samples,
    }


def main():
    mode = sys.argv[1]
    if mode == "synthetic":
        out = Path(sys.argv[2])
        manifest = synthetic(out)
    elif mode == "model":
        out = Path(sys.argv[3])
        manifest = model(Path(sys.argv[2]), out)
    else:
        sys.exit(f"unknown mode {mode!r}")
    with open(out / "manifest.json", "w", encoding="utf-8") as f:
        json.dump(manifest, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
