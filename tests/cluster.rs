//! tandem as real processes on real etcd and nats-server (docs/ARCHITECTURE.md §1, §9, §10): the OpenAI
//! surface, prefix-affine routing, conditional disaggregation, bad requests, a standalone
//! indexer and `tandem up --processes`. Failures are in cluster_faults.rs, KV transfer
//! correctness in cluster_transfer.rs.
//!
//! Each test starts its own etcd, NATS and `tandem` processes (see `common::cluster`), so
//! tests share nothing but the machine; they run one at a time all the same
//! (`common::chat::serial`). Eventual conditions are polled with deadlines; no timing is
//! asserted beyond "ends within a bound" (docs/CONVENTIONS.md §10).

use tandem_test_support as common;

use std::time::{Duration, Instant};

use common::chat::*;
use common::cluster::{Cluster, Options, Proc, decode_id, prefill_id, wait_for};
use common::http::{self, StreamEnd};
use common::openai::{Completion, ErrorResponse, ModelList};
use common::words;
use serde_json::{Value, json};

#[test]
fn chat_stream_and_whole_responses_have_openai_shapes() {
    let _serial = serial();
    let c = Cluster::start("shapes", Options::default());

    let models: ModelList = http::get(c.addr, "/v1/models").unwrap().json();
    assert_eq!(models.object, "list");
    assert_eq!(models.data.len(), 1);
    assert_eq!(
        (models.data[0].id.as_str(), models.data[0].object.as_str()),
        ("mocker", "model")
    );
    assert!(!models.data[0].owned_by.is_empty() && models.data[0].created > 0);

    let mut req = chat(&words(1, 60), "Say something.", 12);
    req["seed"] = json!(5);
    let mut s = http::post_stream(
        c.addr,
        "/v1/chat/completions",
        &streamed(req.clone()).to_string(),
    )
    .unwrap();
    assert_eq!(s.status, 200);
    assert!(
        s.header("content-type")
            .is_some_and(|v| v.starts_with("text/event-stream")),
        "{:?}",
        s.headers
    );
    assert_eq!(s.header("x-tandem-decode-worker"), Some("11"));
    let request_id = s.header("x-request-id").expect("x-request-id").to_string();
    let (events, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "no [DONE]: {end:?}");
    let chunks = chunks(&events);
    assert!(chunks.len() >= 3, "{events:?}");
    for c in &chunks {
        assert_eq!(c.id, request_id);
        assert_eq!(c.object, "chat.completion.chunk");
        assert_eq!(c.model, "mocker");
        assert_eq!(c.created, chunks[0].created);
        assert!(c.choices.iter().all(|ch| ch.index == 0));
    }
    assert_eq!(
        chunks[0].choices[0].delta.role.as_deref(),
        Some("assistant"),
        "the first chunk names the role"
    );
    assert!(
        chunks[1..]
            .iter()
            .flat_map(|c| &c.choices)
            .all(|ch| ch.delta.role.is_none()),
        "only the first chunk names the role"
    );
    // The finish reason comes once, on the last chunk with a choice; the usage after it.
    assert_eq!(finish_reasons(&chunks), ["length"]);
    let with_choices: Vec<_> = chunks.iter().filter(|c| !c.choices.is_empty()).collect();
    assert!(
        with_choices.last().unwrap().choices[0]
            .finish_reason
            .is_some()
    );
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c.usage.is_none()));
    let usage = final_usage(&chunks);
    assert_eq!(usage.completion_tokens, 12);
    assert!(usage.prompt_tokens >= 60, "{usage:?}");
    assert_eq!(usage.total_tokens, usage.prompt_tokens + 12);
    let streamed_text = content(&chunks);
    assert!(!streamed_text.is_empty());

    // The same request whole: the same tokens (same seed), OpenAI's `chat.completion`, and
    // now a prefix-cache hit on the worker that served the stream.
    let r = c.chat(&req);
    let whole = &r.completion;
    assert_eq!(whole.object, "chat.completion");
    assert!(whole.id.starts_with("chatcmpl") && whole.id != request_id);
    assert_eq!(whole.model, "mocker");
    assert!(whole.created > 0);
    assert_eq!(whole.choices.len(), 1);
    let choice = &whole.choices[0];
    assert_eq!(
        (choice.index, choice.message.role.as_str()),
        (0, "assistant")
    );
    assert_eq!(choice.finish_reason, "length");
    assert_eq!(
        r.content(),
        streamed_text,
        "stream and whole response differ"
    );
    assert_eq!(whole.usage.prompt_tokens, usage.prompt_tokens);
    assert_eq!(whole.usage.completion_tokens, 12);
    assert_eq!(whole.usage.total_tokens, usage.prompt_tokens + 12);
    let cached = whole.usage.prompt_tokens_details.cached_tokens;
    assert!(
        cached >= 16 && cached.is_multiple_of(16) && cached <= usage.prompt_tokens,
        "cached {cached} of {}",
        usage.prompt_tokens
    );

    // The legacy completions endpoint, whole and streamed.
    let body = json!({
        "model": "mocker",
        "prompt": words(11, 30),
        "max_tokens": 5,
        "ignore_eos": true,
        "seed": 9,
    });
    let r = c.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let done: Completion = r.json();
    assert_eq!(done.object, "text_completion");
    assert_eq!((done.model.as_str(), done.choices.len()), ("mocker", 1));
    assert_eq!(done.choices[0].index, 0);
    assert!(done.created > 0 && done.id != request_id);
    assert_eq!(done.choices[0].finish_reason.as_deref(), Some("length"));
    assert_eq!(done.usage.expect("usage").completion_tokens, 5);
    let mut s = http::post_stream(c.addr, "/v1/completions", &streamed(body).to_string()).unwrap();
    let (events, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    let parts: Vec<Completion> = events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect();
    let text: String = parts
        .iter()
        .flat_map(|p| &p.choices)
        .map(|c| c.text.as_str())
        .collect();
    assert_eq!(
        text, done.choices[0].text,
        "streamed and whole completions differ"
    );
    assert_eq!(
        parts
            .last()
            .unwrap()
            .usage
            .expect("usage")
            .completion_tokens,
        5
    );
}

#[test]
fn requests_sharing_a_prefix_stay_on_the_worker_that_caches_it() {
    let _serial = serial();
    let c = Cluster::start(
        "affinity",
        Options {
            decode: 2,
            ..Options::default()
        },
    );
    let system = words(2, 1500);

    let first = c.chat(&chat(&system, "First question?", 4));
    let prompt = first.completion.usage.prompt_tokens;
    assert!(prompt >= 1500, "{prompt}");
    assert_eq!(first.cached, 0, "a fresh prompt has nothing cached");
    let home = first.decode;
    assert!([decode_id(0), decode_id(1)].contains(&home));
    c.wait_metrics(
        "the prompt's blocks in the index",
        Duration::from_secs(15),
        |m| m.index_entries() >= blocks(prompt),
    );

    for i in 0..4 {
        let question = format!("Follow-up {i}: {}?", words(100 + i, 6));
        let r = c.chat(&chat(&system, &question, 4));
        assert_eq!(
            r.decode, home,
            "follow-up {i} left the worker caching its prefix"
        );
        assert!(
            r.cached >= 1400,
            "follow-up {i}: only {} cached tokens",
            r.cached
        );
        assert!(r.prefill.is_none(), "no prefill pool, no remote prefill");
    }
}

#[test]
fn long_fresh_prompts_prefill_remotely_and_repeats_locally() {
    let _serial = serial();
    let c = Cluster::start(
        "disagg",
        Options {
            prefill: 2,
            decode: 2,
            ..Options::default()
        },
    );
    let mut req = chat(&words(3, 3000), "Summarize.", 6);
    req["seed"] = json!(77);

    let a = c.chat(&req);
    let prompt = a.completion.usage.prompt_tokens;
    assert!(prompt >= 3000, "{prompt}");
    let p = a
        .prefill
        .expect("a long fresh prompt is prefilled remotely");
    assert!([prefill_id(0), prefill_id(1)].contains(&p), "{p}");
    assert!([decode_id(0), decode_id(1)].contains(&a.decode));
    assert_eq!(a.cached, 0);
    // The prefill worker keeps what it computed and the decode worker what it received.
    c.wait_metrics(
        "both workers' blocks in the index",
        Duration::from_secs(15),
        |m| m.index_entries() >= 2 * blocks(prompt),
    );

    // Again: the decode worker caches all but the last partial block; prefill stays local.
    let b = c.chat(&req);
    assert_eq!(
        b.decode, a.decode,
        "the repeat goes where the prefix is cached"
    );
    assert_eq!(b.prefill, None, "a cached prompt is prefilled locally");
    assert!(
        u64::from(b.cached) >= (blocks(prompt) - 1) * 16,
        "{} cached of {prompt}",
        b.cached
    );
    // Remote-prefilled and locally cached KV continue the same token chain.
    assert_eq!(a.content(), b.content());

    // A short fresh prompt (under 2048 uncached tokens) prefills on its decode worker:
    // moving its KV would cost more than computing it there (Dynamo's rule).
    let short = c.chat(&chat(&words(4, 80), "Hi.", 4));
    assert!(short.prefill.is_none(), "a short prompt prefills locally");
    let m = c.metrics();
    assert_eq!(m.get("tandem_prefills_total{outcome=\"remote\"}"), 1.0);
    assert_eq!(m.get("tandem_prefills_total{outcome=\"local\"}"), 2.0);
}

#[test]
fn bad_requests_get_openai_errors() {
    let _serial = serial();
    let c = Cluster::start(
        "errors",
        Options {
            frontend_args: vec!["--context-length".into(), "512".into()],
            ..Options::default()
        },
    );
    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let check = |what: &str, r: http::Response, status: u16, code: Option<&str>| {
        assert_eq!(r.status, status, "{what}: {}", r.text());
        let e: ErrorResponse = r.json();
        assert!(!e.error.message.is_empty(), "{what}: empty message");
        assert!(!e.error.kind.is_empty(), "{what}: empty type");
        if let Some(code) = code {
            assert_eq!(e.error.code.as_deref(), Some(code), "{what}");
        }
        e
    };
    let raw = |body: &str| http::post_json(c.addr, "/v1/chat/completions", body).unwrap();
    let post = |body: Value| c.post("/v1/chat/completions", &body);

    check(
        "invalid JSON",
        raw(r#"{"messages": [}"#),
        400,
        Some("invalid_json"),
    );
    check(
        "wrong types",
        post(json!({"messages": user("hi"), "max_tokens": "ten"})),
        422,
        None,
    );
    check(
        "unknown model",
        post(json!({"model": "gpt-9", "messages": user("hi")})),
        404,
        Some("model_not_found"),
    );
    check("empty messages", post(json!({"messages": []})), 400, None);
    let e = check(
        "max_tokens 0",
        post(json!({"messages": user("hi"), "max_tokens": 0})),
        400,
        None,
    );
    assert_eq!(e.error.param.as_deref(), Some("max_tokens"));
    check(
        "n = 2",
        post(json!({"messages": user("hi"), "n": 2})),
        400,
        Some("unsupported_parameter"),
    );
    check(
        "temperature 3",
        post(json!({"messages": user("hi"), "temperature": 3})),
        400,
        None,
    );
    check(
        "prompt over the context",
        post(json!({"messages": user(&words(30, 600))})),
        400,
        Some("context_length_exceeded"),
    );
    check(
        "prompt + max_tokens over the context",
        post(json!({"messages": user(&words(31, 300)), "max_tokens": 400})),
        400,
        Some("context_length_exceeded"),
    );
    check(
        "completions without a prompt",
        c.post("/v1/completions", &json!({"max_tokens": 3})),
        400,
        None,
    );
    check(
        "body over 8 MiB",
        http::post_declaring_length(c.addr, "/v1/chat/completions", 9 << 20).unwrap(),
        413,
        Some("request_too_large"),
    );
    check(
        "unknown path",
        http::get(c.addr, "/v1/nothing").unwrap(),
        404,
        None,
    );
    check(
        "wrong method",
        http::get(c.addr, "/v1/chat/completions").unwrap(),
        405,
        None,
    );

    // Nothing broke: the frontend is alive and serves.
    assert_eq!(http::get(c.addr, "/live").unwrap().status, 200);
    assert_eq!(http::get(c.addr, "/health").unwrap().status, 200);
    let r = c.chat(&json!({"messages": user("fine"), "max_tokens": 3}));
    assert!(r.completion.usage.completion_tokens >= 1);
}

/// Pids of every descendant of `pid` (children first), from /proc.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

#[test]
fn tandem_up_processes_serves_and_stops_everything() {
    let _serial = serial();
    let dir = common::temp_dir("up");
    let free = || tandem_runtime::external::free_port().unwrap();
    let (port, admin_port) = (free(), free());
    let admin_listen = format!("--admin-listen=127.0.0.1:{admin_port}");
    let args: Vec<String> = [
        "up",
        "--processes",
        "--engine",
        "mocker",
        "--port",
        &port.to_string(),
        &admin_listen,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--speedup-ratio",
        "10",
        // The frontend process gets the key by its environment, not its command line.
        "--api-keys",
        "sk-up-0123456789=acme",
    ]
    .map(String::from)
    .to_vec();
    let mut up = Proc::spawn("tandem-up", "up", &args, &dir.join("up.log"));
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    wait_for("tandem up to be healthy", Duration::from_secs(60), || {
        assert!(up.is_running(), "tandem up exited:\n{}", up.log());
        http::get(addr, "/health")
            .is_ok_and(|r| r.status == 200)
            .then_some(())
    });
    // Healthy is one decode worker; a request sent before the prefill worker registers is
    // prefilled locally whatever the rule says.
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], admin_port));
    wait_for(
        "the frontend to see the prefill worker",
        Duration::from_secs(60),
        || {
            let m = http::get(admin, "/metrics")
                .ok()
                .filter(|r| r.status == 200)?;
            let m = common::metrics::Metrics::parse(&m.text());
            (m.0.get("tandem_workers{role=\"prefill\"}") == Some(&1.0)).then_some(())
        },
    );
    let key = [("authorization", "Bearer sk-up-0123456789")];
    let unkeyed = http::post_json(addr, "/v1/chat/completions", "{}").unwrap();
    assert_eq!(unkeyed.status, 401, "{}", unkeyed.text());
    let ask = |body: &serde_json::Value| {
        let body = body.to_string();
        let r = http::request(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(body.as_bytes()),
            &key,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        common::cluster::routed(&r)
    };
    // What a new user tries first: a short "Hello" is prefilled on the decode worker.
    let hello = ask(&serde_json::json!({
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3
    }));
    assert_eq!(hello.completion.usage.completion_tokens, 3);
    assert!(hello.prefill.is_none(), "a short prompt prefills locally");
    let routed = ask(&chat(&words(40, 3000), "Hello?", 5));
    assert_eq!(routed.completion.usage.completion_tokens, 5);
    assert!(
        routed.prefill.is_some(),
        "a long fresh prompt goes to the prefill process"
    );

    // etcd, nats-server, the frontend and both workers.
    let children = descendants(up.pid());
    assert!(children.len() >= 5, "children of tandem up: {children:?}");
    up.signal("INT");
    let status = up
        .wait_exit(Duration::from_secs(60))
        .expect("tandem up stops on SIGINT");
    assert!(status.success(), "exit status {status}:\n{}", up.log());
    let left: Vec<u32> = children.into_iter().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// `tandem up` in one process takes the frontend's access flags: with --api-keys the APIs
/// want a key, with --admin-key the admin listener wants that one, and the tenant's name
/// reaches /metrics.
#[test]
fn tandem_up_takes_api_keys_and_an_admin_key() {
    let dir = common::temp_dir("up-keys");
    let args: Vec<String> = [
        "up",
        "--engine=mocker",
        "--port=0",
        "--admin-listen=127.0.0.1:0",
        "--prefill=0",
        "--decode=1",
        "--api-keys=sk-up-tenant-0123=acme",
        "--admin-key=sk-up-admin-0123",
    ]
    .map(String::from)
    .to_vec();
    let mut up = Proc::spawn("tandem-up-keys", "up", &args, &dir.join("up.log"));
    let (addr, admin) = wait_for("tandem up's addresses", Duration::from_secs(60), || {
        assert!(up.is_running(), "tandem up exited:\n{}", up.log());
        common::native::bound_addresses(&up.log())
    });
    let with = |key: &'static str| [("authorization", format!("Bearer {key}"))];
    let send = |at, method, path: &str, body: Option<&str>, key: Option<&'static str>| {
        let headers = key.map(with);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .flatten()
            .map(|(k, v)| (*k, v.as_str()))
            .collect();
        http::request(at, method, path, body.map(str::as_bytes), &headers)
            .unwrap()
            .status
    };
    wait_for("the decode worker", Duration::from_secs(60), || {
        (send(addr, "GET", "/health", None, None) == 200).then_some(())
    });
    let tenant = Some("sk-up-tenant-0123");
    let admin_key = Some("sk-up-admin-0123");
    assert_eq!(send(addr, "GET", "/v1/models", None, None), 401);
    assert_eq!(send(addr, "GET", "/v1/models", None, tenant), 200);
    let body = chat(&words(2, 20), "Hello?", 3).to_string();
    assert_eq!(
        send(addr, "POST", "/v1/chat/completions", Some(&body), tenant),
        200
    );
    assert_eq!(send(admin, "GET", "/metrics", None, None), 401);
    assert_eq!(send(admin, "GET", "/metrics", None, tenant), 401);
    let metrics = http::request(
        admin,
        "GET",
        "/metrics",
        None,
        &[("authorization", "Bearer sk-up-admin-0123")],
    )
    .unwrap();
    assert_eq!(metrics.status, 200);
    assert!(
        metrics.text().contains("tenant=\"acme\""),
        "the tenant's requests in /metrics"
    );
    assert_eq!(send(addr, "GET", "/metrics", None, admin_key), 200);
    up.signal("INT");
    assert!(
        up.wait_exit(Duration::from_secs(30))
            .is_some_and(|s| s.success())
    );
}

/// Frontends may share one standalone index (`tandem indexer`, `--indexer-url`): the index
/// is fed from NATS in its own process, and the frontend routes by its `FindMatches`.
#[test]
fn a_standalone_indexer_serves_the_frontends_routing() {
    use tandem_protocol::grpc::FindMatchesRequest;
    use tandem_protocol::grpc::indexer_client::IndexerClient;
    use tandem_protocol::hashing::compute_block_hashes;
    use tandem_protocol::{BlockSize, HashSeed};

    let _serial = serial();
    let c = Cluster::start(
        "indexer",
        Options {
            decode: 2,
            indexer: true,
            ..Options::default()
        },
    );
    let indexer = c
        .opts
        .frontend_args
        .iter()
        .find_map(|a| a.strip_prefix("--indexer-url="))
        .expect("the indexer's address")
        .to_string();
    // Token ids as the prompt: the test knows the blocks the index must hold.
    let prefix: Vec<u32> = (0..1600u32).map(|i| (i * 7919 + 13) % 30_000).collect();
    let complete = |suffix: u32| {
        let mut prompt = prefix.clone();
        prompt.extend([suffix, suffix + 1, suffix + 2]);
        let r = c.post(
            "/v1/completions",
            &json!({"model": "mocker", "prompt": prompt, "max_tokens": 3, "ignore_eos": true}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let header = |h: &str| r.header(h).map(|v| v.parse::<u64>().unwrap());
        (
            header("x-tandem-decode-worker").unwrap(),
            header("x-tandem-cached-tokens").unwrap(),
        )
    };
    let (home, cached) = complete(1);
    assert_eq!(cached, 0);

    let hashes: Vec<u64> = compute_block_hashes(&prefix, BlockSize::DEFAULT, HashSeed::UNSALTED)
        .iter()
        .map(|h| h.sequence.0)
        .collect();
    c.rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(
                Instant::now() < deadline,
                "the indexer never held the prefix"
            );
            let Ok(ch) =
                tandem_runtime::grpc::connect_channel(&indexer, Duration::from_secs(2)).await
            else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let req = FindMatchesRequest {
                sequence_hashes: hashes.clone(),
            };
            if let Ok(reply) = IndexerClient::new(ch).find_matches(req).await
                && reply
                    .into_inner()
                    .workers
                    .iter()
                    .any(|w| w.worker_id == home && w.device == 100)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    for i in 0..4 {
        let (worker, cached) = complete(100 + 10 * i);
        assert_eq!(
            worker, home,
            "request {i} left the worker caching its prefix"
        );
        assert!(cached >= 1600, "request {i}: {cached} cached tokens");
    }
    assert_eq!(
        c.metrics().index_entries(),
        0,
        "the frontend keeps no index of its own"
    );
}

/// `tandem bench` against a cluster running an A/B experiment: a multi-turn workload's
/// conversations go out with their `x-session-id`, the frontend places each in an arm, and the
/// bench reports the arms side by side; every record names its arm, and each conversation's
/// turns share one.
#[test]
fn bench_reports_an_experiments_arms_side_by_side() {
    let _serial = serial();
    let dir = common::temp_dir("bench-ab");
    let groups = dir.join("groups.toml");
    std::fs::write(
        &groups,
        "[experiment]\nname = \"credit\"\nb_share = 0.5\n[experiment.b]\noverlap_credit = 0.0\n",
    )
    .unwrap();
    let c = Cluster::start(
        "bench-ab",
        Options {
            decode: 2,
            frontend_args: vec![format!("--groups={}", groups.display())],
            ..Options::default()
        },
    );
    let (url, out) = (format!("http://{}", c.addr), c.dir.join("bench.json"));
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench",
            "--url",
            &url,
            "--workload",
            "multi-turn",
            "--turns",
            "3",
            "--requests",
            "36",
            "--rate",
            "30",
            "--think-time-ms",
            "100",
            "--isl",
            "48",
            "--osl",
            "4",
            "--seed",
            "5",
            "--salt",
            "ab",
            "--quiet",
            "--json",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("| credit/a |"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let arms = report["arms"].as_array().unwrap();
    let names: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
    assert_eq!(names, ["credit/a", "credit/b"], "12 sessions, both arms");
    let count = |a: &Value| a["requests"].as_u64().unwrap();
    assert_eq!(count(&arms[0]) + count(&arms[1]), 36);
    // Whole conversations: 3 turns each.
    assert!(
        count(&arms[0]) % 3 == 0 && count(&arms[1]) % 3 == 0,
        "{arms:?}"
    );
    assert!(
        report["records"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["arm"].as_str().is_some_and(|a| a.starts_with("credit/")))
    );
}

/// `tandem bench` against a live cluster: every request of a shared-prefix workload
/// completes, the endpoint's prefix-cache hits show, and the JSON record holds what was
/// measured; a model the endpoint does not serve is refused before any load is sent.
#[test]
fn bench_drives_a_live_cluster_and_records_what_it_measured() {
    let _serial = serial();
    let c = Cluster::start(
        "bench",
        Options {
            decode: 2,
            ..Options::default()
        },
    );
    let url = format!("http://{}", c.addr);
    let out = c.dir.join("bench.json");
    let plots = c.dir.join("plots");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--url",
            &url,
            "--workload",
            "shared-prefix",
            "--requests",
            "24",
            "--rate",
            "20",
            "--isl",
            "64",
            "--osl",
            "8",
            "--prefix-len",
            "512",
            "--prefix-groups",
            "2",
            "--seed",
            "3",
            "--salt",
            "s",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(&args)
            .output()
            .unwrap()
    };
    let run = bench(&[
        "--json",
        out.to_str().unwrap(),
        "--plot-dir",
        plots.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("| completed / failed | 24 / 0 |"),
        "{stdout}"
    );
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(report["completed"], 24);
    assert_eq!(report["failed"], 0);
    assert_eq!(report["completion_tokens"], 24 * 8);
    // ~one token per word: 576 words per prompt, plus the template's few.
    let prompt = report["prompt_tokens"].as_u64().unwrap();
    assert!((24 * 550..24 * 700).contains(&prompt), "{prompt}");
    // Two groups of 12 sharing a 512-token prefix: all but the first of each group (and
    // the first on each worker) hit.
    let hit = report["cache_hit_rate"].as_f64().unwrap();
    assert!(hit > 0.5, "hit rate {hit}");
    let (ttft, e2e) = (&report["ttft_ms"], &report["e2e_ms"]);
    assert_eq!(ttft["count"], 24);
    assert!(ttft["p50"].as_f64().unwrap() > 0.0);
    assert!(ttft["p50"].as_f64().unwrap() <= e2e["p50"].as_f64().unwrap());
    assert_eq!(report["records"].as_array().unwrap().len(), 24);
    assert_eq!(report["salt"], "s-0", "the salt of the first (only) rate");
    assert!(plots.join("ttft_cdf.svg").exists());

    let refused = bench(&["--model", "gpt-nope"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("does not serve model \"gpt-nope\""),
        "{stderr}"
    );
}
