//! The GGUF's tokenizer against llama.cpp's (an independent implementation): the ids
//! llama.cpp gives for each test string are recorded in fixtures/smollm2_tokens.json (made by
//! fixtures/tokenize_llamacpp.py with llama-cpp-python 0.3.36), and tandem must give the same
//! ids, with special tokens parsed, and decode them back to the text.

use std::path::Path;

use tandem_native::GgufFile;

#[test]
fn smollm2_tokenizes_as_llama_cpp_does() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: scripts/test.sh fetches it",
        path.display()
    );
    let file = GgufFile::read(&path).unwrap();
    let tok = tandem_native::tokenizer::from_gguf(&file).unwrap();
    let fixtures: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm2_tokens.json")).unwrap();
    let cases = fixtures["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(
            tok.decode(&got, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
    let info = tandem_native::tokenizer::info(&file).unwrap();
    assert_eq!(
        tok.id_to_token(info.eos.unwrap()).as_deref(),
        Some("<|im_end|>")
    );
    assert!(info.chat_template.unwrap().contains("<|im_start|>"));
}

#[test]
fn a_tokenizer_the_engine_cannot_build_is_refused_by_name() {
    // A GGUF whose tokenizer is SentencePiece ("llama"): a clear error, not wrong ids.
    let bytes = gguf_with_tokenizer_model("llama");
    let file = GgufFile::parse(bytes).unwrap();
    let err = tandem_native::tokenizer::from_gguf(&file).unwrap_err();
    assert!(err.to_string().contains("\"llama\""), "{err}");
}

/// A minimal GGUF v3 with `tokenizer.ggml.model = model` and no tensors.
fn gguf_with_tokenizer_model(model: &str) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    let key = "tokenizer.ggml.model";
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(&8u32.to_le_bytes()); // string
    b.extend_from_slice(&(model.len() as u64).to_le_bytes());
    b.extend_from_slice(model.as_bytes());
    b
}
