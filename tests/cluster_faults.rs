//! The failures an operator meets, on real processes, etcd and nats-server (docs/ARCHITECTURE.md §1, §4,
//! §8, §10): a decode worker killed (its streams migrate), NATS restarted, etcd wiped, a
//! worker and the frontend drained on SIGTERM.
//!
//! Each test starts its own etcd, NATS and `tandem` processes (see `common::cluster`), so
//! tests share nothing but the machine; they run one at a time all the same
//! (`common::chat::serial`). Eventual conditions are polled with deadlines; no timing is
//! asserted beyond "ends within a bound" (docs/CONVENTIONS.md §10).

use tandem_test_support as common;

use std::time::{Duration, Instant};

use common::chat::*;
use common::cluster::{Cluster, Options, decode_id, wait_for};
use common::http::{self, StreamEnd};
use common::openai::ErrorResponse;
use common::words;
use serde_json::json;

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
    // Each worker's last load report is on /metrics, per worker.
    let total =
        |id: u64| format!("tandem_worker_kv_total_blocks{{worker=\"{id}\",role=\"decode\"}}");
    c.wait_metrics("per-worker series", Duration::from_secs(5), |m| {
        [decode_id(0), decode_id(1)]
            .iter()
            .all(|&id| m.0.get(&total(id)) == Some(&4096.0))
    });
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
    assert!(
        !m.0.contains_key(&total(home)),
        "the dead worker's series are gone"
    );
    assert_eq!(m.0.get(&total(other)), Some(&4096.0));

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
            // Every prompt remote, short as they are: the prefill worker must be reachable.
            disagg: "always",
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
            // The stream stays: its worker finishes it (the handover is the next test's).
            worker_args: vec!["--drain-handover=false".into()],
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

/// SIGTERM to the decode worker serving a stream, handover on (the default): the worker
/// offers the stream's KV, the frontend continues the stream on the other decode worker with
/// the draining one as its remote prefill (the KV of prompt and tokens so far moves over
/// UCX, nothing is recomputed), the client's stream completes in full, and the drained
/// worker exits long before it could have finished the stream itself.
#[test]
fn a_draining_decode_worker_hands_its_stream_over_with_its_kv() {
    let _serial = serial();
    let mut c = Cluster::start(
        "handover",
        Options {
            decode: 2,
            speedup: 1.0,
            drain_timeout_s: 20,
            ..Options::default()
        },
    );
    let mut s = open_stream(&c, &streamed(chat(&words(15, 300), "Go on and on.", 600)));
    let victim: u64 = s.header("x-tandem-decode-worker").unwrap().parse().unwrap();
    let mut events = read_events(&mut s, 10);
    // The tokens those events carried (the first event may be the role alone).
    let read = chunks(&events)
        .iter()
        .filter(|c| {
            c.choices
                .iter()
                .any(|ch| ch.delta.content.as_deref().is_some_and(|t| !t.is_empty()))
        })
        .count() as u32;
    c.worker(victim).signal("TERM");
    let (rest, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let chunks = chunks(&events);
    assert_eq!(finish_reasons(&chunks), ["length"]);
    let usage = final_usage(&chunks);
    assert_eq!(usage.completion_tokens, 600);

    let m = c.metrics();
    assert_eq!(m.get("tandem_handovers_total{outcome=\"moved\"}"), 1.0);
    assert_eq!(m.get("tandem_handovers_total{outcome=\"declined\"}"), 0.0);
    // Not a failure: no migration counted, no breaker opened.
    assert_eq!(m.get("tandem_migrations_total"), 0.0);
    // The continuation's prompt (the prompt and at least the tokens read) came over from
    // the draining worker as a remote prefill.
    assert_eq!(m.get("tandem_prefills_total{outcome=\"remote\"}"), 1.0);
    let moved = m.get("tandem_remote_prefill_tokens_total{kind=\"moved\"}");
    assert!(
        moved >= f64::from(usage.prompt_tokens + read),
        "moved {moved} of a {}-token prompt",
        usage.prompt_tokens
    );
    assert!(
        c.frontend()
            .log()
            .contains("handed the request over with its KV"),
        "the frontend's log says nothing of the handover"
    );
    // At speedup 1, 600 tokens take ~10 s on one worker; the victim is gone well before:
    // within its drain timeout in any case, cleanly.
    let status = c
        .worker(victim)
        .wait_exit(Duration::from_secs(25))
        .expect("the drained worker exits within its drain timeout");
    assert!(status.success(), "exit status {status}");
}

/// SIGTERM to the only decode worker: its offer has nowhere to go (the frontend declines it),
/// and the stream finishes on the draining worker, as without a handover.
#[test]
fn a_handover_with_no_other_decode_worker_is_declined_and_the_stream_finishes_in_place() {
    let _serial = serial();
    let mut c = Cluster::start(
        "handover-declined",
        Options {
            decode: 1,
            speedup: 1.0,
            drain_timeout_s: 20,
            ..Options::default()
        },
    );
    let mut s = open_stream(&c, &streamed(chat(&words(16, 50), "Go on and on.", 300)));
    let mut events = read_events(&mut s, 10);
    c.worker(decode_id(0)).signal("TERM");
    let (rest, end) = s.collect();
    assert!(matches!(end, StreamEnd::Done), "{end:?}");
    events.extend(rest);
    let chunks = chunks(&events);
    assert_eq!(final_usage(&chunks).completion_tokens, 300);
    let m = c.metrics();
    assert_eq!(m.get("tandem_handovers_total{outcome=\"declined\"}"), 1.0);
    assert_eq!(m.get("tandem_handovers_total{outcome=\"moved\"}"), 0.0);
    let status = c
        .worker(decode_id(0))
        .wait_exit(Duration::from_secs(25))
        .expect("the drained worker exits within its drain timeout");
    assert!(status.success(), "exit status {status}");
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
