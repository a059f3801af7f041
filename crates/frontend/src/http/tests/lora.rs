//! LoRA adapters at the HTTP edge: `model` naming an adapter reaches the backend as that
//! adapter through every API, responses echo its name, `/v1/models` lists the adapters under
//! the base model, and unknown names are 404 everywhere.

use serde_json::json;

use super::*;

fn lora_config() -> HttpConfig {
    HttpConfig {
        lora_adapters: vec!["sql-lora".to_string(), "chat-lora".to_string()],
        ..config()
    }
}

/// One request body per API, on `model`.
fn bodies(model: &str) -> [(&'static str, Value); 4] {
    let hi = json!([{"role": "user", "content": "hi"}]);
    [
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": hi}),
        ),
        ("/v1/completions", json!({"model": model, "prompt": "hi"})),
        ("/v1/responses", json!({"model": model, "input": "hi"})),
        (
            "/v1/messages",
            json!({"model": model, "max_tokens": 8, "messages": hi}),
        ),
    ]
}

#[tokio::test]
async fn every_api_runs_a_request_on_the_adapter_its_model_names() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), lora_config());
    for (model, adapter) in [
        ("sql-lora", Some("sql-lora")),
        ("chat-lora", Some("chat-lora")),
        ("tandem-test", None),
    ] {
        for (path, body) in bodies(model) {
            let resp = send(&app, post_json(path, &body)).await;
            assert_eq!(resp.status(), StatusCode::OK, "{path} {model}");
            let v = body_json(resp).await;
            // Responses show the name asked for, as vLLM's do.
            assert_eq!(v["model"], model, "{path}: {v}");
            let seen = backend.last_request();
            assert_eq!(seen.adapter.as_deref(), adapter, "{path} {model}");
            assert_eq!(seen.model, model, "{path}");
        }
    }
    // No `model`: the base model.
    let resp = send(&app, post_json("/v1/completions", &json!({"prompt": "hi"}))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(backend.last_request().adapter, None);
    assert_eq!(backend.last_request().model, "tandem-test");
}

#[tokio::test]
async fn an_unknown_model_is_404_on_every_api() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), lora_config());
    for (path, body) in bodies("other-lora") {
        let resp = send(&app, post_json(path, &body)).await;
        if path == "/v1/messages" {
            assert_eq!(resp.status(), StatusCode::NOT_FOUND);
            let v = body_json(resp).await;
            assert_eq!(v["error"]["type"], "not_found_error", "{v}");
        } else {
            assert_error(
                resp,
                StatusCode::NOT_FOUND,
                Some("model_not_found"),
                Some("model"),
            )
            .await;
        }
    }
    // An adapter of another frontend is not served here.
    let (app, _) = setup(backend.clone(), config());
    let resp = send(&app, post_json("/v1/completions", &bodies("sql-lora")[1].1)).await;
    assert_error(
        resp,
        StatusCode::NOT_FOUND,
        Some("model_not_found"),
        Some("model"),
    )
    .await;
    assert!(
        backend.seen.lock().is_empty(),
        "nothing reached the backend"
    );
}

#[tokio::test]
async fn models_lists_the_adapters_under_the_base_model() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend, lora_config());
    let v = body_json(send(&app, get("/v1/models")).await).await;
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tandem-test", "sql-lora", "chat-lora"]);
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[0]["root"], "tandem-test");
    assert_eq!(data[0]["max_model_len"], 32768);
    for card in &data[1..] {
        assert_eq!(card["object"], "model");
        assert_eq!(card["parent"], "tandem-test", "{card}");
        assert_eq!(card["root"], card["id"], "{card}");
        assert_eq!(card["created"], data[0]["created"]);
    }
    let one = body_json(send(&app, get("/v1/models/sql-lora")).await).await;
    assert_eq!(one, data[1]);
    let base = body_json(send(&app, get("/v1/models/tandem-test")).await).await;
    assert_eq!(base, data[0]);
    assert_error(
        send(&app, get("/v1/models/other-lora")).await,
        StatusCode::NOT_FOUND,
        Some("model_not_found"),
        Some("model"),
    )
    .await;
}

#[test]
fn bad_adapter_lists_are_refused_at_start() {
    for (adapters, expect) in [
        (vec![""], "empty"),
        (vec!["tandem-test"], "served model"),
        (vec!["a", "a"], "twice"),
        (vec!["a b"], "whitespace"),
    ] {
        let cfg = HttpConfig {
            lora_adapters: adapters.iter().map(|a| a.to_string()).collect(),
            ..config()
        };
        let e = HttpState::builder(FakeBackend::text("ok"), cfg, cl100k())
            .build()
            .unwrap_err();
        assert!(e.to_string().contains(expect), "{adapters:?}: {e}");
    }
}
