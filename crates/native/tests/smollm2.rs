//! A real model: SmolLM2-135M-Instruct quantized to Q4_1 (its token embedding Q8_0, its norms
//! F32), as llama.cpp's converter wrote it. tandem-native must read the facts the forward pass
//! will need, read every metadata entry and tensor info as gguf-py's `GGUFReader` does, and
//! dequantize its tensors to gguf-py's bits.
//!
//! The file is `target/models/SmolLM2-135M-Instruct.Q4_1.gguf`, which scripts/test.sh
//! fetches; without it the test fails (never skips).

mod common;

use std::path::PathBuf;

use tandem_native::{GgmlType, GgufFile};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_path() -> PathBuf {
    let path = common::workspace_target().join("models").join(MODEL);
    assert!(
        path.exists(),
        "{} is missing: run scripts/test.sh, which fetches the model this test reads",
        path.display()
    );
    path
}

#[test]
fn smollm2_facts() {
    let f = GgufFile::read(model_path()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_u32("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 8192);
    assert_eq!(f.get_u32("llama.rope.dimension_count").unwrap(), 64);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        1e-5
    );
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        &tokens[..3],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49152
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(f.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert!(!f.get_bool("tokenizer.ggml.add_bos_token").unwrap());

    assert_eq!(f.tensors().len(), 2 + 30 * 9);
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.ty(), emb.dims()), (GgmlType::Q8_0, &[576, 49152][..]));
    // Tied embeddings: the output projection is the token embedding.
    assert!(f.tensor("output.weight").is_none());
    assert_eq!(f.tensor("output_norm.weight").unwrap().ty(), GgmlType::F32);
    for block in 0..30 {
        let t = |name: &str| {
            f.tensor(&format!("blk.{block}.{name}.weight"))
                .unwrap_or_else(|| panic!("blk.{block}.{name}.weight missing"))
        };
        for (name, dims) in [
            ("attn_q", [576, 576]),
            ("attn_k", [576, 192]),
            ("attn_v", [576, 192]),
            ("attn_output", [576, 576]),
            ("ffn_gate", [576, 1536]),
            ("ffn_up", [576, 1536]),
            ("ffn_down", [1536, 576]),
        ] {
            assert_eq!((t(name).ty(), t(name).dims()), (GgmlType::Q4_1, &dims[..]));
        }
        for name in ["attn_norm", "ffn_norm"] {
            assert_eq!((t(name).ty(), t(name).dims()), (GgmlType::F32, &[576][..]));
        }
    }
}

#[test]
fn smollm2_matches_gguf_py() {
    let path = model_path();
    let dir = common::scratch_dir("smollm2");
    let manifest = common::run_script(&["model".as_ref(), path.as_path(), dir.as_path()], &dir);
    let f = GgufFile::read(&path).unwrap();

    assert_eq!(
        u64::from(f.version()),
        manifest["version"].as_u64().unwrap()
    );
    assert_eq!(
        f.alignment() as u64,
        manifest["alignment"].as_u64().unwrap()
    );
    assert_eq!(
        f.data_offset() as u64,
        manifest["data_offset"].as_u64().unwrap()
    );
    common::assert_metadata(&f, &manifest);

    let tensors = manifest["tensors"].as_array().unwrap();
    assert_eq!(f.tensors().len(), tensors.len());
    for (t, want) in f.tensors().zip(tensors) {
        let info = t.info();
        assert_eq!(info.name, want["name"].as_str().unwrap());
        assert_eq!(
            info.ty.name(),
            want["type"].as_str().unwrap(),
            "{}",
            info.name
        );
        let dims: Vec<u64> = info.dims.iter().map(|&d| d as u64).collect();
        let want_dims: Vec<u64> = want["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(dims, want_dims, "{}", info.name);
        let file_offset = (f.data_offset() + info.offset) as u64;
        assert_eq!(
            file_offset,
            want["file_offset"].as_u64().unwrap(),
            "{}",
            info.name
        );
        assert_eq!(
            info.n_bytes as u64,
            want["n_bytes"].as_u64().unwrap(),
            "{}",
            info.name
        );
    }

    for sample in manifest["samples"].as_array().unwrap() {
        let name = sample["name"].as_str().unwrap();
        let t = f.tensor(name).unwrap();
        let want = common::read_f32(&dir.join(sample["expected"].as_str().unwrap()));
        let got = match sample["rows"].as_array() {
            None => t.dequantize().unwrap(),
            Some(rows) => {
                let mut got = Vec::new();
                let mut row = vec![0f32; t.info().row_len()];
                for r in rows {
                    t.dequantize_row(r.as_u64().unwrap() as usize, &mut row)
                        .unwrap();
                    got.extend_from_slice(&row);
                }
                got
            }
        };
        common::assert_bitwise(name, &got, &want);
    }
}
