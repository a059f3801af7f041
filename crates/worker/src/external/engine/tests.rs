//! Tests of the engine client: SSE framing, each API's deltas and request bodies.

use super::*;

fn events_of(chunks: &[&'static str]) -> Vec<Result<String, String>> {
    let body = futures::stream::iter(
        chunks
            .iter()
            .map(|c| Ok::<_, reqwest::Error>(Bytes::from_static(c.as_bytes())))
            .collect::<Vec<_>>(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(
        sse_events(body)
            .map(|r| r.map_err(|e| e.to_string()))
            .collect(),
    )
}

#[test]
fn sse_events_split_across_chunks_and_line_endings() {
    let got = events_of(&[
        "data: {\"a\"",
        ":1}\n\n: a comment\n\nevent: x\r\ndata: 2\r\n\r\ndata: 3\ndata: 4\n\n",
        "data: [DONE]",
    ]);
    let want: Vec<Result<String, String>> = vec![
        Ok("{\"a\":1}".into()),
        Ok("2".into()),
        Ok("3\n4".into()),
        Ok("[DONE]".into()),
    ];
    assert_eq!(got, want);
}

#[test]
fn vllm_chunks_carry_token_ids_usage_and_handshake() {
    let chunk: Value = serde_json::from_str(
        r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"Hi",
        "token_ids":[17, 4],"finish_reason":null}],"usage":null}"#,
    )
    .unwrap();
    let d = vllm_delta(&chunk, false).unwrap();
    assert_eq!(d.tokens, vec![17, 4]);
    assert_eq!(d.finish, None);
    let last: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":"","token_ids":[9],"finish_reason":"length"}]}"#,
    )
    .unwrap();
    assert_eq!(
        vllm_delta(&last, false).unwrap().finish,
        Some(EngineFinish::Length)
    );
    let usage: Value = serde_json::from_str(
        r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,
        "prompt_tokens_details":{"cached_tokens":32}},
        "kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}}"#,
    )
    .unwrap();
    let d = vllm_delta(&usage, false).unwrap();
    assert_eq!((d.prompt_tokens, d.cached_tokens), (Some(40), Some(32)));
    assert_eq!(
        d.kv_transfer_params.unwrap()["remote_block_ids"],
        json!([1, 2])
    );
}

#[test]
fn text_without_token_ids_is_refused_clearly() {
    let chunk: Value =
        serde_json::from_str(r#"{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#)
            .unwrap();
    let e = vllm_delta(&chunk, false).unwrap_err().to_string();
    assert!(e.contains("return_token_ids"), "{e}");
    // A plain OpenAI server (`openai`): its text passes on.
    let d = vllm_delta(&chunk, true).unwrap();
    assert_eq!((d.text.as_deref(), d.tokens.len()), (Some("Hi"), 0));
}

#[test]
fn sglang_cumulative_and_incremental_output_ids() {
    let a: Value = serde_json::from_str(
        r#"{"text":"a","output_ids":[5],"meta_info":{"prompt_tokens":8,"cached_tokens":0,
        "finish_reason":null}}"#,
    )
    .unwrap();
    let b: Value = serde_json::from_str(
        r#"{"text":"ab","output_ids":[5,6,7],"meta_info":{"prompt_tokens":8,
        "cached_tokens":0,"finish_reason":{"type":"length","length":3}}}"#,
    )
    .unwrap();
    let mut seen = 0;
    assert_eq!(sglang_delta(&a, false, &mut seen).unwrap().tokens, vec![5]);
    let d = sglang_delta(&b, false, &mut seen).unwrap();
    assert_eq!(d.tokens, vec![6, 7]);
    assert_eq!(d.finish, Some(EngineFinish::Length));
    let mut seen = 0;
    assert_eq!(
        sglang_delta(&b, true, &mut seen).unwrap().tokens,
        vec![5, 6, 7]
    );
    // Cumulative mode fed increments: the ids shrink, which is refused with a hint.
    let mut seen = 3;
    let e = sglang_delta(&a, false, &mut seen).unwrap_err().to_string();
    assert!(e.contains("incremental"), "{e}");
    let abort: Value = serde_json::from_str(
        r#"{"output_ids":[],"meta_info":{"finish_reason":{"type":"abort","message":"oom"}}}"#,
    )
    .unwrap();
    assert!(sglang_delta(&abort, true, &mut 0).is_err());
}

#[test]
fn request_bodies_follow_each_api() {
    let req = EngineGenerate {
        request_id: "tandem-7".into(),
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        temperature: 0.5,
        top_p: Some(0.9),
        top_k: Some(40),
        min_p: Some(0.05),
        seed: Some(11),
        stop_token: Some(2),
        ignore_eos: true,
        cache_salt: Some("tenant".into()),
        kv_transfer_params: Some(json!({"do_remote_decode": true})),
        bootstrap: None,
        lora_adapter: None,
    };
    let v = EngineApi::new(EngineKind::Vllm, "http://h:1/v1/", "m").unwrap();
    assert_eq!(v.base_url(), "http://h:1");
    let b = v.body(&req, true);
    assert_eq!(b["prompt"], json!([1, 2, 3]));
    assert_eq!(b["return_token_ids"], json!(true));
    assert_eq!(b["stop_token_ids"], json!([2]));
    assert_eq!(b["cache_salt"], json!("tenant"));
    assert_eq!(b["stream_options"]["include_usage"], json!(true));
    assert_eq!(b["kv_transfer_params"]["do_remote_decode"], json!(true));
    assert_eq!((&b["top_k"], &b["min_p"]), (&json!(40), &json!(0.05f32)));
    let s = EngineApi::new(EngineKind::Sglang, "http://h:2", "m").unwrap();
    let b = s.body(&req, false);
    assert_eq!(b["input_ids"], json!([1, 2, 3]));
    assert_eq!(b["sampling_params"]["max_new_tokens"], json!(4));
    assert_eq!(b["sampling_params"]["stop_token_ids"], json!([2]));
    assert_eq!(b["sampling_params"]["top_k"], json!(40));
    assert_eq!(b["sampling_params"]["min_p"], json!(0.05f32));
    assert!(b.get("prompt").is_none());
    assert!(b.get("lora_path").is_none());
    assert!(EngineApi::new(EngineKind::Vllm, "h:1", "m").is_err());
}

#[test]
fn a_lora_request_names_its_adapter() {
    let base = EngineGenerate {
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        ..EngineGenerate::default()
    };
    let lora = EngineGenerate {
        lora_adapter: Some("sql-lora".into()),
        ..base.clone()
    };
    for kind in [EngineKind::Vllm, EngineKind::Openai] {
        let api = EngineApi::new(kind, "http://h:1", "base-model").unwrap();
        assert_eq!(api.body(&base, true)["model"], json!("base-model"));
        let b = api.body(&lora, true);
        assert_eq!(b["model"], json!("sql-lora"), "{kind:?}");
        assert!(b.get("lora_path").is_none());
    }
    let s = EngineApi::new(EngineKind::Sglang, "http://h:2", "base-model").unwrap();
    assert_eq!(s.body(&lora, false)["lora_path"], json!("sql-lora"));
    assert!(s.body(&base, false).get("lora_path").is_none());
}
