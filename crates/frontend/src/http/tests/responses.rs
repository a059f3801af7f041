//! Successful responses: shapes, streams, headers, usage, stop strings, drops.

use serde::Deserialize;
use serde_json::{Value, json};

use super::*;

/// The OpenAI `chat.completion` object as the API reference defines it: the fields it
/// requires are required here (nullable ones as `Value`), and nothing else is allowed.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaChatCompletion {
    id: String,
    object: String,
    created: u64,
    model: String,
    choices: Vec<OaChatChoice>,
    usage: OaUsage,
    system_fingerprint: Option<String>,
    service_tier: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaChatChoice {
    index: u32,
    message: OaMessage,
    logprobs: Value,
    finish_reason: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaMessage {
    role: String,
    content: Value,
    refusal: Value,
    tool_calls: Option<Value>,
    annotations: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaUsage {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: Option<OaPromptDetails>,
    completion_tokens_details: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaPromptDetails {
    cached_tokens: u32,
    audio_tokens: Option<u32>,
}

/// The legacy `text_completion` object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaCompletion {
    id: String,
    object: String,
    created: u64,
    model: String,
    choices: Vec<OaCompletionChoice>,
    usage: OaUsage,
    system_fingerprint: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct OaCompletionChoice {
    text: String,
    index: u32,
    logprobs: Value,
    finish_reason: String,
}

fn chat_body(stream: bool, extra: Value) -> Value {
    let mut body = json!({
        "model": "tandem-test",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}
        ],
        "stream": stream,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

const REPLY: &str = "Hello there, wörld! 🦀";

#[tokio::test]
async fn non_streaming_chat_has_the_openai_shape() {
    let backend = FakeBackend::text(REPLY);
    let (app, _) = setup(backend.clone(), config());
    let resp = send(
        &app,
        post_json("/v1/chat/completions", &chat_body(false, json!({}))),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "content-type"), Some("application/json"));
    assert_eq!(header(&resp, "x-tandem-decode-worker"), Some("11"));
    assert_eq!(header(&resp, "x-tandem-prefill-worker"), Some("22"));
    assert_eq!(header(&resp, "x-tandem-cached-tokens"), Some("7"));
    let request_id = header(&resp, "x-request-id").unwrap().to_string();
    let text = body_text(resp).await;
    let c: OaChatCompletion = serde_json::from_str(&text).unwrap();
    assert_eq!(c.id, request_id);
    assert!(c.id.starts_with("chatcmpl-"));
    assert_eq!(c.object, "chat.completion");
    assert_eq!(c.model, "tandem-test");
    assert_eq!(c.choices.len(), 1);
    assert_eq!(c.choices[0].message.role, "assistant");
    assert_eq!(c.choices[0].message.content, json!(REPLY));
    assert_eq!(c.choices[0].finish_reason, "stop");
    let n_reply = cl100k().encode(REPLY).unwrap().len() as u32;
    let req = backend.last_request();
    // The built-in template renders exactly the pre-template ChatML.
    let prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay\nhi<|im_end|>\n\
                  <|im_start|>assistant\n";
    assert_eq!(req.prompt_tokens, cl100k().encode(prompt).unwrap());
    assert_eq!(c.usage.prompt_tokens, req.prompt_tokens.len() as u32);
    assert_eq!(c.usage.completion_tokens, n_reply);
    assert_eq!(c.usage.total_tokens, c.usage.prompt_tokens + n_reply);
    assert_eq!(c.usage.prompt_tokens_details.unwrap().cached_tokens, CACHED);
    assert!(backend.was_dropped());
}

#[tokio::test]
async fn non_streaming_completion_has_the_openai_shape_and_no_prefill_header_when_local() {
    let backend = FakeBackend::local(Script::Text {
        text: REPLY.into(),
        finish: FinishReason::Length,
        hang: false,
    });
    let (app, _) = setup(backend.clone(), config());
    let body = json!({"model": "tandem-test", "prompt": "Once upon a time", "max_tokens": 50});
    let resp = send(&app, post_json("/v1/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "x-tandem-prefill-worker"), None);
    assert_eq!(header(&resp, "x-tandem-decode-worker"), Some("11"));
    let c: OaCompletion = serde_json::from_str(&body_text(resp).await).unwrap();
    assert!(c.id.starts_with("cmpl-"));
    assert_eq!(c.object, "text_completion");
    assert_eq!(c.choices[0].text, REPLY);
    assert_eq!(c.choices[0].finish_reason, "length");
    let req = backend.last_request();
    assert_eq!(
        req.prompt_tokens,
        cl100k().encode("Once upon a time").unwrap()
    );
    assert_eq!(req.max_tokens, 50);
}

#[tokio::test]
async fn streaming_chat_sends_role_content_finish_usage_and_done() {
    let backend = FakeBackend::text(REPLY);
    let (app, _) = setup(backend.clone(), config());
    let body = chat_body(true, json!({"stream_options": {"include_usage": true}}));
    let resp = send(&app, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "content-type"), Some("text/event-stream"));
    assert_eq!(header(&resp, "x-tandem-cached-tokens"), Some("7"));
    let id = header(&resp, "x-request-id").unwrap().to_string();
    let events = sse_data(&body_text(resp).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id.as_str());
        assert_eq!(c["model"], "tandem-test");
        assert!(
            c.get("usage").is_some(),
            "usage present (null) with include_usage: {c}"
        );
    }
    // The role chunk.
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(chunks[0]["usage"].is_null());
    // Content chunks, finish_reason on the last one only.
    let content = &chunks[1..chunks.len() - 1];
    let text: String = content
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(text, REPLY);
    for c in &content[..content.len() - 1] {
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["choices"][0]["delta"].get("role").is_none());
    }
    assert_eq!(
        content.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    // The usage chunk.
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    let n_reply = cl100k().encode(REPLY).unwrap().len() as u64;
    let prompt = backend.last_request().prompt_tokens.len() as u64;
    assert_eq!(
        usage_chunk["usage"],
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": n_reply,
            "total_tokens": prompt + n_reply,
            "prompt_tokens_details": {"cached_tokens": CACHED}
        })
    );
    assert!(backend.last_request().include_usage);
}

#[tokio::test]
async fn streaming_completion_without_usage() {
    let backend = FakeBackend::text(REPLY);
    let (app, _) = setup(backend.clone(), config());
    let body = json!({"prompt": "Hi", "stream": true});
    let resp = send(&app, post_json("/v1/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let events = sse_data(&body_text(resp).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, REPLY);
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_none(), "{c}");
    }
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    // No model given: the served one.
    assert_eq!(backend.last_request().model, "tandem-test");
    assert!(!backend.last_request().include_usage);
}

/// Chat logprobs, whole and streamed: one entry per token in OpenAI's shape, whose tokens
/// spell the text and whose bytes are the token's own.
#[tokio::test]
async fn chat_logprobs_have_the_openai_shape_whole_and_streamed() {
    let backend = FakeBackend::text(REPLY);
    let (app, _) = setup(backend.clone(), config());
    let n_reply = cl100k().encode(REPLY).unwrap().len();
    let extra = json!({"logprobs": true, "top_logprobs": 2});
    let resp = send(
        &app,
        post_json("/v1/chat/completions", &chat_body(false, extra.clone())),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(backend.last_request().logprobs, Some(2));
    let c: OaChatCompletion = serde_json::from_str(&body_text(resp).await).unwrap();
    let content = c.choices[0].logprobs["content"].as_array().unwrap().clone();
    assert_eq!(content.len(), n_reply);
    let mut bytes = Vec::new();
    for e in &content {
        // Each token comes alone in its chunk: logprob 0; its top-2 are it and the next id.
        assert_eq!(e["logprob"], json!(0.0));
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], e["token"]);
        assert_eq!(top[1]["logprob"], json!(-1.0));
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        REPLY,
        "the bytes spell the reply"
    );

    let resp = send(
        &app,
        post_json("/v1/chat/completions", &chat_body(true, extra)),
    )
    .await;
    let events = sse_data(&body_text(resp).await);
    let streamed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed, content, "the stream carries the same entries");

    // Not asked: null, as before.
    let resp = send(
        &app,
        post_json("/v1/chat/completions", &chat_body(false, json!({}))),
    )
    .await;
    let c: OaChatCompletion = serde_json::from_str(&body_text(resp).await).unwrap();
    assert_eq!(c.choices[0].logprobs, Value::Null);
    assert_eq!(backend.last_request().logprobs, None);
}

/// Completions logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}) and
/// text_offset, which counts characters from the start of the completion across chunks.
#[tokio::test]
async fn completion_logprobs_have_offsets_that_index_the_text() {
    let backend = FakeBackend::text(REPLY);
    let (app, _) = setup(backend.clone(), config());
    for stream in [false, true] {
        let body = json!({"prompt": "Hi", "logprobs": 1, "stream": stream});
        let resp = send(&app, post_json("/v1/completions", &body)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let text = body_text(resp).await;
        let choices: Vec<Value> = if stream {
            let events = sse_data(&text);
            events[..events.len() - 1]
                .iter()
                .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0].clone())
                .collect()
        } else {
            vec![serde_json::from_str::<Value>(&text).unwrap()["choices"][0].clone()]
        };
        let (mut tokens, mut offsets) = (Vec::new(), Vec::new());
        for c in &choices {
            let Some(l) = c["logprobs"].as_object() else {
                continue;
            };
            let n = l["tokens"].as_array().unwrap().len();
            assert_eq!(l["token_logprobs"].as_array().unwrap().len(), n);
            assert_eq!(l["top_logprobs"].as_array().unwrap().len(), n);
            for (t, top) in l["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .zip(l["top_logprobs"].as_array().unwrap())
            {
                assert_eq!(top.as_object().unwrap().len(), 1, "{top}");
                assert!(
                    top.get(t.as_str().unwrap()).is_some(),
                    "the chosen token is in its top"
                );
            }
            tokens.extend(
                l["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_str().unwrap().to_string()),
            );
            offsets.extend(
                l["text_offset"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|o| o.as_u64().unwrap() as usize),
            );
        }
        assert_eq!(
            tokens.len(),
            cl100k().encode(REPLY).unwrap().len(),
            "stream {stream}"
        );
        let mut at = 0;
        for (t, o) in tokens.iter().zip(&offsets) {
            assert_eq!(*o, at, "stream {stream}");
            at += t.chars().count();
        }
    }
}

#[tokio::test]
async fn request_fields_reach_the_backend_validated() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), config());
    let body = chat_body(
        false,
        json!({"max_tokens": 3, "max_completion_tokens": 9, "temperature": 0.0, "seed": -1,
               "stop": ["", "END"], "ignore_eos": true, "cache_salt": "tenant-a", "n": 1,
               "top_p": 0.5, "top_k": 40, "min_p": 0.05, "user": "u1",
               "stream_options": {"include_usage": true}}),
    );
    let resp = send(&app, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let r = backend.last_request();
    assert_eq!(r.max_tokens, 9, "max_completion_tokens wins");
    assert_eq!(r.temperature, 0.0);
    assert_eq!(r.seed, Some(u64::MAX));
    assert_eq!((r.top_k, r.min_p), (40, 0.05));
    assert_eq!(r.stop, vec!["END".to_string()]);
    assert!(r.ignore_eos);
    assert_eq!(r.cache_salt.as_deref(), Some("tenant-a"));
    assert!(
        !r.stream && !r.include_usage,
        "include_usage only when streaming"
    );
    assert!(r.created > 1_600_000_000);
    assert!(r.response_id.starts_with("chatcmpl-"));

    // Defaults: max_tokens 256 (fits), temperature 1.
    send(
        &app,
        post_json("/v1/chat/completions", &chat_body(false, json!({}))),
    )
    .await;
    let r2 = backend.last_request();
    assert_eq!(r2.max_tokens, 256);
    assert_eq!(r2.temperature, 1.0);
    assert_ne!(r2.id, r.id);
}

#[tokio::test]
async fn default_max_tokens_is_lowered_to_fit_the_context() {
    let backend = FakeBackend::text("ok");
    let cfg = HttpConfig {
        context_length: 20,
        ..config()
    };
    let (app, _) = setup(backend.clone(), cfg);
    let body = json!({"prompt": [1, 2, 3, 4, 5]});
    let resp = send(&app, post_json("/v1/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(backend.last_request().max_tokens, 15);
    assert_eq!(backend.last_request().prompt_tokens, vec![1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn stop_string_cuts_the_text_and_drops_the_backend_stream() {
    for stream in [false, true] {
        // The stream would stay open after the text: only the stop string ends it.
        let backend = FakeBackend::new(Script::Text {
            text: "alpha beta STOP gamma delta".into(),
            finish: FinishReason::Stop,
            hang: true,
        });
        let (app, _) = setup(backend.clone(), config());
        let body = json!({"prompt": "x", "stop": "STOP", "stream": stream});
        let resp = send(&app, post_json("/v1/completions", &body)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let text = body_text(resp).await;
        let (out, finish) = if stream {
            let events = sse_data(&text);
            assert_eq!(events.last().unwrap(), "[DONE]");
            let chunks: Vec<Value> = events[..events.len() - 1]
                .iter()
                .map(|e| serde_json::from_str(e).unwrap())
                .collect();
            let out: String = chunks
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap())
                .collect();
            (
                out,
                chunks.last().unwrap()["choices"][0]["finish_reason"].clone(),
            )
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(out, "alpha beta ");
        assert_eq!(finish, "stop");
        assert!(backend.was_dropped(), "stream={stream}");
    }
}

#[tokio::test]
async fn max_tokens_is_enforced_even_if_the_backend_sends_more() {
    let backend = FakeBackend::new(Script::Text {
        text: "one two three four five six".into(),
        finish: FinishReason::Stop,
        hang: true,
    });
    let (app, _) = setup(backend.clone(), config());
    let body = json!({"prompt": "x", "max_tokens": 2});
    let v = body_json(send(&app, post_json("/v1/completions", &body)).await).await;
    assert_eq!(v["choices"][0]["text"], "one two");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert!(backend.was_dropped());
}

#[tokio::test]
async fn dropping_a_streaming_response_drops_the_backend_stream() {
    let backend = FakeBackend::new(Script::Text {
        text: "a b c".into(),
        finish: FinishReason::Stop,
        hang: true,
    });
    let (app, _) = setup(backend.clone(), config());
    let resp = send(
        &app,
        post_json("/v1/chat/completions", &chat_body(true, json!({}))),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    // Role chunk, then the three content chunks.
    for _ in 0..4 {
        let frame = body.frame().await.unwrap().unwrap();
        assert!(frame.is_data());
    }
    assert!(!backend.was_dropped());
    drop(body);
    assert!(backend.was_dropped());
}
