//! Operations: health, liveness, models, metrics, draining, and a real loopback server for
//! client disconnects and graceful shutdown.

use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::*;

#[tokio::test]
async fn health_live_and_models() {
    let backend = FakeBackend::text("ok");
    let (app, _) = setup(backend.clone(), config());
    assert_eq!(send(&app, get("/health")).await.status(), StatusCode::OK);
    assert_eq!(send(&app, get("/live")).await.status(), StatusCode::OK);
    backend.set_ready(false);
    let resp = send(&app, get("/health")).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(send(&app, get("/live")).await.status(), StatusCode::OK);

    let v = body_json(send(&app, get("/v1/models")).await).await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    assert_eq!(v["data"][0]["id"], "tandem-test");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "tandem");
    assert!(v["data"][0]["created"].is_u64());
    // vLLM's ModelCard fields: no parent for the base model.
    assert_eq!(v["data"][0]["root"], "tandem-test");
    assert_eq!(v["data"][0]["parent"], Value::Null);
    let v = body_json(send(&app, get("/v1/models/tandem-test")).await).await;
    assert_eq!(v["id"], "tandem-test");
    let resp = send(&app, get("/v1/models/other/model")).await;
    assert_error(
        resp,
        StatusCode::NOT_FOUND,
        Some("model_not_found"),
        Some("model"),
    )
    .await;
}

#[tokio::test]
async fn draining_turns_new_requests_away_and_lets_streams_finish() {
    let backend = FakeBackend::text("one two three");
    let (app, state) = setup(backend.clone(), config());
    let body = json!({"prompt": "x", "stream": true});
    let resp = send(&app, post_json("/v1/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(state.in_flight(), 1);

    state.start_draining();
    assert!(state.is_draining());
    assert_eq!(
        send(&app, get("/health")).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    let refused = send(&app, post_json("/v1/completions", &json!({"prompt": "y"}))).await;
    assert_error(
        refused,
        StatusCode::SERVICE_UNAVAILABLE,
        Some("draining"),
        None,
    )
    .await;
    assert_eq!(backend.seen.lock().len(), 1);

    // The stream admitted before draining completes.
    let events = sse_data(&body_text(resp).await);
    assert_eq!(events.last().unwrap(), "[DONE]");
    tokio::time::timeout(Duration::from_secs(5), state.wait_idle())
        .await
        .expect("idle after the stream");
    assert_eq!(state.in_flight(), 0);
}

#[tokio::test]
async fn metrics_count_requests_latency_and_tokens() {
    let backend = FakeBackend::text("a b c");
    let (app, state) = setup(backend.clone(), config());
    let body = json!({"prompt": "hello", "stream": true});
    body_text(send(&app, post_json("/v1/completions", &body)).await).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    body_text(send(&app, post_json("/v1/chat/completions", &body)).await).await;
    send(&app, post("/v1/chat/completions", "{")).await;

    let resp = send(&crate::http::admin_app(state.clone()), get("/metrics")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let text = body_text(resp).await;
    for needle in [
        r#"tandem_http_requests_total{endpoint="completion",status="200"} 1"#,
        r#"tandem_http_requests_total{endpoint="chat",status="200"} 1"#,
        r#"tandem_http_requests_total{endpoint="chat",status="400"} 1"#,
        "tandem_http_requests_in_flight 0",
        "tandem_http_time_to_first_token_seconds_count 2",
        "tandem_http_request_duration_seconds_count 2",
        "tandem_http_completion_tokens_total 6",
        "tandem_http_cached_tokens_total 14",
        "tandem_http_prompt_tokens_total",
        r#"tandem_http_stream_errors_total{endpoint="chat"} 0"#,
        r#"tandem_http_client_disconnects_total{endpoint="completion"} 0"#,
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

const REQUEST: &str =
    r#"{"model":"tandem-test","messages":[{"role":"user","content":"hi"}],"stream":true}"#;

async fn raw_request(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: \
         application/json\r\ncontent-length: {}\r\n\r\n{REQUEST}",
        REQUEST.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn
}

/// Reads until `needle` shows up in what was received (or 5 s pass).
async fn read_until(conn: &mut tokio::net::TcpStream, needle: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !String::from_utf8_lossy(&got).contains(needle) {
        let n = tokio::time::timeout_at(deadline, conn.read(&mut buf))
            .await
            .expect("response in time")
            .unwrap();
        assert!(
            n > 0,
            "connection closed early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn loopback_client_disconnect_cancels_and_shutdown_is_graceful() {
    let backend = FakeBackend::new(Script::Text {
        text: "a b c".into(),
        finish: FinishReason::Stop,
        hang: true,
    });
    let (app, state) = setup(backend.clone(), config());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(crate::http::serve(listener, app.clone(), shutdown.clone()));

    // A client that reads the first content and hangs up mid-stream.
    let mut conn = raw_request(addr).await;
    let got = read_until(&mut conn, " c").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("x-tandem-decode-worker: 11"), "{got}");
    assert!(!backend.was_dropped());
    drop(conn);
    backend.wait_dropped().await;

    // A client that hangs up while the backend has not produced the first token.
    let backend2 = FakeBackend::new(Script::Hang);
    let (app2, _) = setup(backend2.clone(), config());
    let listener2 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr2 = listener2.local_addr().unwrap();
    let server2 = tokio::spawn(crate::http::serve(listener2, app2, shutdown.clone()));
    let conn = raw_request(addr2).await;
    backend2.wait_seen().await;
    drop(conn);
    backend2.wait_dropped().await;

    // The disconnect is in the metrics of the first server.
    tokio::time::timeout(Duration::from_secs(5), state.wait_idle())
        .await
        .expect("idle");
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains(r#"tandem_http_client_disconnects_total{endpoint="chat"} 1"#),
        "{metrics}"
    );

    // Then shutdown: both servers return.
    shutdown.cancel();
    for s in [server, server2] {
        tokio::time::timeout(Duration::from_secs(5), s)
            .await
            .expect("serve returns after shutdown")
            .unwrap()
            .unwrap();
    }
}

#[tokio::test]
async fn prompt_token_mismatch_is_counted_and_equal_counts_are_not() {
    let backend = FakeBackend::text("fine");
    let (app, state) = setup(backend.clone(), config());
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    // No report: nothing to compare.
    let resp = send(&app, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(state.metrics().prompt_token_mismatches(), 0);
    // The engine agrees.
    backend.report_prompt_tokens(0);
    let resp = send(&app, post_json("/v1/chat/completions", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(state.metrics().prompt_token_mismatches(), 0);
    // The engine saw one more token (say, a BOS the frontend did not send): counted, on
    // every endpoint, streaming or not.
    backend.report_prompt_tokens(1);
    for (path, body) in [
        ("/v1/chat/completions", body.clone()),
        ("/v1/completions", json!({"prompt": "hi", "stream": true})),
    ] {
        let resp = send(&app, post_json(path, &body)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let _ = body_text(resp).await;
    }
    assert_eq!(state.metrics().prompt_token_mismatches(), 2);
    let text = scrape(&state).await;
    assert!(
        text.contains("tandem_frontend_prompt_token_mismatch_total 2"),
        "{text}"
    );
}

/// `GET path` on a keep-alive connection; the body (the answers here are short and unchunked).
async fn get_on(conn: &mut tokio::net::TcpStream, path: &str) -> String {
    let head = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    let got = read_until(conn, "\r\n\r\n").await;
    let (head, body) = got.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("content-length")
        .parse()
        .unwrap();
    let mut body = body.as_bytes().to_vec();
    while body.len() < len {
        let mut buf = [0u8; 256];
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the body's end");
        body.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(body).unwrap()
}

/// Served on threads: connections go round robin to the serving threads and stay on theirs
/// (the handler sees the thread's index), and a shutdown waits for a request in flight.
#[tokio::test]
async fn connections_are_spread_over_serving_threads_and_shutdown_waits_for_them() {
    use tandem_runtime::serving::{ServingThreads, serving_index};
    let (entered, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (e, r) = (entered.clone(), release.clone());
    let app = axum::Router::new()
        .route(
            "/who",
            axum::routing::get(|| async { serving_index().to_string() }),
        )
        .route(
            "/slow",
            axum::routing::get(move || {
                let (e, r) = (e.clone(), r.clone());
                async move {
                    e.notify_one();
                    r.notified().await;
                    "done"
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let mut server = tokio::spawn(async move {
        let threads = ServingThreads::start(2, "test-http").unwrap();
        crate::http::serve_on_threads(listener, app, stop, &threads).await
    });

    let mut a = tokio::net::TcpStream::connect(addr).await.unwrap();
    let first = get_on(&mut a, "/who").await;
    let mut b = tokio::net::TcpStream::connect(addr).await.unwrap();
    let second = get_on(&mut b, "/who").await;
    let mut seen = [first.clone(), second];
    seen.sort();
    assert_eq!(seen, ["1", "2"]);
    // A connection stays on its thread.
    for _ in 0..3 {
        assert_eq!(get_on(&mut a, "/who").await, first);
    }

    // A request in flight when the shutdown comes is finished first.
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /slow HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    entered.notified().await;
    shutdown.cancel();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut server)
            .await
            .is_err(),
        "the server returned with a request in flight"
    );
    release.notify_one();
    let got = read_until(&mut slow, "done").await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve returns once the request is answered")
        .unwrap()
        .unwrap();
}
