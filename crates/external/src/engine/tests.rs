//! Tests of the engine client: SSE framing, each API's deltas and request bodies.

use super::*;

/// The delta of a vLLM / OpenAI answer written as JSON (read as the client reads it).
fn vllm_delta(v: &Value, text_ok: bool, top: Option<u32>) -> Result<EngineDelta, EngineError> {
    let answer = parse_answer(&serde_json::to_vec(v).unwrap()).unwrap();
    super::vllm_delta(answer, text_ok, top)
}

#[test]
fn echoed_prompt_ids_are_cut_out_before_parsing_and_nothing_else() {
    let text = |raw: &str| {
        let a = parse_answer(raw.as_bytes()).unwrap();
        super::vllm_delta(a, false, None).unwrap()
    };
    // vLLM's shape: each choice echoes the prompt's ids beside the sampled ones.
    let two = r#"{"choices":[{"index":0,"prompt_token_ids":[1,2,3],"text":"a","token_ids":[7]},
        {"index":1,"prompt_token_ids":[ 4 , 5 ],"text":"b","token_ids":[8]}],
        "usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
    assert_eq!(
        without_prompt_ids(two).unwrap(),
        two.replace("[1,2,3]", "null").replace("[ 4 , 5 ]", "null")
    );
    let d = text(two);
    assert_eq!((d.tokens, d.prompt_tokens), (vec![7, 8], Some(3)));
    // A string that spells the key keeps it (its quotes are escaped), and a list of another
    // shape is parsed as sent.
    let quoted = r#"{"choices":[{"text":"\"prompt_token_ids\":[1]","token_ids":[7]}]}"#;
    assert!(without_prompt_ids(quoted).is_none());
    let nested = r#"{"choices":[{"prompt_token_ids":[[1],[2]],"text":"a","token_ids":[7]}]}"#;
    assert!(serde_json::from_str::<Value>(&without_prompt_ids(nested).unwrap()).is_err());
    assert_eq!(text(nested).tokens, vec![7]);
    assert_eq!(
        text(r#"{"choices":[{"prompt_token_ids": [1],"token_ids":[9]}]}"#).tokens,
        vec![9]
    );
    assert!(parse_answer(br#"{"choices":[{"prompt_token_ids":[1,"#).is_err());
    // Not UTF-8 (a lone continuation byte in the text): refused, as serde_json refuses it.
    assert!(parse_answer(b"{\"choices\":[{\"text\":\"a\x80\",\"token_ids\":[7]}]}").is_err());
}

fn events_of(chunks: &[&'static str]) -> Vec<Result<String, String>> {
    let body = futures::stream::iter(
        chunks
            .iter()
            .map(|c| Ok::<_, EngineError>(Bytes::from_static(c.as_bytes())))
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
    let d = vllm_delta(&chunk, false, None).unwrap();
    assert_eq!(d.tokens, vec![17, 4]);
    assert_eq!(d.finish, None);
    let last: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":"","token_ids":[9],"finish_reason":"length"}]}"#,
    )
    .unwrap();
    assert_eq!(
        vllm_delta(&last, false, None).unwrap().finish,
        Some(EngineFinish::Length)
    );
    let usage: Value = serde_json::from_str(
        r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,
        "prompt_tokens_details":{"cached_tokens":32}},
        "kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]}}"#,
    )
    .unwrap();
    let d = vllm_delta(&usage, false, None).unwrap();
    assert_eq!((d.prompt_tokens, d.cached_tokens), (Some(40), Some(32)));
    assert_eq!(
        d.kv_transfer_params.unwrap()["remote_block_ids"],
        json!([1, 2])
    );
    // llama.cpp's server: the cache in `timings`, usage without details (or none at all).
    let llama: Value = serde_json::from_str(
        r#"{"choices":[{"text":"","finish_reason":"stop","index":0}],
        "usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43},
        "timings":{"cache_n":32,"prompt_n":8,"prompt_ms":1.5,"predicted_n":3}}"#,
    )
    .unwrap();
    let d = vllm_delta(&llama, true, None).unwrap();
    assert_eq!(
        (d.prompt_tokens, d.cached_tokens, d.completion_tokens),
        (Some(40), Some(32), Some(3))
    );
    let bare: Value = serde_json::from_str(
        r#"{"choices":[],"timings":{"cache_n":30,"prompt_n":10,"predicted_n":4}}"#,
    )
    .unwrap();
    let d = vllm_delta(&bare, true, None).unwrap();
    assert_eq!(
        (d.prompt_tokens, d.cached_tokens, d.completion_tokens),
        (Some(40), Some(30), Some(4))
    );
    // The usage's own figures win over the timings'.
    let both: Value = serde_json::from_str(
        r#"{"choices":[],"usage":{"prompt_tokens":50,"prompt_tokens_details":{"cached_tokens":48}},
        "timings":{"cache_n":1,"prompt_n":1}}"#,
    )
    .unwrap();
    let d = vllm_delta(&both, true, None).unwrap();
    assert_eq!((d.prompt_tokens, d.cached_tokens), (Some(50), Some(48)));
}

#[test]
fn text_without_token_ids_is_refused_clearly() {
    let chunk: Value =
        serde_json::from_str(r#"{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#)
            .unwrap();
    let e = vllm_delta(&chunk, false, None).unwrap_err().to_string();
    assert!(e.contains("return_token_ids"), "{e}");
    // A plain OpenAI server (`openai`): its text passes on.
    let d = vllm_delta(&chunk, true, None).unwrap();
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
    assert_eq!(
        sglang_delta(&a, false, &mut seen, None).unwrap().tokens,
        vec![5]
    );
    let d = sglang_delta(&b, false, &mut seen, None).unwrap();
    assert_eq!(d.tokens, vec![6, 7]);
    assert_eq!(d.finish, Some(EngineFinish::Length));
    let mut seen = 0;
    assert_eq!(
        sglang_delta(&b, true, &mut seen, None).unwrap().tokens,
        vec![5, 6, 7]
    );
    // Cumulative mode fed increments: the ids shrink, which is refused with a hint.
    let mut seen = 3;
    let e = sglang_delta(&a, false, &mut seen, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("incremental"), "{e}");
    let abort: Value = serde_json::from_str(
        r#"{"output_ids":[],"meta_info":{"finish_reason":{"type":"abort","message":"oom"}}}"#,
    )
    .unwrap();
    assert!(sglang_delta(&abort, true, &mut 0, None).is_err());
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
        logprobs: Some(2),
        text: None,
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
    // As sent: the f32 written in its shortest form.
    assert_eq!((&b["top_k"], &b["min_p"]), (&json!(40), &json!(0.05)));
    assert_eq!(b["logprobs"], json!(2));
    assert_eq!(b["return_tokens_as_token_ids"], json!(true));
    let s = EngineApi::new(EngineKind::Sglang, "http://h:2", "m").unwrap();
    let b = s.body(&req, false);
    assert_eq!(b["input_ids"], json!([1, 2, 3]));
    assert_eq!(b["sampling_params"]["max_new_tokens"], json!(4));
    assert_eq!(b["sampling_params"]["stop_token_ids"], json!([2]));
    assert_eq!(b["sampling_params"]["top_k"], json!(40));
    assert_eq!(b["sampling_params"]["min_p"], json!(0.05f32));
    assert_eq!(b["return_logprob"], json!(true));
    assert_eq!(b["top_logprobs_num"], json!(2));
    assert_eq!(b["logprob_start_len"], json!(-1));
    assert!(b.get("prompt").is_none());
    assert!(b.get("lora_path").is_none());
    assert!(EngineApi::new(EngineKind::Vllm, "h:1", "m").is_err());
}

/// The prompt's ids are written by a loop of their own ahead of the other fields: the body
/// is one JSON object, the ids exactly the prompt's, for any prompt.
#[test]
fn a_bodys_prompt_ids_are_written_exactly() {
    let v = EngineApi::new(EngineKind::Vllm, "http://h:1", "m").unwrap();
    let every_length: Vec<u32> = (0..1_100)
        .chain((1..10).flat_map(|k| [10u32.pow(k) - 1, 10u32.pow(k)]))
        .chain([123_456_789, u32::MAX])
        .collect();
    for prompt in [vec![], vec![0], vec![7, 0, 10, u32::MAX], every_length] {
        let req = EngineGenerate {
            prompt: prompt.clone(),
            max_tokens: 1,
            ..Default::default()
        };
        let bytes = body::CompletionBody::new("m", &req, false)
            .to_vec()
            .unwrap();
        let b: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(b["prompt"], json!(prompt));
        assert_eq!((&b["model"], &b["max_tokens"]), (&json!("m"), &json!(1)));
        assert_eq!(b, v.body(&req, false));
    }
}

/// A server that takes text: a completion's prompt and a chat's messages go as text, in
/// OpenAI's own fields only, a chat to its own endpoint; its answers' text is read back from
/// either shape.
#[test]
fn text_prompts_go_in_openais_own_fields() {
    use tandem_protocol::grpc::{ChatText, PromptText, prompt_text::Kind};
    let api = EngineApi::new(EngineKind::Openai, "http://h:1", "m").unwrap();
    let completion = TextPrompt::from_proto(&PromptText {
        kind: Some(Kind::Completion("Say hi".into())),
    })
    .unwrap();
    let req = EngineGenerate {
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        seed: Some(3),
        stop_token: Some(2),
        cache_salt: Some("tenant".into()),
        text: completion,
        ..EngineGenerate::default()
    };
    let b = api.body(&req, true);
    assert_eq!(b["prompt"], json!("Say hi"));
    assert_eq!(b["seed"], json!(3));
    assert_eq!(b["stream_options"]["include_usage"], json!(true));
    for extension in [
        "return_token_ids",
        "stop_token_ids",
        "cache_salt",
        "ignore_eos",
    ] {
        assert!(b.get(extension).is_none(), "{extension} in {b}");
    }
    assert_eq!(
        api.generate_url(&req).to_string(),
        "http://h:1/v1/completions"
    );

    let chat = PromptText {
        kind: Some(Kind::Chat(ChatText {
            messages_json: r#"[{"role":"user","content":"Hi"}]"#.into(),
            tools_json: String::new(),
        })),
    };
    let req = EngineGenerate {
        text: TextPrompt::from_proto(&chat).unwrap(),
        ..req
    };
    let b = api.body(&req, false);
    assert_eq!(b["messages"], json!([{"role": "user", "content": "Hi"}]));
    assert!(b.get("prompt").is_none() && b.get("tools").is_none(), "{b}");
    assert_eq!(
        api.generate_url(&req).to_string(),
        "http://h:1/v1/chat/completions"
    );

    // Conversations that are not JSON lists are refused with why.
    for (messages, tools, why) in [
        ("{", "", "messages are not JSON"),
        ("{}", "", "messages are not a JSON list"),
        ("[]", "{}", "tools are not a JSON list"),
    ] {
        let bad = PromptText {
            kind: Some(Kind::Chat(ChatText {
                messages_json: messages.into(),
                tools_json: tools.into(),
            })),
        };
        let e = TextPrompt::from_proto(&bad).unwrap_err();
        assert!(e.contains(why), "{e}");
    }

    // A chat's answers: streamed deltas and a whole message.
    let delta: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"delta":{"content":" t5"},"finish_reason":null}]}"#,
    )
    .unwrap();
    assert_eq!(
        vllm_delta(&delta, true, None).unwrap().text.as_deref(),
        Some(" t5")
    );
    let whole: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"message":{"role":"assistant","content":" t5 t6"},
            "finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#,
    )
    .unwrap();
    let d = vllm_delta(&whole, true, None).unwrap();
    assert_eq!(d.text.as_deref(), Some(" t5 t6"));
    assert_eq!(
        (d.prompt_tokens, d.finish),
        (Some(9), Some(EngineFinish::Length))
    );
    // A role-only first delta carries nothing.
    let role: Value =
        serde_json::from_str(r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#).unwrap();
    assert_eq!(
        vllm_delta(&role, true, None).unwrap(),
        EngineDelta::default()
    );
}

/// vLLM and SGLang get the request id as is; a plain server a UUID made from it (llama.cpp's
/// Python server refuses any other form with 400).
#[test]
fn a_plain_server_gets_its_request_id_as_a_uuid() {
    let vllm = EngineApi::new(EngineKind::Vllm, "http://h:1", "m").unwrap();
    let header = |api: &EngineApi, id: &str| {
        let v = api.request_id_header(id).unwrap();
        v.to_str().unwrap().to_owned()
    };
    assert_eq!(header(&vllm, "tandem-7"), "tandem-7");
    let plain = EngineApi::new(EngineKind::Openai, "http://h:1", "m").unwrap();
    let id = header(&plain, "tandem-7");
    let groups: Vec<usize> = id.split('-').map(str::len).collect();
    assert_eq!(groups, [8, 4, 4, 4, 12], "{id}");
    assert!(
        id.chars().all(|c| c == '-' || c.is_ascii_hexdigit()),
        "{id}"
    );
    assert_eq!(&id[14..15], "4", "version 4: {id}");
    assert!("89ab".contains(&id[19..20]), "RFC 4122 variant: {id}");
    assert_eq!(id, header(&plain, "tandem-7"));
    assert_ne!(id, header(&plain, "tandem-8"));
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

/// vLLM's completions logprobs with `return_tokens_as_token_ids`, as its
/// `_create_completion_logprobs` writes them: per token, the sampled token's value and a map
/// holding it and the `N` most likely (here N = 2, the sampled token third).
#[test]
fn vllm_logprobs_come_back_as_ids_ranked() {
    let chunk: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":"ab","token_ids":[17,4],"finish_reason":null,
        "logprobs":{"text_offset":[0,1],"token_logprobs":[-0.25,-9999.0],
        "tokens":["token_id:17","token_id:4"],
        "top_logprobs":[{"token_id:17":-0.25,"token_id:3":-1.5},
                        {"token_id:4":-9999.0,"token_id:8":-0.5,"token_id:2":-0.5}]}}]}"#,
    )
    .unwrap();
    let d = vllm_delta(&chunk, false, Some(2)).unwrap();
    assert_eq!(d.tokens, vec![17, 4]);
    let l = &d.logprobs;
    assert_eq!(l.len(), 2);
    assert_eq!((l[0].logprob, &l[0].top_tokens[..]), (-0.25, &[17, 3][..]));
    assert_eq!(l[0].top_logprobs, vec![-0.25, -1.5]);
    // Ranked by value, ties by id; the sampled token outside the top two is cut.
    assert_eq!((l[1].logprob, &l[1].top_tokens[..]), (-9999.0, &[2, 8][..]));
    // Not asked: not read.
    assert!(vllm_delta(&chunk, false, None).unwrap().logprobs.is_empty());
    // Asked and missing, misaligned, or named by text: out of protocol.
    let bare: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":"a","token_ids":[17],"logprobs":null}]}"#,
    )
    .unwrap();
    assert!(vllm_delta(&bare, false, Some(0)).is_err());
    let short: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":"ab","token_ids":[17,4],
        "logprobs":{"token_logprobs":[-0.25],"top_logprobs":[null]}}]}"#,
    )
    .unwrap();
    assert!(vllm_delta(&short, false, Some(0)).is_err());
    let text: Value = serde_json::from_str(
        r#"{"choices":[{"index":0,"text":"a","token_ids":[17],
        "logprobs":{"token_logprobs":[-0.25],"top_logprobs":[{"a":-0.25}]}}]}"#,
    )
    .unwrap();
    let e = vllm_delta(&text, false, Some(1)).unwrap_err().to_string();
    assert!(e.contains("return_tokens_as_token_ids"), "{e}");
    // The usage chunk has no choices and needs none.
    let usage: Value =
        serde_json::from_str(r#"{"choices":[],"usage":{"prompt_tokens":4}}"#).unwrap();
    assert!(
        vllm_delta(&usage, false, Some(2))
            .unwrap()
            .logprobs
            .is_empty()
    );
}

/// SGLang's `meta_info` logprobs: `[logprob, id, text]` triples, cumulative like
/// `output_ids` unless the server streams increments; a null value is minus infinity.
#[test]
fn sglang_logprobs_follow_the_output_ids() {
    let a: Value = serde_json::from_str(
        r#"{"output_ids":[5],"meta_info":{"output_token_logprobs":[[-0.5,5,null]],
        "output_top_logprobs":[[[-0.5,5,null],[-1.0,9,null]]]}}"#,
    )
    .unwrap();
    let b: Value = serde_json::from_str(
        r#"{"output_ids":[5,6],"meta_info":{"output_token_logprobs":[[-0.5,5,null],[null,6,null]],
        "output_top_logprobs":[[[-0.5,5,null],[-1.0,9,null]],[[-0.1,7,null],[-3.0,1,null]]]}}"#,
    )
    .unwrap();
    let mut seen = 0;
    let d = sglang_delta(&a, false, &mut seen, Some(1)).unwrap();
    assert_eq!(d.logprobs[0].logprob, -0.5);
    assert_eq!(d.logprobs[0].top_tokens, vec![5]);
    let d = sglang_delta(&b, false, &mut seen, Some(2)).unwrap();
    assert_eq!(d.tokens, vec![6]);
    assert_eq!(d.logprobs.len(), 1);
    assert_eq!(d.logprobs[0].logprob, -9999.0);
    assert_eq!(d.logprobs[0].top_tokens, vec![7, 1]);
    assert_eq!(d.logprobs[0].top_logprobs, vec![-0.1, -3.0]);
    // Incremental: the lists hold this object's tokens only.
    let inc: Value = serde_json::from_str(
        r#"{"output_ids":[6],"meta_info":{"output_token_logprobs":[[-2.0,6,null]]}}"#,
    )
    .unwrap();
    let d = sglang_delta(&inc, true, &mut 0, Some(0)).unwrap();
    assert_eq!(
        (d.logprobs[0].logprob, d.logprobs[0].top_tokens.len()),
        (-2.0, 0)
    );
    // A list shorter than the ids, or naming another token, is out of protocol.
    let short: Value = serde_json::from_str(
        r#"{"output_ids":[5,6],"meta_info":{"output_token_logprobs":[[-0.5,5,null]]}}"#,
    )
    .unwrap();
    assert!(sglang_delta(&short, false, &mut 0, Some(0)).is_err());
    let other: Value = serde_json::from_str(
        r#"{"output_ids":[5],"meta_info":{"output_token_logprobs":[[-0.5,4,null]]}}"#,
    )
    .unwrap();
    assert!(sglang_delta(&other, false, &mut 0, Some(0)).is_err());
}

/// How the test engine answers each request it reads.
#[derive(Clone, Copy)]
enum Answers {
    /// `{}`, keeping the connection open.
    KeepAlive,
    /// `{}`, then closes the connection without saying so (an engine's idle timeout).
    Close,
    /// A chunked body's first chunk, then nothing more.
    Stall,
}

/// An engine on a free port, and a poster of its completions URL.
struct TestEngine {
    poster: client::Poster,
    target: client::Target,
    /// Connections it accepted.
    connections: Arc<std::sync::atomic::AtomicUsize>,
    /// Signalled each time a stalled answer sees the client close.
    closed: Arc<tokio::sync::Notify>,
}

/// An engine on a free port that answers as `answers` says.
async fn test_engine(answers: Answers) -> TestEngine {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(tokio::sync::Notify::new());
    let (counted, seen_closed) = (connections.clone(), closed.clone());
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            counted.fetch_add(1, Ordering::SeqCst);
            let seen_closed = seen_closed.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = conn.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).into_owned();
                    let Some((head, body)) = text.split_once("\r\n\r\n") else {
                        continue;
                    };
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(str::to_string)
                        })
                        .map_or(0, |v| v.trim().parse().unwrap());
                    if body.len() < len {
                        continue;
                    }
                    got.drain(..head.len() + 4 + len);
                    let answer = match answers {
                        Answers::Stall => {
                            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n"
                        }
                        _ => {
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                        }
                    };
                    if conn.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    match answers {
                        Answers::KeepAlive => {}
                        Answers::Close => return,
                        Answers::Stall => {
                            // Nothing more is sent: the client's close ends the wait.
                            while matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {}
                            seen_closed.notify_one();
                            return;
                        }
                    }
                }
            });
        }
    });
    let base = format!("http://{addr}");
    let poster = client::Poster::for_base(&base, &reqwest::Client::new());
    let target = poster.target(&format!("{base}/v1/completions")).unwrap();
    TestEngine {
        poster,
        target,
        connections,
        closed,
    }
}

/// Posts `{}` and reads the answer whole, which must be `{}`.
async fn post_whole(poster: &client::Poster, target: &client::Target) {
    let answer = poster
        .post(target, Default::default(), b"{}".to_vec())
        .await
        .unwrap();
    assert!(answer.is_success());
    assert_eq!(&answer.bytes().await.unwrap()[..], b"{}");
}

/// Each serving thread posts through its own pool: posts from one thread reuse one
/// connection, and a thread never takes another's (whose task runs on that other thread).
#[tokio::test]
async fn each_serving_thread_posts_through_its_own_pool() {
    use std::sync::atomic::Ordering;
    let TestEngine {
        poster,
        target,
        connections,
        ..
    } = test_engine(Answers::KeepAlive).await;
    let post_twice = |poster: client::Poster, target: client::Target| async move {
        for _ in 0..2 {
            post_whole(&poster, &target).await;
        }
    };
    post_twice(poster.clone(), target.clone()).await;
    assert_eq!(connections.load(Ordering::SeqCst), 1);
    let threads = tandem_runtime::serving::ServingThreads::start(2, "test-pools").unwrap();
    for expected in [2, 3, 3, 3] {
        let (p, t) = (poster.clone(), target.clone());
        threads.spawn(move || post_twice(p, t)).await.unwrap();
        assert_eq!(connections.load(Ordering::SeqCst), expected);
    }
}

/// An engine that closes a kept connection (its idle timeout) costs the next request
/// nothing: it goes out on a new connection.
#[tokio::test]
async fn a_connection_the_engine_closed_is_not_posted_on() {
    use std::sync::atomic::Ordering;
    let TestEngine {
        poster,
        target,
        connections,
        ..
    } = test_engine(Answers::Close).await;
    for expected in 1..=3 {
        post_whole(&poster, &target).await;
        assert_eq!(connections.load(Ordering::SeqCst), expected);
    }
}

/// An answer dropped before its end takes its connection with it (that is how the engine
/// learns the client left): the next request opens another.
#[tokio::test]
async fn an_answer_dropped_unfinished_is_not_pooled() {
    use std::sync::atomic::Ordering;
    let TestEngine {
        poster,
        target,
        connections,
        closed,
    } = test_engine(Answers::Stall).await;
    for expected in 1..=2 {
        let answer = poster
            .post(&target, Default::default(), b"{}".to_vec())
            .await
            .unwrap();
        let mut body = answer.stream();
        assert_eq!(&body.next().await.unwrap().unwrap()[..], b"{}");
        drop(body);
        let left = tokio::time::timeout(std::time::Duration::from_secs(10), closed.notified());
        assert!(left.await.is_ok(), "the engine never saw the client leave");
        assert_eq!(connections.load(Ordering::SeqCst), expected);
    }
}

/// A URL outside the engine a plain poster was made for is refused, not posted to.
#[test]
fn a_plain_poster_takes_only_its_engines_urls() {
    let poster = client::Poster::for_base("http://127.0.0.1:8000", &reqwest::Client::new());
    assert!(
        poster
            .target("http://127.0.0.1:8000/v1/completions")
            .is_ok()
    );
    for other in [
        "http://127.0.0.1:8001/v1/completions",
        "https://127.0.0.1:8000/v1",
    ] {
        let e = poster.target(other).unwrap_err().to_string();
        assert!(e.contains("not under http://127.0.0.1:8000"), "{e}");
    }
}

/// An answer's token ids are `u32`s or the answer is refused; a count that is not one is as
/// absent.
#[test]
fn token_ids_are_u32s_and_counts_that_are_not_are_absent() {
    let bad = json!({"choices": [{"token_ids": [1, -2], "finish_reason": "length"}]});
    assert!(parse_answer(&serde_json::to_vec(&bad).unwrap()).is_err());
    let odd = json!({
        "choices": [{"token_ids": [7], "finish_reason": "length"}],
        "usage": {"prompt_tokens": "12", "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": null}},
    });
    let d = vllm_delta(&odd, false, None).unwrap();
    assert_eq!(d.tokens, vec![7]);
    assert_eq!(
        (d.prompt_tokens, d.completion_tokens, d.cached_tokens),
        (None, Some(1), None)
    );
}

#[test]
fn token_ids_may_be_null_absent_or_many() {
    let ids = |raw: &str| parse_answer(raw.as_bytes()).map(|a| vllm_delta_of(a).tokens);
    fn vllm_delta_of(a: answer::VllmAnswer) -> EngineDelta {
        super::vllm_delta(a, true, None).unwrap()
    }
    assert_eq!(
        ids(r#"{"choices":[{"token_ids":null}]}"#).unwrap(),
        Vec::<u32>::new()
    );
    assert_eq!(
        ids(r#"{"choices":[{"text":"a"}]}"#).unwrap(),
        Vec::<u32>::new()
    );
    let many: Vec<u32> = (0..5000).collect();
    let raw = serde_json::json!({"choices": [{"token_ids": many}, {"token_ids": [9]}]});
    assert_eq!(ids(&raw.to_string()).unwrap(), [&many[..], &[9]].concat());
    for bad in [
        r#"{"choices":[{"token_ids":[-1]}]}"#,
        r#"{"choices":[{"token_ids":"1"}]}"#,
        r#"{"choices":[{"token_ids":[4294967296]}]}"#,
    ] {
        assert!(ids(bad).is_err(), "{bad}");
    }
}
