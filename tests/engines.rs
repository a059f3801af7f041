//! tandem in front of external engines, on real processes, etcd and nats-server: each worker
//! is a sidecar (`tandem decode|prefill --engine vllm …`) in front of a `tandem-standin`, an
//! OpenAI-compatible server on tandem's own engine that speaks vLLM's API, publishes vLLM's
//! ZMQ KV events (with vLLM-style block hashes that are not tandem's) and answers vLLM's
//! `kv_transfer_params` handshake by moving the KV between two stand-ins.
//!
//! Covered: a repeated long prompt goes to the engine holding it (headers, the engine's own
//! cached-token count and its prefix-cache metric); P/D through the connector handshake gives
//! the tokens an aggregated run gives, and logprobs come through it; a dropped ZMQ batch is repaired from the replay
//! socket; an engine killed mid-stream takes its worker out of the pool and the index while
//! the stream migrates; plain OpenAI-compatible servers behind `--backend-url`: one without
//! `/health`, one answering text only, one taking prompts only as text (and chats as messages).

use tandem_test_support as common;

use std::time::{Duration, Instant};

use common::chat::*;
use common::cluster::{Cluster, Options, Proc, decode_id, prefill_id};
use common::http::{self, StreamEnd};
use common::openai::{ChatCompletion, Completion};
use common::words;
use serde_json::{Value, json};
use tandem_runtime::external::free_port;

fn external(decode: usize, prefill: usize) -> Options {
    Options {
        decode,
        prefill,
        engine: Some("vllm"),
        speedup: 20.0,
        ..Options::default()
    }
}

/// A successful chat's decode worker, prefill worker, header cached tokens and body.
fn chat_on(c: &Cluster, body: &Value) -> (u64, Option<u64>, u32, ChatCompletion) {
    let r = c.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "chat failed: {}", r.text());
    let num = |h: &str| r.header(h).map(|v| v.parse::<u64>().unwrap());
    (
        num("x-tandem-decode-worker").expect("decode header"),
        num("x-tandem-prefill-worker"),
        num("x-tandem-cached-tokens").expect("cached header") as u32,
        r.json(),
    )
}

#[test]
fn a_repeated_prompt_goes_to_the_engine_that_holds_it() {
    let _serial = serial();
    let mut c = Cluster::start("engines-affinity", external(2, 0));
    let system = words(21, 1500);
    let (home, _, cached, first) = chat_on(&c, &chat(&system, "First question?", 4));
    let prompt = first.usage.prompt_tokens;
    assert!(prompt >= 1500, "{prompt}");
    assert_eq!(cached, 0);
    assert_eq!(first.usage.prompt_tokens_details.cached_tokens, 0);
    // The engine's ZMQ events, recomputed into tandem's hashes by the sidecar and relayed on
    // NATS, put the prompt in the frontend's index.
    c.wait_metrics("the prompt in the index", Duration::from_secs(20), |m| {
        m.index_workers() == 2 && m.index_entries() >= blocks(prompt)
    });
    for i in 0..3 {
        let question = format!("Follow-up {i}: {}?", words(200 + i, 6));
        let (decode, prefill, header, r) = chat_on(&c, &chat(&system, &question, 4));
        assert_eq!(
            decode, home,
            "follow-up {i} left the engine holding its prefix"
        );
        assert!(prefill.is_none());
        // The engine's own count, from its usage.
        let engine_cached = r.usage.prompt_tokens_details.cached_tokens;
        assert!(
            engine_cached >= 1400,
            "follow-up {i}: the engine cached {engine_cached}"
        );
        // The first chunk's estimate, from the relayed events, is within a block of it.
        assert!(
            header.abs_diff(engine_cached) <= 16,
            "header {header} vs engine {engine_cached}"
        );
    }
    // The engine's own prefix-cache metric agrees: the hits happened on the home engine.
    let hits = c
        .engine(home)
        .metrics()
        .get("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"mocker\"}");
    assert!(hits >= 3.0 * 1400.0, "home engine hits {hits}");
    let other = if home == decode_id(0) {
        decode_id(1)
    } else {
        decode_id(0)
    };
    let other_hits = c
        .engine(other)
        .metrics()
        .get("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"mocker\"}");
    assert!(
        other_hits < 1400.0,
        "the other engine served the prefix: {other_hits}"
    );
}

#[test]
fn prefill_and_decode_through_the_connector_handshake_match_an_aggregated_run() {
    let _serial = serial();
    let mut c = Cluster::start(
        "engines-pd",
        Options {
            disagg: "always",
            ..external(1, 1)
        },
    );
    // Token ids in, so the test knows exactly what the engines prefill.
    let prompt: Vec<u32> = (0..2000u32).map(|i| (i * 7919 + 13) % 30000).collect();
    let body = json!({
        "prompt": prompt, "max_tokens": 24, "seed": 5, "temperature": 0,
    });
    let r = c.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-tandem-prefill-worker"),
        Some(prefill_id(0).to_string().as_str()),
        "the prompt was not prefilled remotely"
    );
    assert_eq!(
        r.header("x-tandem-decode-worker"),
        Some(decode_id(0).to_string().as_str())
    );
    let remote: Completion = r.json();
    // The decode engine pulled the prefill engine's KV over the connector's side channel.
    let m = c.engine(decode_id(0)).metrics();
    assert_eq!(m.get("standin:kv_pulls_total"), 1.0);
    assert_eq!(m.get("standin:kv_pull_failures_total"), 0.0);
    // The same request run whole (aggregated) on the prefill engine gives the same tokens:
    // the mocker's tokens follow the KV bytes, so a corrupted or missing transfer would show.
    let engine = c.engine(prefill_id(0)).addr;
    let direct = json!({
        "model": "mocker", "prompt": prompt, "max_tokens": 24, "seed": 5, "temperature": 0,
        "return_token_ids": true,
    });
    let r = http::post_json(engine, "/v1/completions", &direct.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json();
    let ids: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(ids.len(), 24);
    let tokenizer = tandem_frontend::http::Tokenizer::load(&Default::default()).unwrap();
    assert_eq!(remote.choices[0].text, tokenizer.decode(&ids));
    assert_eq!(
        c.metrics().get("tandem_prefills_total{outcome=\"remote\"}"),
        1.0
    );

    // Logprobs through the sidecar: asked of the engine in vLLM's terms (`logprobs` with
    // `return_tokens_as_token_ids`), read back as ids, rendered by the frontend in OpenAI's
    // completions shape. The mocker's tokens are certain.
    let asked = json!({
        "prompt": prompt, "max_tokens": 6, "seed": 5, "temperature": 0, "logprobs": 2,
    });
    let r = c.post("/v1/completions", &asked);
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone()).unwrap();
    assert_eq!(tokens.len(), 6, "{lp}");
    assert_eq!(lp["token_logprobs"], json!(vec![0.0f32; 6]));
    let tops = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), 6);
    for (t, top) in tokens.iter().zip(tops) {
        assert_eq!(top, &json!({ t.as_str(): 0.0 }), "{lp}");
    }
    let pulls = c
        .engine(decode_id(0))
        .metrics()
        .get("standin:kv_pulls_total");

    // The prefill engine dies; until its sidecar leaves the pool the frontend still picks
    // it, the handshake fails, and the decode engine prefills the prompt itself.
    c.engine(prefill_id(0)).proc.kill9();
    let other: Vec<u32> = (0..2000u32).map(|i| (i * 104_729 + 7) % 30000).collect();
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": other, "max_tokens": 8, "seed": 5, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let m = c.metrics();
    let fallback =
        m.0.get("tandem_prefills_total{outcome=\"fallback\"}")
            .copied();
    let local = m.0.get("tandem_prefills_total{outcome=\"local\"}").copied();
    assert!(
        fallback == Some(1.0) || local == Some(1.0),
        "neither a fallback nor a local prefill: {:?}",
        m.cluster_view()
    );
    assert_eq!(
        c.engine(decode_id(0))
            .metrics()
            .get("standin:kv_pulls_total"),
        pulls,
        "no new pull: the decode engine prefilled the second prompt itself"
    );
}

#[test]
fn a_dropped_event_batch_is_repaired_from_the_replay_socket() {
    let _serial = serial();
    let mut c = Cluster::start("engines-replay", external(1, 0));
    // The sidecar follows the engine's stream...
    let warm = words(26, 300);
    let (_, _, _, w) = chat_on(&c, &chat(&warm, "Zero.", 1));
    c.wait_metrics(
        "the warm-up prompt in the index",
        Duration::from_secs(20),
        |m| m.index_entries() >= blocks(w.usage.prompt_tokens),
    );
    // ...then the batch announcing the next prompt's blocks never reaches its SUB socket;
    // the batch after it shows the gap, and the replay socket fills it.
    c.engine(decode_id(0)).drop_next_event();
    let a = words(23, 800);
    let (_, _, _, first) = chat_on(&c, &chat(&a, "One.", 1));
    let b = words(24, 800);
    let (_, _, _, second) = chat_on(&c, &chat(&b, "Two.", 1));
    let want = blocks(w.usage.prompt_tokens)
        + blocks(first.usage.prompt_tokens)
        + blocks(second.usage.prompt_tokens);
    c.wait_metrics("both prompts in the index", Duration::from_secs(20), |m| {
        m.index_entries() >= want
    });
    let log = c.worker(decode_id(0)).log();
    assert!(
        log.contains("KV event gap repaired from the replay socket"),
        "the sidecar's log does not show a replay:\n{log}"
    );
}

#[test]
fn an_engine_killed_mid_stream_leaves_the_pool_and_its_stream_migrates() {
    let _serial = serial();
    let mut c = Cluster::start(
        "engines-kill",
        Options {
            speedup: 1.0,
            ..external(2, 0)
        },
    );
    let system = words(25, 1200);
    let (home, _, _, first) = chat_on(&c, &chat(&system, "Warm up.", 2));
    let prompt = first.usage.prompt_tokens;
    c.wait_metrics("the prompt in the index", Duration::from_secs(20), |m| {
        m.index_workers() == 2 && m.index_entries() >= blocks(prompt)
    });
    let mut story = chat(&system, "Tell a story.", 300);
    story["seed"] = json!(7);
    let mut s = open_stream(&c, &streamed(story.clone()));
    assert_eq!(
        s.header("x-tandem-decode-worker"),
        Some(home.to_string().as_str())
    );
    let mut events = read_events(&mut s, 5);
    // The engine dies; its sidecar lives on.
    c.engine(home).proc.kill9();
    let killed = Instant::now();
    let (rest, end) = s.collect();
    assert!(killed.elapsed() < http::READ_TIMEOUT, "the stream hung");
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let migrated = chunks(&events);
    assert_eq!(finish_reasons(&migrated), ["length"]);
    assert_eq!(final_usage(&migrated).completion_tokens, 300);
    assert!(c.frontend().log().contains("migrating the request"));
    // After three failed health checks the sidecar leaves discovery: the frontend drops the
    // worker and the index its blocks.
    c.wait_metrics(
        "the dead engine's worker purged",
        Duration::from_secs(20),
        |m| m.decode_workers() == 1 && m.index_workers() == 1,
    );
    let log = c.worker(home).log();
    assert!(log.contains("engine down: leaving discovery"), "{log}");
    // The survivor serves on.
    let (decode, _, _, _) = chat_on(&c, &chat(&system, "Still there?", 2));
    assert_ne!(decode, home);
}

/// Two stand-ins and a `tandem frontend --backend-url …` in front of them: no etcd, NATS or
/// workers, no KV events either.
struct Direct {
    frontend: Proc,
    addr: std::net::SocketAddr,
    /// The frontend's admin listener (`/metrics`).
    admin: std::net::SocketAddr,
    engines: Vec<(std::net::SocketAddr, Proc)>,
    /// The logs' directory: removed once the processes above are stopped (fields drop in
    /// order).
    _dir: common::TestDir,
}

fn direct(name: &str, n: usize) -> Direct {
    direct_with(name, n, &[], &[])
}

/// `direct` with more stand-in and frontend flags.
fn direct_with(name: &str, n: usize, engine_flags: &[&str], frontend_flags: &[&str]) -> Direct {
    let d = spawn_direct(name, n, engine_flags, frontend_flags);
    d.wait_backends(n);
    d
}

/// [`direct_with`] without waiting for the servers to join the pool.
fn spawn_direct(name: &str, n: usize, engine_flags: &[&str], frontend_flags: &[&str]) -> Direct {
    let dir = common::temp_dir(&format!("direct-{name}"));
    let mut engines = Vec::new();
    for i in 0..n {
        let port = free_port().unwrap();
        let args: Vec<String> = vec![
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--speedup-ratio".into(),
            "20".into(),
        ];
        let args: Vec<String> = args
            .into_iter()
            .chain(engine_flags.iter().map(|f| f.to_string()))
            .collect();
        let log = dir.join(format!("engine-{i}.log"));
        let p = Proc::spawn_bin(
            env!("CARGO_BIN_EXE_tandem-standin"),
            "engine",
            "engine",
            &args,
            &log,
        );
        engines.push((std::net::SocketAddr::from(([127, 0, 0, 1], port)), p));
    }
    let (port, admin_port) = (free_port().unwrap(), free_port().unwrap());
    let mut args = vec![
        "frontend".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        format!("--admin-listen=127.0.0.1:{admin_port}"),
        "--backend-health-interval-ms=100".into(),
    ];
    for (addr, _) in &engines {
        args.push(format!("--backend-url=http://{addr}"));
    }
    args.extend(frontend_flags.iter().map(|f| f.to_string()));
    let log = dir.join("frontend.log");
    let frontend = Proc::spawn("frontend", "frontend", &args, &log);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    Direct {
        frontend,
        addr,
        admin: std::net::SocketAddr::from(([127, 0, 0, 1], admin_port)),
        engines,
        _dir: dir,
    }
}

impl Direct {
    fn metrics(&self) -> common::cluster::Metrics {
        let r = http::get(self.admin, "/metrics").expect("/metrics");
        common::cluster::Metrics::parse(&r.text())
    }

    fn wait_backends(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = http::get(self.admin, "/metrics")
                .ok()
                .filter(|r| r.status == 200)
                .map(|r| common::cluster::Metrics::parse(&r.text()))
                .is_some_and(|m| m.decode_workers() == n as u64);
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} backends not in the pool; frontend log:\n{}",
                self.frontend.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn chat(&self, body: &Value) -> (u64, u32, ChatCompletion) {
        let r = http::post_json(self.addr, "/v1/chat/completions", &body.to_string()).unwrap();
        assert_eq!(r.status, 200, "{}\n{}", r.text(), self.frontend.log());
        let num = |h: &str| r.header(h).map(|v| v.parse::<u64>().unwrap());
        let c: ChatCompletion = r.json();
        let cached = c.usage.prompt_tokens_details.cached_tokens;
        (num("x-tandem-decode-worker").unwrap(), cached, c)
    }
}

#[test]
fn backend_urls_are_routed_on_approximate_kv_and_a_dead_one_leaves_the_pool() {
    let _serial = serial();
    let mut d = direct("approx", 2);
    let system = words(27, 1500);
    let (home, cached, first) = d.chat(&chat(&system, "First?", 4));
    assert_eq!(cached, 0);
    assert!(first.usage.prompt_tokens >= 1500);
    // No events: the router remembers where it sent the prompt and sends its follow-ups
    // there, where the engine's own prefix cache serves them.
    for i in 0..3 {
        let (decode, cached, _) = d.chat(&chat(
            &system,
            &format!("Again {i}: {}?", words(300 + i, 5)),
            4,
        ));
        assert_eq!(
            decode, home,
            "follow-up {i} left the backend that has its prefix"
        );
        assert!(cached >= 1400, "follow-up {i}: the engine cached {cached}");
    }
    // A backend that dies leaves the pool after its failed health checks; the other serves.
    let home_engine = (home - 1) as usize;
    d.engines[home_engine].1.kill9();
    d.wait_backends(1);
    let (decode, _, _) = d.chat(&chat(&system, "After the loss?", 4));
    assert_ne!(decode, home);
    assert_eq!(d.metrics().decode_workers(), 1);
}

#[test]
fn a_client_that_goes_away_aborts_the_request_on_the_engine() {
    let _serial = serial();
    let mut c = Cluster::start(
        "engines-abort",
        Options {
            speedup: 1.0,
            ..external(1, 0)
        },
    );
    let running = "vllm:num_requests_running{engine=\"0\",model_name=\"mocker\"}";
    let mut s = open_stream(&c, &streamed(chat(&words(28, 200), "A long story.", 2000)));
    read_events(&mut s, 3);
    assert_eq!(c.engine(decode_id(0)).metrics().get(running), 1.0);
    // The client hangs up: the frontend drops the worker's stream, the sidecar drops the
    // engine's HTTP response, and the engine aborts the request (its connection closed).
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.engine(decode_id(0)).metrics().get(running) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the engine still runs the abandoned request"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let m = c.engine(decode_id(0)).metrics();
    assert_eq!(
        m.get("vllm:request_success_total{engine=\"0\",model_name=\"mocker\"}"),
        0.0
    );
}

/// A server with no `/health` (llama.cpp's Python server, Ollama, LM Studio answer 404 there)
/// is watched through `GET /v1/models`: it is served, and it leaves the pool and comes back
/// as that answers 503 and then 200 again.
#[test]
fn a_server_without_health_is_watched_through_its_model_list() {
    let _serial = serial();
    let d = direct_with(
        "no-health",
        1,
        &["--no-health", "--text-only"],
        &["--backend-engine=openai"],
    );
    let body = json!({"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 3});
    let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        d.frontend.log().contains("liveness is GET /v1/models"),
        "{}",
        d.frontend.log()
    );
    let engine = d.engines[0].0;
    let set = |state: &str| {
        let r = http::request(
            engine,
            "POST",
            &format!("/standin/health/{state}"),
            None,
            &[],
        )
        .unwrap();
        assert_eq!(r.status, 200);
    };
    set("fail");
    let pool_is = |n: u64, what: &str| {
        common::cluster::wait_for(what, Duration::from_secs(30), || {
            (d.metrics().decode_workers() == n).then_some(())
        })
    };
    pool_is(0, "the server out of the pool");
    set("ok");
    pool_is(1, "the server back in the pool");
    let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A server that takes prompts as text only (llama.cpp's Python server answers token ids with
/// a 500) and has neither `/health` nor `/v1/models`: its sidecar watches it with a one-token
/// completion, finds at start that it refuses ids, and from then on sends it the client's
/// prompt text, and a chat's messages for its own template; the usage is the server's own
/// count of what it read. A prompt of token ids cannot reach it and is refused clearly.
#[test]
fn a_server_that_takes_only_text_gets_the_clients_prompt_and_messages() {
    let _serial = serial();
    let d = direct_with(
        "text-prompts",
        1,
        &[
            "--no-health",
            "--no-models",
            "--text-prompts",
            "--interrupting",
        ],
        &["--backend-engine=openai"],
    );
    let log = d.frontend.log();
    assert!(
        log.contains("liveness is POST /v1/completions (one token)"),
        "{log}"
    );
    assert!(log.contains("refuses token-id prompts"), "{log}");

    // A completion: the server reads the text with its own tokenizer (a token a byte).
    let prompt = "Say hello to the stand-in.";
    let body = json!({"prompt": prompt, "max_tokens": 4, "seed": 1});
    let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let c: Completion = r.json();
    assert_eq!(
        c.choices[0].text.split_whitespace().count(),
        4,
        "{:?}",
        c.choices[0].text
    );
    let usage = c.usage.expect("usage");
    assert_eq!(usage.prompt_tokens as usize, prompt.len());
    assert_eq!(usage.completion_tokens, 4);

    // A chat: its messages, rendered by the server's template, not tandem's.
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name three colors."}]},
    ]);
    let rendered = "<|system|>\nBe brief.\n<|user|>\nName three colors.\n<|assistant|>\n";
    let r = http::post_json(
        d.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 5, "seed": 2}).to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let chat: ChatCompletion = r.json();
    let answer = chat.choices[0].message.content.clone().unwrap_or_default();
    let words: Vec<&str> = answer.split_whitespace().collect();
    assert_eq!(words.len(), 5, "{answer:?}");
    assert!(words.iter().all(|w| w.starts_with('t')), "{words:?}");
    assert_eq!(chat.usage.prompt_tokens as usize, rendered.len());

    // Streamed, the same answer for the same seed, and the same usage.
    let mut s = http::post_stream(
        d.addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 5, "seed": 2, "stream": true,
                "stream_options": {"include_usage": true}})
        .to_string(),
    )
    .unwrap();
    let (events, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    let chunks: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed.split_whitespace().collect::<Vec<_>>(), words);
    let usage = chunks
        .iter()
        .rev()
        .find_map(|v| v["usage"]["prompt_tokens"].as_u64());
    assert_eq!(usage, Some(rendered.len() as u64));

    // Like llama.cpp's Python server, this one ends the stream it serves when another request
    // arrives: the sidecar's liveness probe (a completion every 100 ms) waits while one runs.
    let started = Instant::now();
    let body = json!({"prompt": "Count slowly.", "max_tokens": 2000, "seed": 4});
    let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let c: Completion = r.json();
    assert_eq!(c.choices[0].text.split_whitespace().count(), 2000);
    assert_eq!(c.choices[0].finish_reason.as_deref(), Some("length"));
    let took = started.elapsed();
    assert!(
        took > Duration::from_millis(300),
        "not long enough to meet a probe: {took:?}"
    );

    // Token ids have no text to send: refused with why, and the server never sees them.
    let body = json!({"prompt": [5, 6, 7, 8], "max_tokens": 2});
    let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("takes prompts as text"), "{}", r.text());
}

/// The cache health names why a worker's cache does not hit. A server behind `--backend-url`
/// without events is routed approximately (said from its first request); while its cache
/// holds what the router remembers sending it, nothing else is found; once two prompts that
/// do not fit together take turns, the engine serves a fraction of what the router predicts,
/// and the status page, `/metrics` and (once) the log say so.
#[test]
fn a_cache_that_serves_less_than_the_router_predicts_is_named() {
    let _serial = serial();
    // 40 blocks of 16 tokens: one 560-token prompt (35 blocks) fits, two do not.
    let d = direct_with("cache-health", 1, &["--device-blocks", "40"], &[]);
    let prompt = |first: u32| -> Vec<u32> { (first..first + 560).collect() };
    let complete = |p: &Vec<u32>| {
        let body = json!({"prompt": p, "max_tokens": 2});
        let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    };
    let findings = || -> Vec<(String, String)> {
        let s: Value = http::get(d.admin, "/status.json").unwrap().json();
        s["backend"]["cache_health"]
            .as_array()
            .expect("cache_health in status.json")
            .iter()
            .map(|f| {
                (
                    f["cause"].as_str().unwrap().to_string(),
                    f["detail"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let (a, b) = (prompt(1000), prompt(5000));
    for _ in 0..3 {
        complete(&a);
    }
    let causes: Vec<String> = findings().into_iter().map(|f| f.0).collect();
    assert_eq!(causes, ["no_events"]);
    for _ in 0..10 {
        complete(&b);
        complete(&a);
    }
    let found = findings();
    let below = found
        .iter()
        .find(|f| f.0 == "hits_below_prediction")
        .unwrap_or_else(|| panic!("{found:?}"));
    assert!(below.1.contains("the index predicted"), "{}", below.1);
    let metrics = http::get(d.admin, "/metrics").unwrap().text();
    for cause in ["no_events", "hits_below_prediction"] {
        let series = format!("cause=\"{cause}\"}} 1");
        assert!(metrics.contains(&series), "{series} not in:\n{metrics}");
    }
    assert!(metrics.contains("tandem_cache_served_tokens{"), "{metrics}");
    let log = d.frontend.log();
    assert_eq!(log.matches("cache health: served").count(), 1, "{log}");
}

/// A server whose tokenizer adds a token the frontend's does not (a BOS, as llama.cpp's and
/// many Hugging Face tokenizers do) publishes events for blocks the frontend never hashes, and
/// counts every prompt one token longer: the index never predicts the hits its engine serves,
/// and the cache health names both causes on that worker, on the status page and in
/// `/metrics`.
#[test]
fn a_server_that_adds_a_bos_token_is_named_for_unpredicted_hits_and_prompt_lengths() {
    let _serial = serial();
    let opts = Options {
        engine_args: vec!["--add-bos".into(), "1".into()],
        ..external(1, 0)
    };
    let c = Cluster::start("engines-bos", opts);
    let system = words(31, 600);
    for i in 0..12 {
        let (_, _, _, r) = chat_on(&c, &chat(&system, &format!("Question {i}?"), 2));
        if i > 0 {
            // The engine serves the shared system prompt from its cache (the index, whose
            // events hold BOS-shifted blocks, predicts none of it: the finding's detail).
            assert!(r.usage.prompt_tokens_details.cached_tokens >= 512, "{i}");
        }
    }
    let admin = c.admin_of(0);
    let found = common::cluster::wait_for(
        "both causes in the cache health",
        Duration::from_secs(20),
        || {
            let s: Value = http::get(admin, "/status.json").ok()?.json();
            let causes: Vec<(String, String)> = s["backend"]["cache_health"]
                .as_array()?
                .iter()
                .map(|f| {
                    (
                        f["cause"].as_str().unwrap_or_default().to_string(),
                        f["detail"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect();
            let has = |c: &str| causes.iter().any(|f| f.0 == c);
            (has("unpredicted_hits") && has("prompt_mismatch")).then_some(causes)
        },
    );
    let detail = |c: &str| &found.iter().find(|f| f.0 == c).unwrap().1;
    assert!(
        detail("unpredicted_hits").contains("the index predicted 0"),
        "{found:?}"
    );
    assert!(
        detail("prompt_mismatch").contains("at another length"),
        "{found:?}"
    );
    let metrics = http::get(admin, "/metrics").unwrap().text();
    for cause in ["unpredicted_hits", "prompt_mismatch"] {
        let series = format!("cause=\"{cause}\"}} 1");
        assert!(metrics.contains(&series), "{series} not in:\n{metrics}");
    }
}

/// A server whose KV blocks are of another size than the frontend's is refused (its cache
/// could never match the frontend's block hashes), and the cache health says so by name.
#[test]
fn a_server_with_another_block_size_is_refused_and_named() {
    let _serial = serial();
    let d = spawn_direct("block-size", 1, &["--block-size", "32"], &[]);
    let finding = common::cluster::wait_for(
        "the refusal in the cache health",
        Duration::from_secs(30),
        || {
            let s: Value = http::get(d.admin, "/status.json").ok()?.json();
            s["backend"]["cache_health"]
                .as_array()?
                .iter()
                .find(|f| f["cause"] == "block_size_mismatch")
                .cloned()
        },
    );
    let detail = finding["detail"].as_str().unwrap();
    assert!(
        detail.contains("blocks of 32 tokens") && detail.contains("blocks of 16"),
        "{detail}"
    );
    assert_eq!(d.metrics().decode_workers(), 0);
    let metrics = http::get(d.admin, "/metrics").unwrap().text();
    assert!(
        metrics.contains("cause=\"block_size_mismatch\"} 1"),
        "{metrics}"
    );
    let r = http::post_json(
        d.addr,
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 1}).to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
}

#[test]
fn a_plain_openai_server_that_answers_text_only_is_served_through_backend_url() {
    let _serial = serial();
    let d = direct_with("text", 1, &["--text-only"], &["--backend-engine=openai"]);
    let body = json!({"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 5, "seed": 3});
    let r = http::post_json(d.addr, "/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let c: Completion = r.json();
    // The server's own text, word for word, and its own token count.
    let words: Vec<&str> = c.choices[0].text.split_whitespace().collect();
    assert_eq!(words.len(), 5, "{:?}", c.choices[0].text);
    assert!(words.iter().all(|w| w.starts_with('t')), "{words:?}");
    assert_eq!(c.usage.as_ref().unwrap().completion_tokens, 5);
    // Streamed as well, with a stop string applied to the server's text.
    let mut s = http::post_stream(
        d.addr,
        "/v1/completions",
        &json!({"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 5, "seed": 3,
                "stream": true, "stop": [format!(" {} ", words[2])]})
        .to_string(),
    )
    .unwrap();
    let (events, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    let text: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text.split_whitespace().collect::<Vec<_>>(), words[..2]);
    // Embeddings are the server's own endpoint: not proxied, refused with the reason.
    let r = http::post_json(
        d.addr,
        "/v1/embeddings",
        &json!({"input": "hi"}).to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("/v1/embeddings"), "{}", r.text());
}

#[test]
fn a_client_that_takes_the_answer_whole_gets_it_asked_of_the_server_whole() {
    let _serial = serial();
    let d = direct("whole", 1);
    let engine = d.engines[0].0;
    let asked = || {
        let m = common::cluster::Metrics::parse(&http::get(engine, "/metrics").unwrap().text());
        (
            m.get("standin:whole_requests_total"),
            m.get("standin:streamed_requests_total"),
        )
    };
    let mut body = chat(&words(5, 40), "Whole?", 8);
    body["seed"] = json!(11);
    let before = asked();
    let (_, _, whole) = d.chat(&body);
    assert_eq!(asked(), (before.0 + 1.0, before.1), "asked whole");
    assert_eq!(whole.usage.completion_tokens, 8);

    // Streamed, the same request is streamed from the server, with the same answer.
    let mut s = http::post_stream(
        d.addr,
        "/v1/chat/completions",
        &streamed(body.clone()).to_string(),
    )
    .unwrap();
    let (events, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    assert_eq!(asked(), (before.0 + 1.0, before.1 + 1.0), "asked streamed");
    let text: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        Some(text.as_str()),
        whole.choices[0].message.content.as_deref()
    );

    // Stop strings are cut here, as the tokens come: a client that takes the answer whole
    // still has it streamed from the server.
    body["stop"] = json!(["never appears"]);
    d.chat(&body);
    assert_eq!(
        asked(),
        (before.0 + 1.0, before.1 + 2.0),
        "stop strings stream"
    );
}
