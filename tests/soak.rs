//! The memory soak, short version (issue 12 §4; docs/RELIABILITY.md, Memory): a cluster of
//! real processes (etcd, NATS, 2 prefill and 2 decode mocker workers, the frontend) serves
//! thousands of requests with distinct prompts from many concurrent clients, and every
//! process's RSS (VmRSS) must stop growing: the peak it reaches in the last quarter of the
//! requests may exceed its peak over the first three quarters by at most 2 % of its
//! first-quarter peak, plus a small absolute slack ([`SLACK_KIB`]).
//!
//! At CI size (3,000 requests, a debug build) that catches a leak of about 3 KB per request
//! or more (the frontend grew 10 KB per request); `TANDEM_SOAK_REQUESTS=N` runs more.
//! The long version, 100,000+ requests of 1,200-word prompts on a release build, is
//! `scripts/soak.sh`.

use tandem_test_support as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::cluster::{Cluster, Options};
use common::http;
use common::words;

/// Requests at CI size, all with distinct prompts (no two share a KV block).
const REQUESTS: usize = 3_000;
/// Clients, each with one request in flight.
const CLIENTS: usize = 32;
/// Words per prompt (one cl100k token each): 8 full blocks, so that the workers' pools
/// (2,048 blocks each) and the frontend's index turn over several times within the run.
const WORDS: usize = 128;
const MAX_TOKENS: u32 = 4;
/// Allowed last-quarter growth relative to the first-quarter peak.
const MAX_GROWTH: f64 = 0.02;
/// Allowed last-quarter growth on top of that, for the allocator growing its heaps in steps
/// (glibc grows an arena's top by at least 128 KiB at a time). Measured on the debug build
/// (2026-12-01, 2 cores, 5 runs of 3,000 requests): 148–828 KiB over the last quarter in any
/// one process, where the 2 % is 1.1–1.3 MiB; with this slack the bound (~2.2 MiB) is 2.6
/// times the worst run.
const SLACK_KIB: u64 = 1024;

/// `TANDEM_SOAK_REQUESTS`, else [`REQUESTS`] (a test harness switch, not configuration of
/// tandem).
fn requests() -> usize {
    #[allow(clippy::disallowed_methods)]
    std::env::var("TANDEM_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n >= 4)
        .unwrap_or(REQUESTS)
}

/// VmRSS of `pid` in KiB (0 once it is gone).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// One process's RSS peaks: up to the end of the first quarter, of the first three quarters,
/// and of the last quarter.
#[derive(Debug, Default, Clone, Copy)]
struct Peaks {
    requests: usize,
    start: u64,
    q1: u64,
    q3: u64,
    q4: u64,
}

impl Peaks {
    fn add(&mut self, done: usize, rss: u64) {
        if self.start == 0 {
            self.start = rss;
        }
        if done <= self.requests / 4 {
            self.q1 = self.q1.max(rss);
        }
        if done <= 3 * self.requests / 4 {
            self.q3 = self.q3.max(rss);
        } else {
            self.q4 = self.q4.max(rss);
        }
    }

    /// Last-quarter growth beyond the first three quarters' peak, KiB.
    fn growth(&self) -> u64 {
        self.q4.saturating_sub(self.q3)
    }

    fn allowed(&self) -> u64 {
        (self.q1 as f64 * MAX_GROWTH) as u64 + SLACK_KIB
    }
}

#[test]
fn rss_stops_growing_over_thousands_of_distinct_requests() {
    let _serial = common::chat::serial();
    let opts = Options {
        prefill: 2,
        decode: 2,
        speedup: 50.0,
        device_blocks: 2048,
        ..Options::default()
    };
    let device_blocks = u64::from(opts.device_blocks);
    let mut c = Cluster::start("soak", opts);
    let mut procs: Vec<(String, u32)> = vec![("frontend".into(), c.frontend().pid())];
    procs.extend(c.workers.iter().map(|w| (w.name.clone(), w.pid())));

    let requests = requests();
    let (next, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let addr = c.addr;
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (next, done) = (next.clone(), done.clone());
            std::thread::spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests {
                        return;
                    }
                    // The request number first: no two prompts share even their first block.
                    let body = serde_json::json!({
                        "model": "mocker",
                        "prompt": format!("{i} {}", words(i as u64 + 1, WORDS)),
                        "max_tokens": MAX_TOKENS,
                        "ignore_eos": true,
                    });
                    let r = http::post_json(addr, "/v1/completions", &body.to_string())
                        .unwrap_or_else(|e| panic!("request {i}: {e}"));
                    assert_eq!(r.status, 200, "request {i}: {}", r.text());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    let peaks = Peaks {
        requests,
        ..Peaks::default()
    };
    let mut peaks = vec![peaks; procs.len()];
    loop {
        let n = done.load(Ordering::Relaxed);
        for ((_, pid), p) in procs.iter().zip(&mut peaks) {
            p.add(n, rss_kib(*pid));
        }
        if clients.iter().all(|t| t.is_finished()) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the soak ran past 10 minutes ({n} of {requests} requests)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for t in clients {
        t.join().expect("a client failed");
    }
    let secs = started.elapsed().as_secs_f64();
    let entries = c.metrics().index_entries();

    eprintln!(
        "soak: {requests} requests ({WORDS}-word distinct prompts, {CLIENTS} clients) in \
         {secs:.1} s ({:.0} req/s); index entries {entries}",
        requests as f64 / secs
    );
    eprintln!("process      start KiB   q1 peak KiB  q1-q3 peak  q4 peak   growth  allowed");
    for ((name, _), p) in procs.iter().zip(&peaks) {
        eprintln!(
            "{name:<12} {:>9} {:>12} {:>11} {:>8} {:>8} {:>8}",
            p.start,
            p.q1,
            p.q3,
            p.q4,
            p.growth(),
            p.allowed()
        );
    }
    // The frontend's index holds at most what the workers' pools hold.
    assert!(
        entries <= 4 * device_blocks,
        "the index holds {entries} entries, beyond 4 × {device_blocks} blocks"
    );
    for ((name, _), p) in procs.iter().zip(&peaks) {
        assert!(p.q4 > 0, "{name}: no RSS sample in the last quarter");
        assert!(
            p.growth() <= p.allowed(),
            "{name}: RSS grew {} KiB over the last quarter of the requests (peak {} → {} KiB), \
             more than 2 % of its first-quarter peak {} KiB plus {SLACK_KIB} KiB",
            p.growth(),
            p.q3,
            p.q4,
            p.q1
        );
    }
}
