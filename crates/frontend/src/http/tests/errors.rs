//! Every bad input gets its 4xx and OpenAI error JSON; backend failures get mapped statuses.

use std::time::Duration;

use serde_json::json;

use super::*;

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tandem-test", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

async fn chat_error(
    app: &Router,
    body: Value,
    status: StatusCode,
    code: Option<&str>,
    param: Option<&str>,
) {
    let resp = send(app, post_json("/v1/chat/completions", &body)).await;
    assert_error(resp, status, code, param).await;
}

#[tokio::test]
async fn malformed_inputs_get_4xx_json() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), config());
    let bad = StatusCode::BAD_REQUEST;

    // Not JSON / truncated JSON: 400.
    for raw in ["{not json", "{\"messages\": [", ""] {
        let resp = send(&app, post("/v1/chat/completions", raw)).await;
        assert_error(resp, bad, Some("invalid_json"), None).await;
    }
    // Well-formed JSON of the wrong shape or types: 422.
    let unprocessable = StatusCode::UNPROCESSABLE_ENTITY;
    for body in [
        json!([1, 2]),
        chat(json!({"max_tokens": "ten"})),
        chat(json!({"temperature": "hot"})),
        chat(json!({"stream": "yes"})),
        json!({"messages": "hello"}),
        json!({"messages": [{"content": "no role"}]}),
        chat(json!({"stop": 5})),
    ] {
        chat_error(&app, body, unprocessable, Some("invalid_type"), None).await;
    }
    // Unknown model: 404.
    chat_error(
        &app,
        chat(json!({"model": "gpt-9"})),
        StatusCode::NOT_FOUND,
        Some("model_not_found"),
        Some("model"),
    )
    .await;
    // Messages missing, empty; bad role; non-text part.
    chat_error(
        &app,
        json!({"model": "tandem-test"}),
        bad,
        None,
        Some("messages"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"messages": []})),
        bad,
        None,
        Some("messages"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"messages": [{"role": "wizard", "content": "x"}]})),
        bad,
        None,
        Some("messages[0].role"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})),
        bad,
        None,
        Some("messages[0].content[0]"),
    )
    .await;
    // max_tokens 0 and negative; the newer field named when it is the one used.
    chat_error(
        &app,
        chat(json!({"max_tokens": 0})),
        bad,
        None,
        Some("max_tokens"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"max_tokens": -5})),
        bad,
        None,
        Some("max_tokens"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"max_completion_tokens": 0})),
        bad,
        None,
        Some("max_completion_tokens"),
    )
    .await;
    // Out-of-range and unsupported parameters.
    chat_error(
        &app,
        chat(json!({"temperature": 2.5})),
        bad,
        None,
        Some("temperature"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"temperature": -0.1})),
        bad,
        None,
        Some("temperature"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"n": 2})),
        bad,
        Some("unsupported_parameter"),
        Some("n"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"n": 0})),
        bad,
        Some("unsupported_parameter"),
        Some("n"),
    )
    .await;
    // Logprobs: top_logprobs only with logprobs, and at most 20 (OpenAI's rules).
    for body in [
        json!({"top_logprobs": 2}),
        json!({"logprobs": false, "top_logprobs": 0}),
        json!({"logprobs": true, "top_logprobs": 21}),
        json!({"logprobs": true, "top_logprobs": -1}),
    ] {
        chat_error(&app, chat(body), bad, None, Some("top_logprobs")).await;
    }
    chat_error(&app, chat(json!({"top_k": -2})), bad, None, Some("top_k")).await;
    chat_error(&app, chat(json!({"min_p": 1.5})), bad, None, Some("min_p")).await;
    chat_error(
        &app,
        chat(json!({"tools": [{"type": "function"}]})),
        bad,
        None,
        Some("tools[0]"),
    )
    .await;
    chat_error(
        &app,
        chat(json!({"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {}}}]})),
        bad,
        Some("unsupported_parameter"),
        Some("tool_choice"),
    )
    .await;
    chat_error(&app, chat(json!({"top_p": 1.5})), bad, None, Some("top_p")).await;
    chat_error(
        &app,
        chat(json!({"response_format": {"type": "json_object"}})),
        bad,
        Some("unsupported_parameter"),
        Some("response_format"),
    )
    .await;
    let many: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    chat_error(&app, chat(json!({"stop": many})), bad, None, Some("stop")).await;
    chat_error(
        &app,
        chat(json!({"stop": "x".repeat(2000)})),
        bad,
        None,
        Some("stop"),
    )
    .await;

    // Completions: prompt missing, empty, batched, bad token id, unsupported fields.
    let comp = |body: Value| post_json("/v1/completions", &body);
    assert_error(send(&app, comp(json!({}))).await, bad, None, Some("prompt")).await;
    assert_error(
        send(&app, comp(json!({"prompt": ""}))).await,
        bad,
        None,
        Some("prompt"),
    )
    .await;
    assert_error(
        send(&app, comp(json!({"prompt": []}))).await,
        bad,
        None,
        Some("prompt"),
    )
    .await;
    assert_error(
        send(&app, comp(json!({"prompt": ["a", "b"]}))).await,
        bad,
        None,
        Some("prompt"),
    )
    .await;
    assert_error(
        send(&app, comp(json!({"prompt": [4_000_000_000u64]}))).await,
        bad,
        None,
        Some("prompt"),
    )
    .await;
    // Completions' logprobs: at most 5 alternatives (OpenAI's limit).
    assert_error(
        send(&app, comp(json!({"prompt": "a", "logprobs": 6}))).await,
        bad,
        None,
        Some("logprobs"),
    )
    .await;
    assert_error(
        send(&app, comp(json!({"prompt": "a", "echo": true}))).await,
        bad,
        Some("unsupported_parameter"),
        Some("echo"),
    )
    .await;
    assert_error(
        send(&app, comp(json!({"prompt": "a", "best_of": 3}))).await,
        bad,
        Some("unsupported_parameter"),
        Some("best_of"),
    )
    .await;
    assert_error(
        send(&app, comp(json!({"prompt": [-1]}))).await,
        StatusCode::UNPROCESSABLE_ENTITY,
        Some("invalid_type"),
        None,
    )
    .await;

    // Unknown path and wrong method: JSON too.
    let resp = send(&app, get("/v1/nothing")).await;
    assert_error(resp, StatusCode::NOT_FOUND, Some("not_found"), None).await;
    let resp = send(&app, get("/v1/chat/completions")).await;
    assert_error(
        resp,
        StatusCode::METHOD_NOT_ALLOWED,
        Some("method_not_allowed"),
        None,
    )
    .await;

    // None of these reached the backend.
    assert!(backend.seen.lock().is_empty());
}

#[tokio::test]
async fn context_length_is_enforced() {
    let backend = FakeBackend::text("ok");
    let cfg = HttpConfig {
        context_length: 10,
        ..config()
    };
    let (app, _) = setup(backend.clone(), cfg);
    let code = Some("context_length_exceeded");
    let bad = StatusCode::BAD_REQUEST;
    // Prompt alone fills the context.
    let long = json!({"prompt": (1..=10).collect::<Vec<u32>>()});
    assert_error(
        send(&app, post_json("/v1/completions", &long)).await,
        bad,
        code,
        Some("prompt"),
    )
    .await;
    let words = "word ".repeat(50);
    let resp = send(
        &app,
        post_json(
            "/v1/chat/completions",
            &chat(json!({"messages": [{"role": "user", "content": words}]})),
        ),
    )
    .await;
    assert_error(resp, bad, code, Some("messages")).await;
    // Prompt + max_tokens over the context.
    let body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 7});
    assert_error(
        send(&app, post_json("/v1/completions", &body)).await,
        bad,
        code,
        Some("max_tokens"),
    )
    .await;
    // Exactly full is fine.
    let body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 6});
    assert_eq!(
        send(&app, post_json("/v1/completions", &body))
            .await
            .status(),
        StatusCode::OK
    );
    // Huge max_tokens does not overflow.
    let body = json!({"prompt": [1], "max_tokens": i64::MAX});
    assert_error(
        send(&app, post_json("/v1/completions", &body)).await,
        bad,
        code,
        Some("max_tokens"),
    )
    .await;
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let backend = FakeBackend::text("ok");
    let cfg = HttpConfig {
        max_body_bytes: 1024,
        ..config()
    };
    let (app, _) = setup(backend.clone(), cfg);
    let big = chat(json!({"messages": [{"role": "user", "content": "x".repeat(2000)}]}));
    // With a content-length header (checked up front) ...
    let resp = send(&app, post_json("/v1/chat/completions", &big)).await;
    assert_error(
        resp,
        StatusCode::PAYLOAD_TOO_LARGE,
        Some("request_too_large"),
        None,
    )
    .await;
    // ... and streamed without one (counted while reading).
    let pieces: Vec<Result<axum::body::Bytes, std::io::Error>> = big
        .to_string()
        .into_bytes()
        .chunks(100)
        .map(|c| Ok(axum::body::Bytes::copy_from_slice(c)))
        .collect();
    let body = Body::from_stream(futures::stream::iter(pieces));
    let resp = send(&app, post("/v1/chat/completions", body)).await;
    assert_error(
        resp,
        StatusCode::PAYLOAD_TOO_LARGE,
        Some("request_too_large"),
        None,
    )
    .await;
    // Just under the limit is fine.
    let ok = chat(json!({"messages": [{"role": "user", "content": "x".repeat(800)}]}));
    assert_eq!(
        send(&app, post_json("/v1/chat/completions", &ok))
            .await
            .status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn backend_errors_before_the_first_token_get_their_status() {
    let cases = [
        (
            Script::FailGenerate(ServeError::overloaded("busy", Duration::from_millis(1500))),
            StatusCode::TOO_MANY_REQUESTS,
            Some("overloaded"),
        ),
        (
            Script::FailGenerate(ServeError::unavailable("no decode workers")),
            StatusCode::SERVICE_UNAVAILABLE,
            Some("unavailable"),
        ),
        (
            Script::FailFirst(ServeError::overloaded("queue full", Duration::from_secs(3))),
            StatusCode::TOO_MANY_REQUESTS,
            Some("overloaded"),
        ),
        (
            Script::FailFirst(ServeError::internal("boom")),
            StatusCode::INTERNAL_SERVER_ERROR,
            Some("internal_error"),
        ),
        (
            Script::Empty,
            StatusCode::INTERNAL_SERVER_ERROR,
            Some("internal_error"),
        ),
        (
            Script::FailGenerate(ServeError::from(tandem_router::RouteError::NoWorkers)),
            StatusCode::SERVICE_UNAVAILABLE,
            Some("unavailable"),
        ),
    ];
    for (script, status, code) in cases {
        for stream in [false, true] {
            let backend = FakeBackend::new(script.clone());
            let (app, _) = setup(backend.clone(), config());
            let resp = send(
                &app,
                post_json("/v1/chat/completions", &chat(json!({"stream": stream}))),
            )
            .await;
            assert!(
                header(&resp, "x-request-id")
                    .unwrap()
                    .starts_with("chatcmpl-")
            );
            let retry_after = header(&resp, "retry-after").map(str::to_string);
            assert_error(resp, status, code, None).await;
            if status == StatusCode::TOO_MANY_REQUESTS {
                let secs: u64 = retry_after.expect("Retry-After").parse().unwrap();
                assert!(secs == 2 || secs == 3, "{secs}");
            }
        }
    }
}

#[tokio::test]
async fn backend_error_after_the_first_token() {
    let script = Script::FailAfter(
        "partial output".into(),
        ServeError::unavailable("decode worker lost"),
    );
    // Streaming: the head is sent; the error comes as an event, then [DONE].
    let backend = FakeBackend::new(script.clone());
    let (app, state) = setup(backend.clone(), config());
    let resp = send(
        &app,
        post_json("/v1/chat/completions", &chat(json!({"stream": true}))),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let events = sse_data(&body_text(resp).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], "unavailable");
    assert_eq!(err["error"]["message"], "decode worker lost");
    assert!(backend.was_dropped());
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains(r#"tandem_http_stream_errors_total{endpoint="chat"} 1"#),
        "{metrics}"
    );
    // Not streaming: the whole response has the error's status.
    let backend = FakeBackend::new(script);
    let (app, _) = setup(backend.clone(), config());
    let resp = send(&app, post_json("/v1/chat/completions", &chat(json!({})))).await;
    assert_error(
        resp,
        StatusCode::SERVICE_UNAVAILABLE,
        Some("unavailable"),
        None,
    )
    .await;
}

#[tokio::test]
async fn a_stream_that_ends_without_finish_is_an_error_event() {
    // A backend whose stream ends after one chunk without a finish reason.
    let no_finish = crate::testing::FnBackend::new(|_: &ValidRequest| {
        let tokens = cl100k().encode("half").unwrap();
        let mut chunks = crate::testing::token_chunks(&tokens, tokens.len(), FinishReason::Stop);
        if let Some(Ok(last)) = chunks.last_mut() {
            last.finish = None;
        }
        Ok(chunks)
    });
    let state = HttpState::new(Arc::new(no_finish), config(), cl100k());
    let app = crate::http::app(state);
    let resp = send(
        &app,
        post_json("/v1/completions", &json!({"prompt": "a", "stream": true})),
    )
    .await;
    let events = sse_data(&body_text(resp).await);
    assert_eq!(events.len(), 3, "{events:?}");
    let err: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(err["error"]["type"], "server_error");
    assert_eq!(events[2], "[DONE]");
    let resp = send(&app, post_json("/v1/completions", &json!({"prompt": "a"}))).await;
    assert_error(
        resp,
        StatusCode::INTERNAL_SERVER_ERROR,
        Some("internal_error"),
        None,
    )
    .await;
}
