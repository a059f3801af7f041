//! `tandem_bench::run` against a minimal OpenAI-compatible endpoint on loopback (axum): the
//! report counts what the endpoint streamed, sweeps run each rate, and a refused model or an
//! unreachable endpoint is a typed error before any load is sent. The real cluster is
//! `tests/cluster.rs` at the root (`tandem bench` against `tandem` processes).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::{Value, json};
use tandem_bench::{BenchConfig, BenchError, run, run_with};
use tandem_workload::{LengthDist, PromptShape, SyntheticConfig, WorkloadConfig};

/// Streams `max_tokens` one-word chunks, then the usage (a quarter of the prompt words
/// "cached") and `[DONE]`; counts the requests it saw.
async fn completions(State(seen): State<Arc<AtomicUsize>>, body: String) -> Response {
    seen.fetch_add(1, Ordering::Relaxed);
    let req: Value = serde_json::from_str(&body).unwrap_or_default();
    let n = req["max_tokens"].as_u64().unwrap_or(1);
    let words = req["prompt"].as_str().map_or(0, |p| p.split(' ').count()) as u64;
    let mut sse = String::new();
    for _ in 0..n {
        sse.push_str("data: {\"choices\":[{\"text\":\" x\"}]}\n\n");
    }
    let usage = json!({"choices": [], "usage": {"prompt_tokens": words,
        "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": words / 4}}});
    sse.push_str(&format!("data: {usage}\n\ndata: [DONE]\n\n"));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from(sse))
        .unwrap()
}

/// The endpoint's address, and how many completions it served.
async fn endpoint() -> (String, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"data": [{"id": "mocker"}]})) }),
        )
        .route("/v1/completions", post(completions))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/"), seen)
}

fn workload(requests: usize) -> WorkloadConfig {
    WorkloadConfig::Synthetic(SyntheticConfig {
        requests,
        rate: 200.0,
        isl: LengthDist::fixed(40),
        osl: LengthDist::fixed(6),
        shape: PromptShape::SharedPrefix {
            groups: 2,
            prefix_len: 32,
        },
        ..SyntheticConfig::default()
    })
}

#[tokio::test]
async fn a_run_measures_every_request_and_a_sweep_every_rate() {
    let (url, seen) = endpoint().await;
    let mut cfg = BenchConfig::new(url, workload(20));
    cfg.salt = Some("t".into());
    let sweep = run(&cfg).await.unwrap();
    assert_eq!(sweep.points.len(), 1);
    let r = &sweep.points[0];
    assert_eq!((r.requests, r.completed, r.failed), (20, 20, 0));
    assert_eq!(r.completion_tokens, 20 * 6);
    assert_eq!(r.salt, "t-0");
    assert_eq!(r.rate, 200.0, "the workload's own rate");
    // 1 salt word + 72 prompt words; a quarter reported cached.
    assert_eq!(r.prompt_tokens, 20 * 73);
    assert!((r.cache_hit_rate - 18.0 / 73.0).abs() < 1e-9);
    assert_eq!((r.ttft_ms.count, r.tpot_ms.count), (20, 20));
    assert_eq!(r.itl_ms.count, 20 * 5, "five gaps between six chunks");
    assert!(r.ttft_ms.p50 > 0.0 && r.ttft_ms.p50 <= r.e2e_ms.p50);
    assert_eq!(r.ttft_cdf_ms.len(), 101);
    assert_eq!(r.records.len(), 20);
    assert_eq!(seen.load(Ordering::Relaxed), 20);

    cfg.rates = vec![100.0, 400.0];
    cfg.max_concurrency = Some(4);
    let mut printed = Vec::new();
    let sweep = run_with(&cfg, |p| printed.push(p.rate)).await.unwrap();
    assert_eq!(printed, [100.0, 400.0]);
    let salts: Vec<&str> = sweep.points.iter().map(|p| p.salt.as_str()).collect();
    assert_eq!(salts, ["t-0", "t-1"]);
    assert!(sweep.points.iter().all(|p| p.completed == 20));
    assert_eq!(seen.load(Ordering::Relaxed), 60);
}

#[tokio::test]
async fn bad_input_is_refused_before_any_load() {
    let (url, seen) = endpoint().await;
    let mut cfg = BenchConfig::new(url.clone(), workload(5));
    cfg.model = "gpt-nope".into();
    let e = run(&cfg).await.unwrap_err();
    assert!(matches!(e, BenchError::ModelNotServed { .. }), "{e}");
    assert!(e.is_invalid_input());
    assert!(
        e.to_string().contains("does not serve model \"gpt-nope\""),
        "{e}"
    );

    let mut cfg = BenchConfig::new(url, workload(5));
    cfg.slo.tpot_ms = 0.0;
    assert!(
        run(&cfg)
            .await
            .unwrap_err()
            .to_string()
            .contains("--slo-tpot-ms")
    );
    cfg.slo.tpot_ms = 25.0;
    cfg.rates = vec![0.0];
    assert!(matches!(
        run(&cfg).await.unwrap_err(),
        BenchError::InvalidConfig(_)
    ));
    assert_eq!(seen.load(Ordering::Relaxed), 0);

    // Nothing listens on a port just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = BenchConfig::new(format!("http://127.0.0.1:{port}"), workload(5));
    let e = run(&cfg).await.unwrap_err();
    assert!(matches!(e, BenchError::Unreachable { .. }), "{e}");
    assert!(!e.is_invalid_input());
}
