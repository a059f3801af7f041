//! SGLang disaggregation through two sidecars, against fake SGLang servers that record what
//! they are sent: the prefill and decode engines get the same request with the same
//! `bootstrap_room` and the prefill engine's `bootstrap_host` / `bootstrap_port`, at the same
//! time (the fake prefill engine answers only once the decode engine's request has arrived,
//! as a real one waits in its bootstrap room), and the decode engine's cumulative
//! `output_ids` come out as increments.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tandem_external::{EngineKind, SidecarConfig, sidecar};
use tandem_protocol::grpc::{
    GenerateRequest, PrefillOutcome, RemotePrefillTarget, Sampling, worker_client::WorkerClient,
};
use tandem_protocol::{HashSeed, WorkerId, WorkerRole};
use tandem_runtime::discovery::MemoryDiscovery;
use tandem_runtime::events::MemoryEventPlane;
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;
use tokio::sync::Notify;

#[derive(Default)]
struct Fake {
    bodies: Mutex<Vec<Value>>,
    /// Shared by the two fakes: the decode engine's request came.
    decode_arrived: Arc<Notify>,
    prefill_answered: Mutex<Option<bool>>,
}

async fn serve(fake: Arc<Fake>, prefill: bool) -> String {
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/get_server_info",
            get(|| async {
                axum::Json(json!({
                    "page_size": 16, "max_total_num_tokens": 16000,
                    "disaggregation_bootstrap_port": 8998,
                }))
            }),
        )
        .route(
            "/metrics",
            get(|| async { "sglang:num_running_reqs{model_name=\"m\"} 0\n" }),
        )
        .route(
            "/generate",
            post(move |State(f): State<Arc<Fake>>, axum::Json(body): axum::Json<Value>| async move {
                f.bodies.lock().push(body.clone());
                if prefill {
                    // A real prefill engine waits in the room for its decode engine.
                    let ok = tokio::time::timeout(Duration::from_secs(5), f.decode_arrived.notified())
                        .await
                        .is_ok();
                    *f.prefill_answered.lock() = Some(ok);
                    return axum::Json(json!({
                        "text": "", "output_ids": [1],
                        "meta_info": {"prompt_tokens": 40, "cached_tokens": 0,
                                      "finish_reason": {"type": "length", "length": 1}},
                    }))
                    .into_response();
                }
                f.decode_arrived.notify_one();
                let events = [
                    json!({"text": "a", "output_ids": [7], "meta_info": {"finish_reason": null}}),
                    json!({"text": "ab", "output_ids": [7, 8], "meta_info": {"finish_reason": null}}),
                    json!({"text": "abc", "output_ids": [7, 8, 9], "meta_info": {
                        "prompt_tokens": 40, "cached_tokens": 32,
                        "finish_reason": {"type": "length", "length": 3}}}),
                ];
                let mut sse = String::new();
                for e in events {
                    sse.push_str(&format!("data: {e}\n\n"));
                }
                sse.push_str("data: [DONE]\n\n");
                ([("content-type", "text/event-stream")], sse).into_response()
            }),
        )
        .with_state(fake);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn sidecar_on(role: WorkerRole, id: u64, url: &str, shutdown: &Shutdown) -> String {
    let mut c = SidecarConfig::new(WorkerId(id), role, EngineKind::Sglang, url);
    c.model = "m".into();
    c.startup_timeout = Duration::from_secs(5);
    c.health_interval = Duration::from_millis(100);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        sidecar::run(
            c,
            listener,
            Arc::new(MemoryDiscovery::new()),
            Arc::new(MemoryEventPlane::new()),
            shutdown,
        )
        .await
        .unwrap();
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_engines_meet_in_one_bootstrap_room_and_run_concurrently() {
    let arrived = Arc::new(Notify::new());
    let fake = || {
        Arc::new(Fake {
            decode_arrived: arrived.clone(),
            ..Fake::default()
        })
    };
    let (pf, df) = (fake(), fake());
    let p_url = serve(pf.clone(), true).await;
    let d_url = serve(df.clone(), false).await;
    let shutdown = Shutdown::new();
    let p_addr = sidecar_on(WorkerRole::Prefill, 1, &p_url, &shutdown).await;
    let d_addr = sidecar_on(WorkerRole::Decode, 2, &d_url, &shutdown).await;

    let prompt: Vec<u32> = (100..140).collect();
    let req = GenerateRequest {
        request_id: 77,
        prompt: prompt.clone(),
        sampling: Some(Sampling {
            max_tokens: 3,
            seed: 1,
            temperature: 0.0,
            stop_token: None,
            ignore_eos: true,
            top_p: None,
            ..Default::default()
        }),
        hash_seed: HashSeed::UNSALTED.0,
        remote_prefill: Some(RemotePrefillTarget {
            worker_id: 1,
            address: p_addr,
        }),
        cache_salt: String::new(),
        lora_adapter: String::new(),
        text: None,
        whole: false,
    };
    let mut client = loop {
        match WorkerClient::connect(format!("http://{d_addr}")).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut stream = loop {
        match client.generate(req.clone()).await {
            Ok(s) => break s.into_inner(),
            // The sidecar serves before it finished starting: retry until it does.
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut tokens = Vec::new();
    let mut outcomes = Vec::new();
    let mut cached = 0;
    while let Some(chunk) = stream.message().await.unwrap() {
        tokens.extend(chunk.tokens);
        outcomes.push(chunk.prefill);
        cached = chunk.cached_tokens;
    }
    assert_eq!(tokens, vec![7, 8, 9], "cumulative output_ids as increments");
    assert_eq!(outcomes[0], PrefillOutcome::Remote as i32);
    assert_eq!(
        cached, 32,
        "the engine's own cached-token count, from its last object"
    );

    tokio::time::timeout(Duration::from_secs(10), async {
        while pf.prefill_answered.lock().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the prefill engine's request never ended");
    assert_eq!(
        *pf.prefill_answered.lock(),
        Some(true),
        "the decode engine's request did not arrive while the prefill engine waited"
    );
    let p = pf.bodies.lock()[0].clone();
    let d = df.bodies.lock()[0].clone();
    assert_eq!(p["input_ids"], json!(prompt));
    assert_eq!(d["input_ids"], json!(prompt));
    assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
    assert!(p["bootstrap_room"].as_u64().is_some());
    for b in [&p, &d] {
        assert_eq!(b["bootstrap_host"], json!("127.0.0.1"));
        assert_eq!(b["bootstrap_port"], json!(8998));
    }
    assert_eq!(d["sampling_params"]["max_new_tokens"], json!(3));
    assert_eq!(d["stream"], json!(true));
    shutdown.stop();
}
