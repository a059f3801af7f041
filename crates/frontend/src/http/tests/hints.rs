//! Routing hints through the HTTP edge: the `tandem` field, `reasoning_effort`, sessions from
//! `user`, `metadata.user_id`, a configured field or `x-session-id`; bad values are 400s.

use serde_json::json;

use super::*;
use crate::http::SessionField;

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "tandem-test", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn hints_reach_the_backend_from_every_endpoint() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), config());
    let body = chat(json!({
        "tandem": {"overlap_credit": 0.25, "temperature": 0.5, "osl": 40},
        "user": "u-1",
    }));
    let resp = send(&app, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let r = backend.last_request().routing;
    assert_eq!(r.overrides.overlap_credit, Some(0.25));
    assert_eq!(r.overrides.temperature, Some(0.5));
    assert_eq!(r.expected_output_tokens, Some(40));
    assert_eq!(r.session.as_deref(), Some("u-1"));
    // reasoning_effort maps to an expected length; x-session-id wins over `user`.
    let body = chat(json!({"reasoning_effort": "medium", "user": "u-2"}));
    let mut req = post_json("/v1/chat/completions", &body);
    req.headers_mut()
        .insert("x-session-id", "conv-3".parse().unwrap());
    assert_eq!(send(&app, req).await.status(), StatusCode::OK);
    let r = backend.last_request().routing;
    assert_eq!(r.expected_output_tokens, Some(4096));
    assert_eq!(r.session.as_deref(), Some("conv-3"));
    // Completions, Responses (`reasoning.effort`) and Messages (`metadata.user_id`).
    let body = json!({"prompt": "hi", "tandem": {"session_id": "s-c"}});
    assert_eq!(
        send(&app, post_json("/v1/completions", &body))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        backend.last_request().routing.session.as_deref(),
        Some("s-c")
    );
    let body = json!({"input": "hi", "reasoning": {"effort": "high"}, "user": "r"});
    assert_eq!(
        send(&app, post_json("/v1/responses", &body)).await.status(),
        StatusCode::OK
    );
    let r = backend.last_request().routing;
    assert_eq!(
        (r.expected_output_tokens, r.session.as_deref()),
        (Some(16_384), Some("r"))
    );
    let body = json!({
        "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "anthropic-user"}
    });
    assert_eq!(
        send(&app, post_json("/v1/messages", &body)).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        backend.last_request().routing.session.as_deref(),
        Some("anthropic-user")
    );
}

#[tokio::test]
async fn a_configured_session_field_or_none() {
    let backend = FakeBackend::text("ok");
    let mut cfg = config();
    cfg.session_field = SessionField::Field("conversation_id".into());
    let (app, _) = setup(backend.clone(), cfg);
    let body = chat(json!({"conversation_id": 77, "user": "ignored"}));
    assert_eq!(
        send(&app, post_json("/v1/chat/completions", &body))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        backend.last_request().routing.session.as_deref(),
        Some("77")
    );
    let mut cfg = config();
    cfg.session_field = SessionField::Off;
    let (app, _) = setup(backend.clone(), cfg);
    let body = chat(json!({"user": "ignored"}));
    send(&app, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(backend.last_request().routing.session, None);
}

#[tokio::test]
async fn bad_hints_are_400s_naming_the_field() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), config());
    let bad = StatusCode::BAD_REQUEST;
    for (extra, param) in [
        (
            json!({"tandem": {"overlap_credit": -1}}),
            "tandem.overlap_credit",
        ),
        (
            json!({"tandem": {"prefill_load_scale": -0.5}}),
            "tandem.prefill_load_scale",
        ),
        (json!({"tandem": {"osl": 0}}), "tandem.osl"),
        (json!({"reasoning_effort": "extreme"}), "reasoning_effort"),
        (json!({"user": "x".repeat(300)}), "user"),
    ] {
        let resp = send(
            &app,
            post_json("/v1/chat/completions", &chat(extra.clone())),
        )
        .await;
        assert_error(resp, bad, None, Some(param)).await;
    }
    // An unknown member of `tandem` is refused, not ignored.
    let resp = send(
        &app,
        post_json(
            "/v1/chat/completions",
            &chat(json!({"tandem": {"temprature": 0.1}})),
        ),
    )
    .await;
    assert!(resp.status().is_client_error(), "{}", resp.status());
    let mut req = post_json("/v1/chat/completions", &chat(json!({})));
    req.headers_mut()
        .insert("x-session-id", "y".repeat(300).parse().unwrap());
    assert_error(send(&app, req).await, bad, None, Some("x-session-id")).await;
}
