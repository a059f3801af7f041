//! Shared by the interop tests: the gguf-py venv and its script, a scratch directory, the
//! manifest's encoding of metadata values, and bitwise comparison of f32 runs.

#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value as Json, json};
use tandem_native::{Array, Value};

/// The workspace's `target/` (where scripts/test.sh puts the venvs and the model), whatever
/// `CARGO_TARGET_DIR` the build uses.
pub fn workspace_target() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target")
}

/// gguf-py's Python; the test fails (never skips) without it.
pub fn python() -> PathBuf {
    let python = workspace_target().join("python/gguf/bin/python3");
    assert!(
        python.exists(),
        "{} is missing: run scripts/test.sh, which makes the venv target/python/gguf with the \
         gguf and numpy packages (gguf-py, the GGUF authors' own implementation, is what this \
         test checks tandem-native against)",
        python.display()
    );
    python
}

/// Runs tests/gguf_interop.py with `args` and reads the manifest it writes to `out`.
pub fn run_script(args: &[&Path], out: &Path) -> Json {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_interop.py");
    let output = Command::new(python())
        .arg(&script)
        .args(args)
        .output()
        .expect("start gguf-py's python");
    assert!(
        output.status.success(),
        "{} failed ({}):\n{}",
        script.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let manifest = std::fs::read(out.join("manifest.json")).expect("read manifest.json");
    serde_json::from_slice(&manifest).expect("parse manifest.json")
}

/// An empty directory for this test under cargo's per-crate scratch space. It is left behind
/// when the test fails, to look at; the next run starts it afresh.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// A raw little-endian f32 file.
pub fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}", path.display());
    let (words, _) = bytes.as_chunks::<4>();
    words.iter().map(|w| f32::from_le_bytes(*w)).collect()
}

/// Asserts `got` and `want` equal bit for bit, naming the first element that differs.
pub fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: element count");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} is {} ({:#010x}), gguf-py has {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// A metadata value as tests/gguf_interop.py's `encode` writes it: `{"type", "value"}`, f32
/// and f64 as `"bits"`, arrays as `{"type": "array", "items", "values": [nodes]}`.
pub fn node(v: &Value) -> Json {
    match v {
        Value::U8(x) => json!({"type": "u8", "value": x}),
        Value::I8(x) => json!({"type": "i8", "value": x}),
        Value::U16(x) => json!({"type": "u16", "value": x}),
        Value::I16(x) => json!({"type": "i16", "value": x}),
        Value::U32(x) => json!({"type": "u32", "value": x}),
        Value::I32(x) => json!({"type": "i32", "value": x}),
        Value::U64(x) => json!({"type": "u64", "value": x}),
        Value::I64(x) => json!({"type": "i64", "value": x}),
        Value::F32(x) => json!({"type": "f32", "bits": x.to_bits()}),
        Value::F64(x) => json!({"type": "f64", "bits": x.to_bits()}),
        Value::Bool(x) => json!({"type": "bool", "value": x}),
        Value::String(x) => json!({"type": "string", "value": x}),
        Value::Array(a) => array_node(a),
    }
}

fn array_node(a: &Array) -> Json {
    fn each<T: Clone>(items: &[T], wrap: fn(T) -> Value) -> Vec<Json> {
        items.iter().map(|x| node(&wrap(x.clone()))).collect()
    }
    let values = match a {
        Array::U8(v) => each(v, Value::U8),
        Array::I8(v) => each(v, Value::I8),
        Array::U16(v) => each(v, Value::U16),
        Array::I16(v) => each(v, Value::I16),
        Array::U32(v) => each(v, Value::U32),
        Array::I32(v) => each(v, Value::I32),
        Array::U64(v) => each(v, Value::U64),
        Array::I64(v) => each(v, Value::I64),
        Array::F32(v) => each(v, Value::F32),
        Array::F64(v) => each(v, Value::F64),
        Array::Bool(v) => each(v, Value::Bool),
        Array::String(v) => each(v, Value::String),
        Array::Array(v) => v.iter().map(array_node).collect(),
    };
    json!({"type": "array", "items": a.item_type().name(), "values": values})
}

/// Asserts the file's metadata equals the manifest's, entry by entry and in order.
pub fn assert_metadata(file: &tandem_native::GgufFile, manifest: &Json) {
    let want = manifest["metadata"].as_array().expect("metadata list");
    let got: Vec<(&str, &Value)> = file.metadata_entries().collect();
    let got_keys: Vec<&str> = got.iter().map(|(k, _)| *k).collect();
    let want_keys: Vec<&str> = want.iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert_eq!(got_keys, want_keys, "metadata keys");
    for ((key, value), entry) in got.iter().zip(want) {
        assert!(
            node(value) == entry["node"],
            "metadata {key:?}: tandem read {value:?}, gguf-py has {}",
            entry["node"]
        );
    }
}
