//! Flow control on real processes (docs/ARCHITECTURE.md §10, issue 12 §1): a decode worker saturated by
//! the frontend's tracker, the bounded queue in front of it, 429 with `Retry-After` when it is
//! full, the interactive band displacing batch work, deadlines in the queue (429) and while
//! running (504), per-tenant rate limits, a client leaving the queue, and the metrics of it
//! all.
//!
//! The worker counts as saturated at two requests in flight (`--saturation-requests=2`; the
//! KV and waiting thresholds are off so that nothing else decides), and the mocker runs at
//! real speed so that a request of a few hundred tokens lasts seconds.

use tandem_test_support as common;

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::chat::*;
use common::cluster::{Cluster, Options, wait_for};
use common::http;
use common::words;
use serde_json::{Value, json};

/// Longest a test waits for the cluster to learn something over the event plane.
const WAIT: Duration = Duration::from_secs(15);

/// What one request thread saw.
#[derive(Debug)]
struct Outcome {
    status: u16,
    retry_after: Option<u64>,
    body: String,
    /// Since the thread started, when the response was whole (streams: when the head, i.e.
    /// the first token, arrived).
    head_after: Duration,
    /// When the head arrived (streams: the first token).
    head_at: Instant,
}

fn cluster(name: &str, extra: &[&str]) -> Cluster {
    let mut args: Vec<String> = [
        "--saturation-requests=2",
        "--saturation-kv-fraction=0",
        "--saturation-waiting=0",
        "--queue-max=3",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    Cluster::start(
        name,
        Options {
            speedup: 1.0,
            frontend_args: args,
            ..Options::default()
        },
    )
}

/// Sends `body` with `headers` on a thread; the outcome comes back when the response is
/// whole.
fn send(c: &Cluster, body: Value, headers: Vec<(&'static str, String)>) -> JoinHandle<Outcome> {
    let addr = c.addr;
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = http::request(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(body.to_string().as_bytes()),
            &h,
        )
        .expect("request");
        Outcome {
            status: r.status,
            retry_after: r.header("retry-after").map(|v| v.parse().unwrap()),
            body: r.text(),
            head_after: t0.elapsed(),
            head_at: Instant::now(),
        }
    })
}

/// Streams `body` on a thread: the head (the first token) is timed, then the rest is read.
fn send_stream(c: &Cluster, body: Value) -> JoinHandle<Outcome> {
    let addr = c.addr;
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut s = http::post_stream(addr, "/v1/chat/completions", &streamed(body).to_string())
            .expect("request");
        let (head_after, head_at) = (t0.elapsed(), Instant::now());
        let retry_after = s.header("retry-after").map(|v| v.parse().unwrap());
        let (events, _) = s.collect();
        Outcome {
            status: s.status,
            retry_after,
            body: events.join("\n"),
            head_after,
            head_at,
        }
    })
}

fn with_priority(mut body: Value, p: &str) -> Value {
    body["priority"] = json!(p);
    body
}

/// A request of `max_tokens` generated tokens (ignore_eos), the prompt distinct per `seed`.
fn long(seed: u64, max_tokens: u32) -> Value {
    chat(&words(seed, 40), "Go on.", max_tokens)
}

fn gauge(c: &Cluster, key: &str) -> f64 {
    c.metrics().0.get(key).copied().unwrap_or(0.0)
}

fn depth(c: &Cluster, band: &str) -> f64 {
    gauge(
        c,
        &format!("tandem_frontend_queue_depth{{band=\"{band}\"}}"),
    )
}

fn rejections(c: &Cluster, reason: &str) -> f64 {
    gauge(
        c,
        &format!("tandem_frontend_rejections_total{{reason=\"{reason}\"}}"),
    )
}

/// Waits until `n` requests of `band` have been dispatched (each records its queue wait).
fn wait_dispatched(c: &Cluster, band: &str, n: f64) {
    let key = format!("tandem_frontend_queue_wait_seconds_count{{band=\"{band}\"}}");
    wait_for(
        &format!("{n} {band} requests dispatched"),
        Duration::from_secs(10),
        || (gauge(c, &key) >= n).then_some(()),
    );
}

fn wait_depth(c: &Cluster, band: &str, n: f64) {
    wait_for(
        &format!("{n} {band} requests queued"),
        Duration::from_secs(10),
        || (depth(c, band) == n).then_some(()),
    );
}

#[test]
fn a_saturated_pool_queues_sheds_batch_first_and_serves_interactive_first() {
    let _serial = serial();
    let c = cluster("overload-queue", &[]);

    // Two long requests saturate the one worker (for ~4 s and ~8 s: every step below fits in
    // the first, with room for a stalled machine); the first ends well before the second.
    let running: Vec<_> = [600, 1400]
        .into_iter()
        .enumerate()
        .map(|(i, n)| send_stream(&c, long(i as u64, n)))
        .collect();
    wait_dispatched(&c, "standard", 2.0);
    // Three batch requests wait (the queue's bound).
    let batch: Vec<_> = (10..13)
        .map(|i| {
            let h = send_stream(&c, with_priority(long(i, 5), "batch"));
            // One at a time, so that "newest" is well defined.
            wait_depth(&c, "batch", (i - 9) as f64);
            h
        })
        .collect();

    // A fourth batch request (by the header) finds the queue full: 429 with Retry-After, at
    // once.
    let full = send(&c, long(20, 5), vec![("x-tandem-priority", "batch".into())])
        .join()
        .unwrap();
    assert_eq!(full.status, 429, "{}", full.body);
    assert!(full.retry_after.is_some_and(|s| s >= 1), "{full:?}");
    assert!(full.head_after < Duration::from_secs(2), "{full:?}");
    let e: Value = serde_json::from_str(&full.body).unwrap();
    assert_eq!(e["error"]["code"], "overloaded");

    // An interactive request takes the newest batch request's place; it runs long enough to
    // hold the slot the first long request frees.
    let interactive = send_stream(&c, with_priority(long(30, 200), "interactive"));
    wait_for("one batch request shed", Duration::from_secs(10), || {
        // The depths move a moment after the rejection is counted.
        (rejections(&c, "displaced") == 1.0
            && depth(&c, "interactive") == 1.0
            && depth(&c, "batch") == 2.0)
            .then_some(())
    });
    assert_eq!(rejections(&c, "queue_full"), 1.0);

    for r in running {
        let r = r.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let interactive = interactive.join().unwrap();
    assert_eq!(interactive.status, 200, "{}", interactive.body);
    let outcomes: Vec<Outcome> = batch.into_iter().map(|h| h.join().unwrap()).collect();
    let statuses: Vec<u16> = outcomes.iter().map(|o| o.status).collect();
    // The newest (third) batch request was displaced; the other two were served, after the
    // interactive one, which arrived last.
    assert_eq!(statuses, vec![200, 200, 429], "{outcomes:?}");
    assert!(outcomes[2].retry_after.is_some());
    for o in &outcomes[..2] {
        assert!(
            o.head_at > interactive.head_at,
            "a batch request was served before the interactive one: {o:?} / {interactive:?}"
        );
    }
    // Waits were recorded per band; nothing is left queued.
    let m = c.metrics();
    assert!(m.get("tandem_frontend_queue_wait_seconds_count{band=\"interactive\"}") >= 1.0);
    assert!(m.get("tandem_frontend_queue_wait_seconds_count{band=\"batch\"}") >= 2.0);
    for band in ["interactive", "standard", "batch"] {
        assert_eq!(depth(&c, band), 0.0);
    }
    assert!(
        m.get("tandem_frontend_tenant_tokens_total{tenant=\"anonymous\",kind=\"output\"}") > 800.0
    );
}

#[test]
fn deadlines_end_requests_in_the_queue_and_on_the_workers() {
    let _serial = serial();
    let c = cluster("overload-deadline", &["--request-timeout=30"]);

    // Running: a 1,000-token generation with a 0.5 s budget is cut at the deadline (504).
    let mut body = long(1, 1000);
    body["timeout"] = json!(0.5);
    let t0 = Instant::now();
    let r = c.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 504, "{}", r.text());
    let e: Value = r.json();
    assert_eq!(e["error"]["code"], "deadline_exceeded");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // A bad timeout is the client's error.
    let mut bad = long(2, 5);
    bad["timeout"] = json!(-1);
    assert_eq!(c.post("/v1/chat/completions", &bad).status, 400);
    let r = http::request(
        c.addr,
        "POST",
        "/v1/chat/completions",
        Some(long(2, 5).to_string().as_bytes()),
        &[("x-tandem-timeout", "soon")],
    )
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.text());

    // Queued: with the worker saturated, a request whose deadline passes while it waits is
    // refused with 429 and Retry-After, after its deadline and not long after.
    // Two requests that keep the worker saturated for ~5 s, through the leaver below too.
    let running: Vec<_> = (0..2)
        .map(|i| send(&c, long(10 + i, 800), vec![]))
        .collect();
    wait_dispatched(&c, "standard", 3.0);
    let waited = send(&c, long(20, 5), vec![("x-tandem-timeout", "0.7".into())])
        .join()
        .unwrap();
    assert_eq!(waited.status, 429, "{}", waited.body);
    assert!(waited.retry_after.is_some());
    assert!(
        waited.head_after >= Duration::from_millis(650)
            && waited.head_after < Duration::from_secs(3),
        "{waited:?}"
    );
    assert_eq!(rejections(&c, "queue_timeout"), 1.0);

    // A client that leaves while queued leaves the queue.
    let (tx, rx) = mpsc::channel();
    let addr = c.addr;
    let leaver = std::thread::spawn(move || {
        use std::io::Write;
        let body = long(30, 5).to_string();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        rx.recv().unwrap();
        drop(s);
    });
    wait_depth(&c, "standard", 1.0);
    tx.send(()).unwrap();
    leaver.join().unwrap();
    wait_depth(&c, "standard", 0.0);
    for r in running {
        assert_eq!(r.join().unwrap().status, 200);
    }
}

#[test]
fn tenants_are_rate_limited_per_minute() {
    let _serial = serial();
    let c = cluster("overload-rate", &["--tenant-requests-per-minute=3"]);
    for i in 0..3 {
        let r = c.post("/v1/chat/completions", &long(i, 3));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = c.post("/v1/chat/completions", &long(9, 3));
    assert_eq!(r.status, 429, "{}", r.text());
    let e: Value = r.json();
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    // 3 a minute: the next one in about 20 s.
    let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((15..=20).contains(&after), "Retry-After {after}");
    assert_eq!(rejections(&c, "rate_limit_requests"), 1.0);
}

// ---------------------------------------------------------------------------------------
// Failure handling (issue 12 §2): breakers, the retry budget, hedging
// ---------------------------------------------------------------------------------------

fn counter(c: &Cluster, key: &str) -> f64 {
    gauge(c, key)
}

/// Two decode workers whose leases outlive the test: a killed worker stays in discovery.
fn failing_cluster(name: &str, extra: &[&str]) -> Cluster {
    Cluster::start(
        name,
        Options {
            decode: 2,
            lease_ttl_s: 60,
            frontend_args: extra.iter().map(|s| s.to_string()).collect(),
            ..Options::default()
        },
    )
}

#[test]
fn a_dead_worker_that_discovery_still_lists_is_not_chosen_even_for_its_cache() {
    let _serial = serial();
    let mut c = failing_cluster(
        "breaker",
        &["--breaker-failures=2", "--breaker-open-ms=60000"],
    );
    // Nine prompts behind one system prompt, all on one worker: the first goes anywhere,
    // prefix affinity sends the rest after it once its blocks are in the index (the index
    // learns them over the event plane: routing the next one before that is a coin toss).
    // That worker alone then holds each prompt's own blocks.
    let system = words(7, 300);
    let ask = |i: u64| chat(&system, &words(1000 + i, 40), 4);
    let first = c.chat(&ask(0));
    let cached_on = first.decode;
    let prompt = first.completion.usage.prompt_tokens;
    let mut indexed = c
        .wait_metrics("the first prompt in the index", WAIT, |m| {
            m.index_entries() >= blocks(prompt)
        })
        .index_entries();
    for i in 1..=8 {
        assert_eq!(c.chat(&ask(i)).decode, cached_on, "prefix affinity");
        indexed = c
            .wait_metrics("the prompt's own blocks in the index", WAIT, |m| {
                m.index_entries() > indexed
            })
            .index_entries();
    }
    c.worker(cached_on).kill9();
    // Each prompt is cached on the dead worker in full, on the live one at most up to the
    // system prompt: the cache draws the first two to the dead worker (re-routed), then its
    // breaker is open.
    for i in 1..=8 {
        let r = c.chat(&ask(i));
        assert_ne!(r.decode, cached_on);
    }
    // Two failures opened its breaker; after that the cache no longer drew requests to it.
    assert_eq!(counter(&c, "tandem_reroutes_total"), 2.0);
    // The per-worker breaker gauges are refreshed from the view every 250 ms
    // (cluster/metrics.rs): wait for the refresh that follows the opening, then check both.
    let state = format!("tandem_worker_breaker_state{{worker=\"{cached_on}\",role=\"decode\"}}");
    let opened =
        format!("tandem_worker_breaker_openings{{worker=\"{cached_on}\",role=\"decode\"}}");
    let m = c.wait_metrics(
        "the breaker gauge to show it open",
        Duration::from_secs(5),
        |m| m.0.get(&state) == Some(&2.0),
    );
    assert_eq!(m.0.get(&opened), Some(&1.0));
}

#[test]
fn retries_stop_when_the_budget_is_spent() {
    let _serial = serial();
    let mut c = failing_cluster(
        "retry-budget",
        &[
            "--retry-budget=0",
            "--retry-budget-min=1",
            "--breaker-failures=0",
            "--breaker-failure-ratio=2",
        ],
    );
    for id in [common::cluster::decode_id(0), common::cluster::decode_id(1)] {
        c.worker(id).kill9();
    }
    for i in 0..3 {
        let r = c.post("/v1/chat/completions", &long(i, 3));
        assert_eq!(r.status, 503, "{}", r.text());
    }
    // One retry in the window, then none: 3 requests cost 4 attempts, not 6.
    assert_eq!(
        counter(&c, "tandem_frontend_retries_total{outcome=\"retried\"}"),
        1.0
    );
    assert_eq!(
        counter(
            &c,
            "tandem_frontend_retries_total{outcome=\"budget_exhausted\"}"
        ),
        3.0
    );
    assert_eq!(counter(&c, "tandem_reroutes_total"), 4.0);
}

#[test]
fn a_request_stuck_on_a_frozen_worker_is_hedged_to_another() {
    let _serial = serial();
    let mut c = failing_cluster("hedge", &["--hedge", "--hedge-min-delay-ms=100"]);
    // Every request shares one system prompt, so prefix affinity sends each to the worker that
    // holds it: the frozen worker below is the router's first choice, not a coin toss (a run
    // where both picks fell on the live worker hedged nothing). Twenty-four TTFTs of this size
    // teach the frontend what is normal.
    let system = words(100, 40);
    let ask = |i: u64| chat(&system, &format!("Go on, part {i}."), 2);
    let first = c.chat(&ask(0));
    let frozen = first.decode;
    let prompt = first.completion.usage.prompt_tokens;
    c.wait_metrics("the first prompt in the index", WAIT, |m| {
        m.index_entries() >= blocks(prompt)
    });
    for i in 1..24 {
        assert_eq!(c.chat(&ask(i)).decode, frozen, "prefix affinity");
    }
    c.worker(frozen).signal("STOP");
    for i in 0..6 {
        let t0 = Instant::now();
        let r = c.chat(&ask(100 + i));
        assert_ne!(r.decode, frozen);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
    c.worker(frozen).signal("CONT");
    let won = counter(&c, "tandem_frontend_hedges_total{outcome=\"hedge_won\"}");
    let started = counter(&c, "tandem_frontend_hedges_total{outcome=\"started\"}");
    assert!(won >= 1.0 && won <= started, "won {won} of {started}");
}

// ---------------------------------------------------------------------------------------
// Three times the capacity (issue 12 §5)
// ---------------------------------------------------------------------------------------

/// VmRSS of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn percentile(mut xs: Vec<f64>, q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() - 1) as f64 * q).round() as usize]
}

/// Long version of the overload run (a test-harness switch, not configuration of tandem).
fn long_run() -> bool {
    #[allow(clippy::disallowed_methods)]
    std::env::var_os("TANDEM_FAULTS_LONG").is_some()
}

#[test]
fn three_times_capacity_sheds_batch_and_keeps_interactive_fast() {
    let _serial = serial();
    let mut c = Cluster::start(
        "overload-3x",
        Options {
            decode: 2,
            speedup: 4.0,
            device_blocks: 1024,
            frontend_args: vec!["--queue-max=64".into(), "--saturation-requests=12".into()],
            ..Options::default()
        },
    );
    let body = |i: u64, priority: &str| {
        let mut b = with_priority(chat(&words(5000 + i, 150), "Go on.", 48), priority);
        b["seed"] = json!(i);
        b
    };
    // Capacity: a closed loop of 32 clients for a few seconds (the queue keeps the workers
    // saturated, never over).
    let measure = Duration::from_secs(if long_run() { 20 } else { 6 });
    let t0 = Instant::now();
    let clients: Vec<_> = (0..32u64)
        .map(|k| {
            let addr = c.addr;
            std::thread::spawn(move || {
                let mut ok = 0u64;
                let mut i = 0;
                while t0.elapsed() < measure {
                    let mut b =
                        with_priority(chat(&words(k * 10_000 + i, 150), "Go on.", 48), "standard");
                    b["seed"] = json!(i);
                    i += 1;
                    let r = http::post_json(addr, "/v1/chat/completions", &b.to_string()).unwrap();
                    ok += u64::from(r.status == 200);
                }
                ok
            })
        })
        .collect();
    let completed: u64 = clients.into_iter().map(|h| h.join().unwrap()).sum();
    let capacity = completed as f64 / t0.elapsed().as_secs_f64();

    // Three times that, open loop: a sixth interactive (half the capacity), the rest batch.
    let pids: Vec<(String, u32)> = std::iter::once(("frontend".to_string(), c.frontend().pid()))
        .chain(c.workers.iter().map(|w| (w.name.clone(), w.pid())))
        .collect();
    let rss_start: Vec<u64> = pids.iter().map(|(_, p)| rss_kib(*p)).collect();
    let rate = 3.0 * capacity;
    let run = Duration::from_secs(if long_run() { 60 } else { 12 });
    let period = Duration::from_secs_f64(1.0 / rate);
    let t1 = Instant::now();
    let mut handles = Vec::new();
    let mut rss_max = rss_start.clone();
    let mut i = 0u64;
    while t1.elapsed() < run {
        let interactive = i.is_multiple_of(6);
        let b = body(i, if interactive { "interactive" } else { "batch" });
        let addr = c.addr;
        handles.push((
            interactive,
            std::thread::spawn(move || {
                let t = Instant::now();
                let mut s =
                    http::post_stream(addr, "/v1/chat/completions", &streamed(b).to_string())
                        .expect("request");
                let ttft = t.elapsed();
                let retry = s.header("retry-after").is_some();
                let (_, end) = s.collect();
                (s.status, ttft, retry, matches!(end, http::StreamEnd::Done))
            }),
        ));
        i += 1;
        if i.is_multiple_of(50) {
            for (k, (_, p)) in pids.iter().enumerate() {
                rss_max[k] = rss_max[k].max(rss_kib(*p));
            }
        }
        if let Some(w) = (t1 + period * i as u32).checked_duration_since(Instant::now()) {
            std::thread::sleep(w);
        }
    }
    let sent = i;
    let mut served = 0u64;
    let (mut int_ttft, mut int_refused, mut batch_refused, mut no_retry_after) =
        (Vec::new(), 0u64, 0u64, 0u64);
    let (mut int_sent, mut batch_sent) = (0u64, 0u64);
    for (interactive, h) in handles {
        let (status, ttft, retry, done) = h.join().unwrap();
        if interactive {
            int_sent += 1;
        } else {
            batch_sent += 1;
        }
        match status {
            200 => {
                assert!(done, "a served stream did not finish");
                served += 1;
                if interactive {
                    int_ttft.push(ttft.as_secs_f64());
                }
            }
            429 => {
                no_retry_after += u64::from(!retry);
                if interactive {
                    int_refused += 1;
                } else {
                    batch_refused += 1;
                }
            }
            other => panic!("status {other} under overload"),
        }
    }
    let elapsed = t1.elapsed().as_secs_f64();
    let goodput = served as f64 / elapsed;
    let p95 = percentile(int_ttft.clone(), 0.95);
    let p50 = percentile(int_ttft, 0.5);
    let growth: Vec<String> = pids
        .iter()
        .zip(rss_start.iter().zip(&rss_max))
        .map(|((name, _), (a, b))| {
            format!(
                "{name} {:.0}→{:.0} MiB",
                *a as f64 / 1024.0,
                *b as f64 / 1024.0
            )
        })
        .collect();
    println!(
        "OVERLOAD 3x: capacity {capacity:.1} req/s (closed loop, 32 clients); offered \
         {rate:.1} req/s for {elapsed:.0} s ({sent} requests, {int_sent} interactive, \
         {batch_sent} batch): goodput {goodput:.1} req/s = {:.0} % of capacity; 429s: \
         {batch_refused} batch ({:.0} %), {int_refused} interactive ({:.0} %), all with \
         Retry-After: {}; interactive TTFT p50 {:.0} ms, p95 {:.0} ms; RSS {}",
        100.0 * goodput / capacity,
        100.0 * batch_refused as f64 / batch_sent.max(1) as f64,
        100.0 * int_refused as f64 / int_sent.max(1) as f64,
        no_retry_after == 0,
        p50 * 1000.0,
        p95 * 1000.0,
        growth.join(", ")
    );
    assert_eq!(no_retry_after, 0, "a 429 without Retry-After");
    // The target is 80 % (docs/RELIABILITY.md has the figure); the test client's own threads
    // share the two cores with the cluster, so CI asserts below it: what it guards is that
    // goodput does not collapse under three times the load. Measured on 2-vCPU VMs with the
    // same code: 75–80 % (Intel), 62–70 % (AMD EPYC Zen 3), 93 % (Zen 4); the floor sits
    // well below all of them, since capacity itself comes from a 6-second closed loop.
    assert!(
        goodput >= 0.45 * capacity,
        "goodput {goodput:.1} of {capacity:.1}"
    );
    assert!(batch_refused > 0, "nothing was shed");
    assert!(
        (int_refused as f64) < 0.05 * int_sent as f64,
        "interactive requests refused: {int_refused} of {int_sent}"
    );
    // The interactive SLO: p95 TTFT under 2 s while two thirds of the load is shed.
    assert!(p95 < 2.0, "interactive TTFT p95 {p95:.2} s");
    for ((name, _), (a, b)) in pids.iter().zip(rss_start.iter().zip(&rss_max)) {
        assert!(
            *b < *a + 64 * 1024,
            "{name}: RSS grew from {a} to {b} KiB under overload"
        );
    }
}
