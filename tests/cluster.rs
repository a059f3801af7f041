//! tandem as real processes on real etcd and nats-server (DESIGN.md §1, §4, §8, §10): the
//! OpenAI surface, prefix-affine routing, conditional disaggregation and exact KV transfer,
//! and the failures an operator meets — a worker killed, a worker drained, NATS restarted,
//! etcd wiped, bad requests — plus `tandem up --processes`.
//!
//! Each test starts its own etcd, NATS and `tandem` processes (see `common::cluster`), so
//! tests share nothing but the machine. They run one at a time all the same: on a two-core
//! CI machine, clusters side by side would compete for the CPU that lease keep-alives and
//! real-time engine steps need. Eventual conditions are polled with deadlines; no timing is
//! asserted beyond "ends within a bound" (CONVENTIONS 10).

mod common;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::cluster::{Cluster, Options, Proc, decode_id, prefill_id, wait_for, words};
use common::http::{self, Event, StreamEnd};
use common::openai::{ChatCompletionChunk, Completion, ErrorResponse, ModelList, Usage};
use serde_json::{Value, json};

/// One cluster at a time (see the module docs).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A chat request: a long system prompt (the shared prefix) and a short question.
fn chat(system: &str, question: &str, max_tokens: u32) -> Value {
    json!({
        "model": "mocker",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
    })
}

/// The same request, streamed with usage.
fn streamed(mut body: Value) -> Value {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body
}

/// Parses every event of a chat stream as a chunk.
fn chunks(events: &[String]) -> Vec<ChatCompletionChunk> {
    events
        .iter()
        .map(|e| {
            serde_json::from_str(e)
                .unwrap_or_else(|err| panic!("not a ChatCompletionChunk ({err}): {e}"))
        })
        .collect()
}

fn finish_reasons(chunks: &[ChatCompletionChunk]) -> Vec<&str> {
    chunks
        .iter()
        .flat_map(|c| &c.choices)
        .filter_map(|c| c.finish_reason.as_deref())
        .collect()
}

/// The usage of the final (choice-less) chunk of an `include_usage` stream.
fn final_usage(chunks: &[ChatCompletionChunk]) -> Usage {
    let last = chunks.last().expect("a chunk");
    assert!(last.choices.is_empty(), "the usage chunk has no choices");
    last.usage.expect("the last chunk carries the usage")
}

fn content(chunks: &[ChatCompletionChunk]) -> String {
    chunks
        .iter()
        .flat_map(|c| &c.choices)
        .filter_map(|c| c.delta.content.as_deref())
        .collect()
}

/// Opens a chat stream that must start (200).
fn open_stream(c: &Cluster, body: &Value) -> http::EventStream {
    let s = http::post_stream(c.addr, "/v1/chat/completions", &body.to_string()).unwrap();
    assert_eq!(s.status, 200);
    s
}

/// Reads `n` chunk events, which must arrive before the stream ends.
fn read_events(s: &mut http::EventStream, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| match s.next_event().unwrap() {
            Event::Data(d) => d,
            e => panic!("the stream ended early: {e:?}"),
        })
        .collect()
}

/// Full 16-token blocks of a prompt.
fn blocks(prompt_tokens: u32) -> u64 {
    u64::from(prompt_tokens / 16)
}

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
        cached >= 16 && cached % 16 == 0 && cached <= usage.prompt_tokens,
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

    // A short fresh prompt has nothing cached anywhere either: remote too.
    let short = c.chat(&chat(&words(4, 80), "Hi.", 4));
    assert!(short.prefill.is_some(), "uncached fraction 1.0 goes remote");
    let m = c.metrics();
    assert_eq!(m.get("tandem_prefills_total{outcome=\"remote\"}"), 2.0);
    assert_eq!(m.get("tandem_prefills_total{outcome=\"local\"}"), 1.0);
}

/// The mocker's tokens depend on a digest of every KV byte: a disaggregated cluster (every
/// prompt prefilled remotely, its KV moved by `transport`) must produce exactly the tokens
/// of an aggregated one. With `corrupt`, the prefill workers flip a byte of every transfer:
/// the decode worker's digest check must catch it and prefill locally, with the same tokens.
fn disaggregated_equals_aggregated(transport: &'static str, corrupt: bool) {
    let _serial = serial();
    let mut req = chat(&words(5, 2500), "Continue.", 48);
    req["seed"] = json!(1234);
    let mut texts = Vec::new();
    for mode in ["always", "never"] {
        let c = Cluster::start(
            &format!("mode-{mode}-{transport}-{corrupt}"),
            Options {
                prefill: 1,
                decode: 1,
                disagg: mode,
                kv_transport: transport,
                corrupt_transfers: corrupt,
                ..Options::default()
            },
        );
        let r = c.chat(&req);
        assert_eq!(r.completion.usage.completion_tokens, 48);
        if mode == "always" {
            assert_eq!(r.prefill, Some(prefill_id(0)));
            let outcome = |o: &str| {
                c.metrics()
                    .0
                    .get(&format!("tandem_prefills_total{{outcome=\"{o}\"}}"))
                    .copied()
                    .unwrap_or(0.0)
            };
            let log = c.workers.iter().find(|w| w.role == "decode").unwrap().log();
            if corrupt {
                assert_eq!(outcome("fallback"), 1.0, "the corruption went unnoticed");
                assert!(log.contains("digest mismatch"), "{log}");
            } else {
                assert_eq!(outcome("remote"), 1.0);
                assert!(
                    !log.contains("remote prefill failed"),
                    "the decode worker fell back:\n{log}"
                );
                // The KV really came from the prefill worker: it holds the prompt's blocks.
                let prompt = r.completion.usage.prompt_tokens;
                c.wait_metrics(
                    "both workers' blocks in the index",
                    Duration::from_secs(15),
                    |m| m.index_entries() >= 2 * blocks(prompt),
                );
            }
        } else {
            assert_eq!(r.prefill, None);
            // The tokens depend on the seed: equal texts below are not a coincidence.
            let mut other = req.clone();
            other["seed"] = json!(1235);
            assert_ne!(c.chat(&other).content(), r.content());
        }
        texts.push(r.content().to_string());
    }
    assert_eq!(
        texts[0], texts[1],
        "{transport}: the disaggregated output differs from the aggregated one"
    );
}

#[test]
fn disaggregated_output_equals_aggregated_over_ucx() {
    disaggregated_equals_aggregated("ucx", false);
}

#[test]
fn disaggregated_output_equals_aggregated_over_tcp() {
    disaggregated_equals_aggregated("tcp", false);
}

#[test]
fn disaggregated_output_equals_aggregated_inline() {
    disaggregated_equals_aggregated("inline", false);
}

#[test]
fn a_corrupted_transfer_falls_back_to_the_same_output() {
    disaggregated_equals_aggregated("ucx", true);
}

#[test]
fn a_killed_decode_worker_leaves_the_pool_and_its_streams_migrate() {
    let _serial = serial();
    // Real-time steps (speedup 1), so that a stream is still running at the kill.
    let mut c = Cluster::start(
        "kill",
        Options {
            decode: 2,
            speedup: 1.0,
            ..Options::default()
        },
    );
    let system = words(6, 1500);
    let first = c.chat(&chat(&system, "Warm up.", 4));
    let prompt = first.completion.usage.prompt_tokens;
    let home = first.decode;
    let other = if home == decode_id(0) {
        decode_id(1)
    } else {
        decode_id(0)
    };
    // The index tracks both workers (each dumped when it joined); one holds the prompt.
    c.wait_metrics("the prompt in the index", Duration::from_secs(15), |m| {
        m.index_workers() == 2 && m.index_entries() >= blocks(prompt)
    });

    // A stream on the worker holding the prefix, killed mid-way.
    let mut story = chat(&system, "Tell a story.", 400);
    story["seed"] = json!(99);
    let mut s = open_stream(&c, &streamed(story.clone()));
    assert_eq!(
        s.header("x-tandem-decode-worker"),
        Some(home.to_string().as_str())
    );
    let mut events = read_events(&mut s, 5);
    c.worker(home).kill9();
    let killed = Instant::now();

    // Before the lease lapses the frontend may still pick the dead worker (it holds the
    // prefix): the refused attempt is re-routed.
    let r = c.chat(&chat(&system, "Right after the kill.", 4));
    assert_eq!(r.decode, other);

    // The stream migrates to the survivor (prompt + tokens so far) and completes: every
    // token once, and the same tokens as an uninterrupted run.
    let (rest, end) = s.collect();
    assert!(killed.elapsed() < http::READ_TIMEOUT, "the stream hung");
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let migrated = chunks(&events);
    assert_eq!(finish_reasons(&migrated), ["length"]);
    assert_eq!(final_usage(&migrated).completion_tokens, 400);
    let uninterrupted = c.chat(&story);
    assert_eq!(uninterrupted.decode, other);
    assert_eq!(
        content(&migrated),
        uninterrupted.content(),
        "the migrated stream differs from an uninterrupted run"
    );
    assert!(c.frontend().log().contains("migrating the request"));
    assert!(c.metrics().get("tandem_migrations_total") >= 1.0);

    // Within the lease TTL the worker leaves the pool and its blocks the index: the
    // survivor's (one sequence of prompt + 400 tokens, and a few blocks of the short
    // requests) are what is left.
    let m = c.wait_metrics("the dead worker purged", Duration::from_secs(15), |m| {
        m.decode_workers() == 1
            && m.index_workers() == 1
            && m.index_entries() <= blocks(prompt + 400) + 8
    });
    assert!(m.feed("purges") >= 1);

    // With the last worker killed mid-stream there is nowhere to migrate: the stream ends
    // with an error event and [DONE], promptly; new requests get a 503.
    let mut s = open_stream(&c, &streamed(chat(&system, "Last one.", 400)));
    let mut events = read_events(&mut s, 5);
    c.worker(other).kill9();
    let killed = Instant::now();
    let (rest, end) = s.collect();
    assert!(killed.elapsed() < http::READ_TIMEOUT, "the stream hung");
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let last = events.pop().unwrap();
    let error: ErrorResponse = serde_json::from_str(&last)
        .unwrap_or_else(|e| panic!("the last event is not an error ({e}): {last}"));
    assert!(!error.error.message.is_empty());
    assert!(finish_reasons(&chunks(&events)).is_empty());
    let r = c.post("/v1/chat/completions", &chat(&system, "Anyone?", 4));
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(!r.json::<ErrorResponse>().error.message.is_empty());
    c.wait_metrics("no decode workers", Duration::from_secs(15), |m| {
        m.decode_workers() == 0
    });
    assert_eq!(http::get(c.addr, "/health").unwrap().status, 503);
}

#[test]
fn routing_resyncs_after_nats_restarts() {
    let _serial = serial();
    let mut c = Cluster::start(
        "nats",
        Options {
            decode: 2,
            ..Options::default()
        },
    );
    let (sys_a, sys_b, sys_c) = (words(7, 1000), words(8, 1000), words(9, 1000));

    let a = c.chat(&chat(&sys_a, "A?", 4));
    let blocks_a = blocks(a.completion.usage.prompt_tokens);
    let before = c.wait_metrics("A in the index", Duration::from_secs(15), |m| {
        m.index_entries() >= blocks_a
    });

    // NATS goes away: requests still work (gRPC and etcd do not need it); B's KV events
    // go nowhere.
    c.nats.stop();
    let b = c.chat(&chat(&sys_b, "B?", 4));
    let blocks_b = blocks(b.completion.usage.prompt_tokens);
    c.rt.block_on(c.nats.restart())
        .expect("restarting nats-server");

    // The index learns B anyway (a gap, a load report ahead of the index, or a dump).
    let after = c.wait_metrics(
        "B in the index after the restart",
        Duration::from_secs(20),
        |m| m.index_entries() >= before.index_entries() + blocks_b,
    );
    eprintln!(
        "feed before: repairs {} dumps {} gaps {}; after: repairs {} dumps {} gaps {}",
        before.feed("repairs"),
        before.feed("dumps"),
        before.feed("gaps"),
        after.feed("repairs"),
        after.feed("dumps"),
        after.feed("gaps")
    );
    let b2 = c.chat(&chat(&sys_b, "B again?", 4));
    assert_eq!(b2.decode, b.decode, "B's prefix is routed to its worker");
    assert!(b2.cached > 0);

    // A prompt first seen after the restart is indexed from live events.
    let c1 = c.chat(&chat(&sys_c, "C?", 4));
    let blocks_c = blocks(c1.completion.usage.prompt_tokens);
    c.wait_metrics("C in the index", Duration::from_secs(15), |m| {
        m.index_entries() >= after.index_entries() + blocks_c
    });
    let c2 = c.chat(&chat(&sys_c, "C again?", 4));
    assert_eq!(c2.decode, c1.decode, "C's prefix is routed to its worker");
    assert!(c2.cached > 0);
}

#[test]
fn workers_reregister_after_etcd_loses_its_data() {
    let _serial = serial();
    let mut c = Cluster::start(
        "etcd",
        Options {
            prefill: 1,
            decode: 2,
            ..Options::default()
        },
    );
    let ok = c.chat(&chat(&words(10, 200), "Before.", 4));
    assert!(ok.prefill.is_some());

    c.rt.block_on(c.etcd.restart_fresh())
        .expect("restarting etcd");
    // Every worker puts its key back into the empty etcd by itself.
    let prefix = format!("/tandem/{}/workers/", c.namespace);
    let endpoint = c.etcd.endpoint();
    wait_for(
        "3 worker keys in the fresh etcd",
        Duration::from_secs(20),
        || {
            let n = c.rt.block_on(async {
                let mut client = etcd_client::Client::connect([endpoint.as_str()], None)
                    .await
                    .ok()?;
                let opts = etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only();
                Some(client.get(prefix.as_str(), Some(opts)).await.ok()?.count())
            });
            (n == Some(3)).then_some(())
        },
    );
    // The frontend still sees them all, and its watch follows the new etcd: a worker that
    // joins now appears.
    c.wait_metrics(
        "the pools after the restart",
        Duration::from_secs(15),
        |m| m.decode_workers() == 2 && m.prefill_workers() == 1,
    );
    c.spawn_worker("decode", decode_id(2));
    c.wait_metrics(
        "a worker that joined after the restart",
        Duration::from_secs(15),
        |m| m.decode_workers() == 3,
    );
    for i in 0..3 {
        let r = c.chat(&chat(&words(20 + i, 200), "After.", 4));
        assert!(r.prefill.is_some());
    }
}

#[test]
fn a_draining_decode_worker_finishes_its_stream_and_exits_cleanly() {
    let _serial = serial();
    let mut c = Cluster::start(
        "drain",
        Options {
            decode: 2,
            speedup: 1.0,
            drain_timeout_s: 20,
            ..Options::default()
        },
    );
    let mut s = open_stream(&c, &streamed(chat(&words(12, 50), "Go on and on.", 600)));
    let victim: u64 = s.header("x-tandem-decode-worker").unwrap().parse().unwrap();
    let other = if victim == decode_id(0) {
        decode_id(1)
    } else {
        decode_id(0)
    };
    let mut events = read_events(&mut s, 10);
    c.worker(victim).signal("TERM");
    let sigterm = Instant::now();

    // New work goes to the other worker at once (a refusal is retried there) and after
    // the victim has deregistered.
    let r = c.chat(&chat(&words(13, 50), "Meanwhile?", 4));
    assert_eq!(r.decode, other);
    c.wait_metrics("the victim deregistered", Duration::from_secs(10), |m| {
        m.decode_workers() == 1
    });
    let r = c.chat(&chat(&words(14, 50), "Still?", 4));
    assert_eq!(r.decode, other);
    assert!(
        c.worker(victim).is_running(),
        "it drains, it does not stop at once"
    );

    // The stream in flight completes in full.
    let (rest, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let chunks = chunks(&events);
    assert_eq!(finish_reasons(&chunks), ["length"]);
    assert_eq!(final_usage(&chunks).completion_tokens, 600);
    // ...from the draining worker itself: a migration would complete it too, and says so
    // in the frontend's log (no metric counts migrations).
    let log = c.frontend().log();
    assert!(
        !log.contains("migrating the request"),
        "the stream was migrated, not drained"
    );
    assert_eq!(c.metrics().get("tandem_migrations_total"), 0.0);

    // It exits once idle, within its drain timeout (20 s; a little slack for the exit).
    let bound = Duration::from_secs(25).saturating_sub(sigterm.elapsed());
    let status = c
        .worker(victim)
        .wait_exit(bound)
        .expect("the drained worker exits within its drain timeout");
    assert!(status.success(), "exit status {status}");
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
    let port = tandem_runtime::external::free_port().unwrap();
    let args: Vec<String> = [
        "up",
        "--processes",
        "--port",
        &port.to_string(),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--speedup-ratio",
        "10",
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
    let r = http::post_json(
        addr,
        "/v1/chat/completions",
        &chat(&words(40, 300), "Hello?", 5).to_string(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let routed = common::cluster::routed(&r);
    assert_eq!(routed.completion.usage.completion_tokens, 5);
    assert!(
        routed.prefill.is_some(),
        "a fresh prompt goes to the prefill process"
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
    std::fs::remove_dir_all(&dir).ok();
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

/// SIGTERM to the frontend: `/health` turns 503 and new requests are refused at once, the
/// stream in flight completes, then the frontend exits 0.
#[test]
fn a_draining_frontend_finishes_its_streams_and_refuses_new_ones() {
    let _serial = serial();
    let mut c = Cluster::start(
        "frontend-drain",
        Options {
            speedup: 2.0,
            ..Options::default()
        },
    );
    let mut s = open_stream(&c, &streamed(chat(&words(21, 50), "Keep talking.", 300)));
    let mut events = read_events(&mut s, 5);
    c.frontend().signal("TERM");
    wait_for("/health to turn 503", Duration::from_secs(10), || {
        http::get(c.addr, "/health")
            .ok()
            .filter(|r| r.status == 503)
            .map(|_| ())
    });
    let refused = c.post("/v1/chat/completions", &chat(&words(22, 20), "New?", 4));
    assert_eq!(refused.status, 503, "{}", refused.text());
    let err: ErrorResponse = refused.json();
    assert!(!err.error.message.is_empty());

    let (rest, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let chunks = chunks(&events);
    assert_eq!(finish_reasons(&chunks), ["length"]);
    assert_eq!(final_usage(&chunks).completion_tokens, 300);
    let status = c
        .frontend()
        .wait_exit(Duration::from_secs(20))
        .expect("the drained frontend exits");
    assert!(status.success(), "exit status {status}");
}
