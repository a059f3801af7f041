//! LoRA-aware routing on a real cluster: a frontend serving two LoRA adapters on top of the
//! mocker model, three decode workers whose engines hold one adapter at a time
//! (`--max-loras 1`).
//!
//! - Requests on an adapter gather on one worker, and requests on the other adapter on
//!   another: the router counts the adapter's load where it is not resident, and a worker
//!   whose one slot a running request's adapter takes as full.
//! - The workers report what they hold (`tandem_worker_lora_*` on the frontend's `/metrics`,
//!   from their load reports).
//! - The adapter joins the block-hash seed: a prompt cached on an adapter is a hit again on
//!   that adapter, and none on the base model or the other adapter.
//!
//! Prompts differ between the routing checks, so only the adapter (not a cached prefix)
//! draws a request to a worker. Conditions are polled, never slept on.
//!
//! The second test does the same through vLLM stand-ins behind sidecars, where the
//! adapter's load comes from the engine's `vllm:lora_requests_info` and its cache from the
//! engine's KV events.

use tandem_test_support as common;

use std::time::Duration;

use common::chat::{chat, serial};
use common::cluster::{Cluster, Options, Routed, decode_id};
use common::http;
use common::openai::{ChatCompletion, ModelList};
use common::words;
use serde_json::{Value, json};

const ADAPTERS: [&str; 2] = ["sql-lora", "chat-lora"];

/// A chat request on `model` with a system prompt of its own (`seed`).
fn on(model: &str, seed: u64) -> Value {
    let mut req = chat(&words(seed, 120), "Go on.", 3);
    req["model"] = json!(model);
    req
}

fn slots(worker: u64) -> String {
    format!("tandem_worker_lora_slots{{worker=\"{worker}\",role=\"decode\"}}")
}

fn resident(worker: u64, adapter: &str) -> String {
    format!(
        "tandem_worker_lora_adapter{{worker=\"{worker}\",role=\"decode\",adapter=\"{adapter}\"}}"
    )
}

#[test]
fn requests_gather_on_the_workers_that_hold_their_adapter() {
    let _serial = serial();
    let c = Cluster::start(
        "lora",
        Options {
            decode: 3,
            worker_args: vec!["--max-loras=1".into(), "--adapter-load-ms=5".into()],
            frontend_args: vec![format!("--lora-adapters={}", ADAPTERS.join(","))],
            ..Options::default()
        },
    );
    let workers: Vec<u64> = (0..3).map(decode_id).collect();
    // Each worker's one slot is known before the first request (its load reports).
    c.wait_metrics("every worker's LoRA slots", Duration::from_secs(10), |m| {
        workers.iter().all(|w| m.0.get(&slots(*w)) == Some(&1.0))
    });

    // The adapters are served, under the base model.
    let models: ModelList = http::get(c.addr, "/v1/models").unwrap().json();
    let ids: Vec<&str> = models.data.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["mocker", "sql-lora", "chat-lora"]);

    // A long request on sql-lora holds its worker's one slot while the others run (its
    // `osl` keeps its expected decode load small, so only the slot weighs).
    let mut long = on("sql-lora", 1);
    long["max_tokens"] = json!(20_000);
    long["stream"] = json!(true);
    long["tandem"] = json!({"osl": 16});
    let held = http::post_stream(c.addr, "/v1/chat/completions", &long.to_string()).unwrap();
    assert_eq!(held.status, 200);
    let sql: u64 = held
        .header("x-tandem-decode-worker")
        .and_then(|w| w.parse().ok())
        .expect("x-tandem-decode-worker");

    let mut seed = 1;
    let mut send = |model: &str| -> Routed {
        seed += 1;
        let r = c.chat(&on(model, seed));
        assert_eq!(r.completion.model, model);
        r
    };
    let chat = send("chat-lora").decode;
    assert_ne!(
        sql, chat,
        "chat-lora must not wait for the one slot sql-lora holds"
    );
    for round in 0..3 {
        assert_eq!(send("sql-lora").decode, sql, "sql-lora, round {round}");
        assert_eq!(send("chat-lora").decode, chat, "chat-lora, round {round}");
    }

    // The workers say so in their load reports.
    let m = c.wait_metrics(
        "the adapters in the workers' load reports",
        Duration::from_secs(10),
        |m| {
            m.0.contains_key(&resident(sql, "sql-lora"))
                && m.0.contains_key(&resident(chat, "chat-lora"))
        },
    );
    for w in &workers {
        for a in ADAPTERS {
            let expected = (*w == sql && a == "sql-lora") || (*w == chat && a == "chat-lora");
            assert_eq!(
                m.0.contains_key(&resident(*w, a)),
                expected,
                "worker {w}, {a}: {:?}",
                m.0.iter()
                    .filter(|(k, _)| k.starts_with("tandem_worker_lora"))
                    .collect::<Vec<_>>()
            );
        }
    }

    // One prompt on sql-lora, then again: a hit on its worker.
    let prompt = |model: &str| on(model, 1000);
    let first = c.chat(&prompt("sql-lora"));
    assert_eq!((first.decode, first.cached), (sql, 0));
    let again = c.chat(&prompt("sql-lora"));
    assert_eq!(again.decode, sql);
    assert!(
        again.cached > 0,
        "the adapter's own prefix is cached: {again:?}"
    );
    // The same prompt on the base model and on the other adapter: nothing cached for them,
    // wherever they run (with the adapter out of the seed, the base model's request would
    // be drawn to sql-lora's worker by its overlap and hit there).
    for model in ["mocker", "chat-lora"] {
        let r = c.chat(&prompt(model));
        assert_eq!(r.cached, 0, "{model} must not see sql-lora's blocks: {r:?}");
    }
    drop(held); // cancels the long request
}

/// A successful chat's decode worker, its `x-tandem-cached-tokens` (for a sidecar: its
/// estimate from the engine's relayed KV events) and its body (whose usage has the engine's
/// own count).
fn chat_on(c: &Cluster, body: &Value) -> (u64, u32, ChatCompletion) {
    let r = c.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "chat failed: {}", r.text());
    let num = |h: &str| r.header(h).and_then(|v| v.parse::<u64>().ok());
    (
        num("x-tandem-decode-worker").expect("decode header"),
        num("x-tandem-cached-tokens").expect("cached header") as u32,
        r.json(),
    )
}

/// vLLM stand-ins serving the adapters (`--lora-modules`, `--max-loras 1`) behind sidecars:
/// the adapter reaches the engine as the request's `model`, the sidecars read the engines'
/// `vllm:lora_requests_info`, and the engines' KV events (with `lora_name` and the LoRA
/// name in `extra_keys`) are mirrored under the seed the frontend gives a request on that
/// adapter, so the sidecar's estimate of a hit agrees with the engine's own count.
#[test]
fn vllm_lora_events_and_metrics_line_up_with_requests_on_the_adapter() {
    let _serial = serial();
    let c = Cluster::start(
        "lora-vllm",
        Options {
            decode: 2,
            engine: Some("vllm"),
            speedup: 20.0,
            engine_args: vec![
                format!("--lora-modules={}", ADAPTERS.join(",")),
                "--max-loras=1".into(),
            ],
            frontend_args: vec![format!("--lora-adapters={}", ADAPTERS.join(","))],
            ..Options::default()
        },
    );
    let workers = [decode_id(0), decode_id(1)];
    c.wait_metrics("the engines' LoRA slots", Duration::from_secs(10), |m| {
        workers.iter().all(|w| m.0.get(&slots(*w)) == Some(&1.0))
    });
    let system = words(77, 400);
    let on = |model: &str| {
        let mut r = chat(&system, "First?", 4);
        r["model"] = json!(model);
        r
    };
    let (home, header, first) = chat_on(&c, &on("sql-lora"));
    assert_eq!(first.model, "sql-lora", "the engine ran the adapter");
    assert_eq!(header, 0);
    let prompt = first.usage.prompt_tokens;
    c.wait_metrics("the prompt in the index", Duration::from_secs(20), |m| {
        m.index_entries() >= u64::from(prompt / 16)
    });
    let (decode, header, again) = chat_on(&c, &on("sql-lora"));
    assert_eq!(decode, home, "the adapter's prefix draws it home");
    let engine_cached = again.usage.prompt_tokens_details.cached_tokens;
    assert!(
        engine_cached + 32 >= prompt,
        "the engine cached {engine_cached}"
    );
    assert!(
        header > 0 && header.abs_diff(engine_cached) <= 16,
        "the sidecar's estimate {header} vs the engine's {engine_cached}"
    );
    c.wait_metrics(
        "sql-lora in its engine's metrics",
        Duration::from_secs(10),
        |m| m.0.contains_key(&resident(home, "sql-lora")),
    );
    // The base model and the other adapter share none of it, by either count.
    for model in ["mocker", "chat-lora"] {
        let (_, header, r) = chat_on(&c, &on(model));
        assert_eq!(r.model, model);
        let engine_cached = r.usage.prompt_tokens_details.cached_tokens;
        assert_eq!((header, engine_cached), (0, 0), "{model}");
    }
}
