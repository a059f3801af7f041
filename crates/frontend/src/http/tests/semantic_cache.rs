//! The semantic cache at the HTTP edge: a request that means the same as one answered before
//! is answered from the cache (whole or streamed, through the request's own format) without
//! reaching a worker; tenants never share answers; what may not be cached is not.

use axum::http::header;
use serde_json::json;

use super::*;
use crate::http::SemanticCacheConfig;
use crate::http::auth::AccessConfig;

const ACME: &str = "sk-acme-0123456789abcdef";
const BETA: &str = "sk-beta-0123456789abcdef";

fn cached_config() -> HttpConfig {
    HttpConfig {
        semantic_cache: SemanticCacheConfig {
            enabled: true,
            ..SemanticCacheConfig::default()
        },
        access: AccessConfig {
            api_keys: vec![
                (ACME.to_string(), "acme".to_string()),
                (BETA.to_string(), "beta".to_string()),
            ],
            ..AccessConfig::default()
        },
        ..config()
    }
}

fn chat(key: &str, system: &str, question: &str, stream: bool) -> Request<Body> {
    let body = json!({
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "stream": stream,
    });
    Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// (generation requests, embedding requests) the backend has seen.
fn seen(b: &FakeBackend) -> (usize, usize) {
    let s = b.seen.lock();
    let embeds = s.iter().filter(|r| r.embed).count();
    (s.len() - embeds, embeds)
}

#[tokio::test]
async fn the_same_question_is_answered_from_the_cache_and_never_for_another_tenant() {
    let backend = FakeBackend::text("Paris is the capital.");
    let (app, state) = setup(backend.clone(), cached_config());
    let ask = |key, system, question| chat(key, system, question, false);
    let first = send(
        &app,
        ask(ACME, "Be brief.", "What is the capital of France?"),
    )
    .await;
    assert_eq!(header(&first, "x-tandem-semantic-cache"), Some("miss"));
    let first = body_json(first).await;
    assert_eq!(seen(&backend), (1, 1));
    // The embedding asked for the question alone (the system message is not compared).
    let asked = backend.seen.lock()[0].clone();
    assert!(asked.embed && asked.max_tokens == 1);
    assert_eq!(
        asked.prompt_tokens,
        cl100k()
            .encode("user: What is the capital of France?\n")
            .unwrap()
    );
    assert_eq!(
        asked.tenant.as_deref(),
        Some("acme"),
        "billed to the tenant"
    );

    // Again, under another system prompt: from the cache, no worker.
    backend.set_script(Script::Text {
        text: "something else".into(),
        finish: FinishReason::Stop,
        hang: false,
    });
    let again = send(
        &app,
        ask(ACME, "Answer kindly.", "What is the capital of France?"),
    )
    .await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(header(&again, "x-tandem-semantic-cache"), Some("hit"));
    assert_eq!(
        header(&again, "x-tandem-semantic-cache-distance"),
        Some("0.0000")
    );
    assert_eq!(header(&again, "x-tandem-decode-worker"), None);
    let again = body_json(again).await;
    assert_eq!(seen(&backend), (1, 2), "an embedding, no generation");
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt
    );

    // The same question from another tenant: a miss, answered by the pool.
    let other = send(
        &app,
        ask(BETA, "Be brief.", "What is the capital of France?"),
    )
    .await;
    assert_eq!(header(&other, "x-tandem-semantic-cache"), Some("miss"));
    let other = body_json(other).await;
    assert_eq!(other["choices"][0]["message"]["content"], "something else");
    assert_eq!(seen(&backend), (2, 3));

    // The same tenant with a cache salt of its own: kept apart too.
    let mut salted = ask(ACME, "Be brief.", "What is the capital of France?");
    let body: Value = serde_json::from_slice(
        &axum::body::to_bytes(std::mem::take(salted.body_mut()), usize::MAX)
            .await
            .unwrap(),
    )
    .unwrap();
    let mut body = body;
    body["cache_salt"] = json!("private");
    *salted.body_mut() = Body::from(body.to_string());
    salted.headers_mut().remove(header::CONTENT_LENGTH);
    let resp = send(&app, salted).await;
    assert_eq!(header(&resp, "x-tandem-semantic-cache"), Some("miss"));
    assert_eq!(seen(&backend), (3, 4));

    // Another question of the first tenant: a miss too.
    let new = send(
        &app,
        ask(ACME, "Be brief.", "How many legs does a spider have?"),
    )
    .await;
    assert_eq!(header(&new, "x-tandem-semantic-cache"), Some("miss"));
    let metrics = scrape(&state).await;
    for line in [
        "tandem_frontend_semantic_cache_lookups_total 5",
        "tandem_frontend_semantic_cache_hits_total 1",
        "tandem_frontend_semantic_cache_stores_total 4",
        "tandem_frontend_semantic_cache_entries 4",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

#[tokio::test]
async fn a_hit_replays_as_the_stream_the_client_asked_for() {
    let backend = FakeBackend::text("one two three four");
    let (app, _) = setup(backend.clone(), cached_config());
    let whole = body_json(send(&app, chat(ACME, "s", "Count to four.", false)).await).await;
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap();
    let resp = send(&app, chat(ACME, "s", "Count to four.", true)).await;
    assert_eq!(header(&resp, "x-tandem-semantic-cache"), Some("hit"));
    assert_eq!(header(&resp, "content-type"), Some("text/event-stream"));
    let events = sse_data(&body_text(resp).await);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(seen(&backend), (1, 2));
}

#[tokio::test]
async fn what_may_not_be_cached_is_neither_looked_up_nor_stored() {
    let backend = FakeBackend::text("ok");
    let (app, state) = setup(backend.clone(), cached_config());
    let with = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        Request::builder()
            .method("POST")
            .uri("/v1/chat/completions")
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {ACME}"))
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let tools =
        json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
    for extra in [json!({"logprobs": true}), tools] {
        for _ in 0..2 {
            let resp = send(&app, with(extra.clone())).await;
            assert_eq!(resp.status(), StatusCode::OK);
            assert_eq!(header(&resp, "x-tandem-semantic-cache"), None, "{extra}");
        }
    }
    assert_eq!(seen(&backend), (4, 0));
    // An answer the edge cut before the backend ended it (a stop string) is not stored: the
    // next is a miss again.
    backend.set_script(Script::Text {
        text: "one two three four five".into(),
        finish: FinishReason::Stop,
        hang: false,
    });
    let stop = || with(json!({"stop": [" two"]}));
    for _ in 0..2 {
        let resp = send(&app, stop()).await;
        assert_eq!(header(&resp, "x-tandem-semantic-cache"), Some("miss"));
    }
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains("tandem_frontend_semantic_cache_stores_total 0"),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_embedding_that_fails_is_a_miss_that_goes_on_to_the_pool() {
    let backend = FakeBackend::text("fine");
    backend.embeds.store(false, Ordering::SeqCst);
    let (app, state) = setup(backend.clone(), cached_config());
    let resp = send(&app, chat(ACME, "s", "Hello?", false)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(header(&resp, "x-tandem-semantic-cache"), None);
    assert_eq!(
        seen(&backend),
        (1, 1),
        "the embedding asked, and the answer"
    );
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains("tandem_frontend_semantic_cache_embedding_errors_total 1"),
        "{metrics}"
    );
}

/// What the stand-in endpoint was asked: (authorization header, body), in order.
type Asked = Arc<Mutex<Vec<(String, Value)>>>;

/// A stand-in embeddings endpoint on a loopback port: the text's bytes counted into buckets;
/// records what it was asked (the bearer key and the model); `fail` answers 500.
async fn embeddings_endpoint(fail: bool) -> (String, Asked) {
    use axum::extract::State as S;
    let asked: Asked = Arc::default();
    let app = axum::Router::new()
        .route(
            "/v1/embeddings",
            axum::routing::post(
                move |S(asked): S<Asked>,
                      headers: axum::http::HeaderMap,
                      axum::Json(body): axum::Json<Value>| async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    let text = body["input"].as_str().unwrap_or_default().to_string();
                    asked.lock().push((auth, body));
                    if fail {
                        return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(json!({})));
                    }
                    let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
                    let v = fake_embedding(&bytes);
                    (
                        StatusCode::OK,
                        axum::Json(json!({"data": [{"embedding": v}]})),
                    )
                },
            ),
        )
        .with_state(asked.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1/embeddings"), asked)
}

fn remote_config(url: String) -> HttpConfig {
    let mut c = cached_config();
    c.semantic_cache.embeddings_url = Some(url);
    c.semantic_cache.embeddings_model = Some("e5-small".into());
    c.semantic_cache.embeddings_key = Some(crate::http::ApiKey("sk-embed".into()));
    c
}

#[tokio::test]
async fn a_configured_embeddings_endpoint_embeds_instead_of_the_pool() {
    let (url, asked) = embeddings_endpoint(false).await;
    let backend = FakeBackend::text("an answer");
    let (app, _) = setup(backend.clone(), remote_config(url));
    let first = send(&app, chat(ACME, "s", "Hello there?", false)).await;
    assert_eq!(header(&first, "x-tandem-semantic-cache"), Some("miss"));
    let again = send(&app, chat(ACME, "s", "Hello there?", false)).await;
    assert_eq!(header(&again, "x-tandem-semantic-cache"), Some("hit"));
    assert_eq!(seen(&backend), (1, 0), "the pool embedded nothing");
    let asked = asked.lock().clone();
    assert_eq!(asked.len(), 2);
    assert_eq!(asked[0].0, "Bearer sk-embed");
    assert_eq!(asked[0].1["model"], "e5-small");
    assert_eq!(asked[0].1["input"], "user: Hello there?\n");
}

#[tokio::test]
async fn an_embeddings_endpoint_that_fails_leaves_requests_to_the_pool() {
    let (url, asked) = embeddings_endpoint(true).await;
    let backend = FakeBackend::text("an answer");
    let (app, state) = setup(backend.clone(), remote_config(url));
    for _ in 0..2 {
        let resp = send(&app, chat(ACME, "s", "Hello there?", false)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(header(&resp, "x-tandem-semantic-cache"), None);
    }
    assert_eq!(asked.lock().len(), 2);
    assert_eq!(seen(&backend), (2, 0));
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains("tandem_frontend_semantic_cache_embedding_errors_total 2"),
        "{metrics}"
    );
}
