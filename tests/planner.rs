//! `tandem planner` in local mode against a real cluster: etcd, nats-server, a frontend, and
//! the workers the planner itself starts (1 prefill + 1 decode at its minimum). An open-loop
//! load at a constant rate doubles, then halves; the planner must scale each pool up and
//! later down again (draining the workers it removes) with every request answered 200, and
//! the client-side TTFT of each phase is printed (crates/planner/BENCHMARKS.md).
//!
//! Sizing of the mockers (timing model in crates/engine/src/mocker/mod.rs): a prefill worker
//! (`--max-batched-tokens 512`, speed ×0.1) computes about 2,100 prompt tokens/s; a decode
//! worker (`--max-num-seqs 4`, speed ×0.25, ~30 ms steps at low KV usage) about 135 tokens/s.
//! Rated at 1,900 and 120 to the planner. 2.5 requests/s of ~496 prompt and 32 completion
//! tokens (1,240 and 80 tokens/s) fit one worker each within the scale-down margin
//! (0.65, 0.67 ≤ 0.8); 5/s (2,480 and 160) need two of each. The forecast is smoothed more
//! than by default (α 0.4, β 0.1): 1-s intervals see 2 or 3 of the 2.5 requests/s.

use tandem_test_support as common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::chat::{chat, serial, streamed};
use common::cluster::{Metrics, Proc, wait_for};
use common::http::{self, Event};
use common::words;
use parking_lot::Mutex;
use serde_json::Value;
use tandem_runtime::external::{EtcdOptions, EtcdServer, NatsOptions, NatsServer, free_port};

const BASE_RATE: f64 = 2.5;
const PROMPT_WORDS: usize = 460;
const MAX_TOKENS: u32 = 32;

/// One request as the client saw it.
#[derive(Debug)]
struct Outcome {
    phase: usize,
    ok: bool,
    ttft: Option<Duration>,
    why: String,
}

/// An open-loop load: requests sent at `1 / rate` intervals (constant arrivals) by a pool of
/// threads, whatever the answers' latency; the rate and the phase label change on the fly.
struct Load {
    stop: Arc<AtomicBool>,
    /// (rate in requests/s, phase) for the requests scheduled from now on.
    setting: Arc<Mutex<(f64, usize)>>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    /// A dispatcher thread wakes at each send time (the rate read then) and hands the
    /// request to the first free one of `threads` senders.
    fn start(addr: SocketAddr, threads: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let setting = Arc::new(Mutex::new((BASE_RATE, 0)));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<(u64, usize)>();
        let rx = Arc::new(Mutex::new(rx));
        let mut handles: Vec<JoinHandle<()>> = (0..threads)
            .map(|_| {
                let (rx, outcomes) = (rx.clone(), outcomes.clone());
                std::thread::spawn(move || {
                    loop {
                        let job = rx.lock().recv();
                        let Ok((i, phase)) = job else { return };
                        let o = one_request(addr, i, phase);
                        outcomes.lock().push(o);
                    }
                })
            })
            .collect();
        let (stop2, setting2) = (stop.clone(), setting.clone());
        handles.push(std::thread::spawn(move || {
            let mut next = Instant::now();
            let mut i = 0;
            while !stop2.load(Ordering::Relaxed) {
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let (rate, phase) = *setting2.lock();
                tx.send((i, phase)).unwrap();
                i += 1;
                next += Duration::from_secs_f64(1.0 / rate);
            }
            // Dropping `tx` ends the senders once the queue is empty.
        }));
        Load {
            stop,
            setting,
            outcomes,
            threads: handles,
        }
    }

    fn set(&self, rate: f64, phase: usize) {
        *self.setting.lock() = (rate, phase);
    }

    fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        std::mem::take(&mut *self.outcomes.lock())
    }
}

/// A streamed chat completion with a prompt of its own (no shared prefix): its TTFT is the
/// time to the first chunk with content; it is ok when the status is 200 and the stream ends
/// with `[DONE]` and no error event.
fn one_request(addr: SocketAddr, i: u64, phase: usize) -> Outcome {
    let body = streamed(chat("", &words(1000 + i, PROMPT_WORDS), MAX_TOKENS)).to_string();
    let sent = Instant::now();
    let fail = |why: String| Outcome {
        phase,
        ok: false,
        ttft: None,
        why,
    };
    let mut s = match http::post_stream(addr, "/v1/chat/completions", &body) {
        Ok(s) => s,
        Err(e) => return fail(format!("request {i}: {e}")),
    };
    if s.status != 200 {
        let (events, _) = s.collect();
        return fail(format!("request {i}: status {}: {events:?}", s.status));
    }
    let mut ttft = None;
    loop {
        match s.next_event() {
            Ok(Event::Data(d)) => {
                let v: Value = serde_json::from_str(&d).unwrap_or_default();
                if v.get("error").is_some() {
                    return fail(format!("request {i}: stream error {d}"));
                }
                let content = v
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str);
                if ttft.is_none() && content.is_some_and(|c| !c.is_empty()) {
                    ttft = Some(sent.elapsed());
                }
            }
            Ok(Event::Done) => break,
            Ok(Event::Eof) => return fail(format!("request {i}: no [DONE]")),
            Err(e) => return fail(format!("request {i}: {e}")),
        }
    }
    Outcome {
        phase,
        ok: ttft.is_some(),
        ttft,
        why: format!("request {i}: no content"),
    }
}

/// `(prefill, decode)` workers the frontend sees.
fn workers(addr: SocketAddr) -> Option<(u64, u64)> {
    let r = http::get(addr, "/metrics").ok()?;
    let m = Metrics::parse(&r.text());
    Some((m.prefill_workers(), m.decode_workers()))
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

fn applied(decisions: &[Value], pool: &str) -> Vec<u64> {
    decisions
        .iter()
        .map(|d| d[pool]["applied"].as_u64().expect("applied"))
        .collect()
}

fn read_decisions(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON decision"))
        .collect()
}

#[test]
fn local_mode_follows_a_load_that_doubles_and_halves_without_failures() {
    let _serial = serial();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (etcd, nats) = rt.block_on(async {
        let etcd = EtcdServer::start(EtcdOptions::default())
            .await
            .expect("etcd");
        let nats = NatsServer::start(NatsOptions::default())
            .await
            .expect("nats");
        (etcd, nats)
    });
    let dir = common::temp_dir("planner");
    let plane = format!(
        "--etcd-endpoints {} --nats-url {} --namespace t-planner --lease-ttl-s 3",
        etcd.endpoint(),
        nats.url()
    );
    let port = free_port().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    // The frontend's /metrics, which the planner reads, is on its admin listener.
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
    let mut frontend_args: Vec<String> = plane.split_whitespace().map(String::from).collect();
    frontend_args.insert(0, "frontend".into());
    frontend_args.extend(
        [
            "--listen",
            &addr.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--disagg",
            "always",
            "--queue-timeout",
            "60",
        ]
        .map(String::from),
    );
    let mut frontend = Proc::spawn(
        "frontend",
        "frontend",
        &frontend_args,
        &dir.join("frontend.log"),
    );
    wait_for("the frontend's /metrics", Duration::from_secs(30), || {
        assert!(
            frontend.is_running(),
            "the frontend exited:\n{}",
            frontend.log()
        );
        workers(admin)
    });

    let decisions_path = dir.join("decisions.jsonl");
    let worker_logs = dir.join("workers");
    std::fs::create_dir_all(&worker_logs).unwrap();
    let planner_args: Vec<String> = [
        "planner",
        "--frontend-url",
        &format!("http://{admin}"),
        "--interval-s",
        "1",
        "--slo-ttft-ms",
        "1500",
        "--slo-itl-ms",
        "100",
        "--prefill-capacity",
        "1900",
        "--decode-capacity",
        "120",
        "--max-prefill",
        "3",
        "--max-decode",
        "3",
        "--smoothing",
        "0.4",
        "--trend",
        "0.1",
        "--scale-up-after",
        "2",
        "--scale-down-after",
        "3",
        "--cooldown-s",
        "5",
        "--decisions-out",
        decisions_path.to_str().unwrap(),
        "--worker-log-dir",
        worker_logs.to_str().unwrap(),
        "--worker-drain-timeout-s",
        "30",
        "--worker-args",
        &format!(
            "{plane} --listen 127.0.0.1:0 --kv-transport tcp --device-blocks 4096 \
             --load-interval-ms 100 --drain-timeout-s 20"
        ),
        "--prefill-args",
        "--max-batched-tokens 512 --speedup-ratio 0.1",
        "--decode-args",
        "--max-num-seqs 4 --speedup-ratio 0.25",
    ]
    .map(String::from)
    .into();
    let mut planner = Proc::spawn(
        "planner",
        "planner",
        &planner_args,
        &dir.join("planner.log"),
    );
    let show = |planner: &Proc| {
        let logs: String = std::fs::read_dir(&worker_logs)
            .map(|d| {
                d.flatten()
                    .map(|e| {
                        let t = std::fs::read_to_string(e.path()).unwrap_or_default();
                        let tail: Vec<&str> = t.lines().rev().take(15).collect();
                        format!("--- {:?}\n{}\n", e.file_name(), tail.join("\n"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        format!("planner:\n{}\n{logs}", planner.log())
    };
    let wait_workers =
        |what: &str, secs: u64, planner: &mut Proc, ok: &dyn Fn(u64, u64) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(secs);
            loop {
                assert!(
                    planner.is_running(),
                    "the planner exited:\n{}",
                    show(planner)
                );
                if let Some((p, d)) = workers(admin)
                    && ok(p, d)
                {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "timed out waiting for {what}: workers {:?}\n{}",
                    workers(admin),
                    show(planner)
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        };
    wait_workers("1 prefill + 1 decode", 60, &mut planner, &|p, d| {
        p == 1 && d == 1
    });
    wait_for("the frontend's /health", Duration::from_secs(30), || {
        http::get(addr, "/health").ok().filter(|r| r.status == 200)
    });

    let started = Instant::now();
    let load = Load::start(addr, 32);
    let mark = |name: &str| eprintln!("[{:5.1} s] {name}", started.elapsed().as_secs_f64());
    // 0: the base rate; 1: doubled, until both pools have 2 workers; 2: doubled, scaled up;
    // 3: back to the base rate, until both pools are down to 1; 4: base, scaled down.
    std::thread::sleep(Duration::from_secs(10));
    assert_eq!(
        workers(admin),
        Some((1, 1)),
        "the base rate needs one worker each"
    );
    mark("doubled");
    load.set(2.0 * BASE_RATE, 1);
    wait_workers("both pools scaled up", 40, &mut planner, &|p, d| {
        p >= 2 && d >= 2
    });
    mark("scaled up");
    load.set(2.0 * BASE_RATE, 2);
    std::thread::sleep(Duration::from_secs(8));
    mark("halved");
    load.set(BASE_RATE, 3);
    wait_workers("both pools scaled down", 60, &mut planner, &|p, d| {
        p == 1 && d == 1
    });
    mark("scaled down");
    load.set(BASE_RATE, 4);
    std::thread::sleep(Duration::from_secs(4));
    let outcomes = load.finish();
    mark("load stopped");

    // Every request answered in full, the ones in flight on drained workers included.
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed, e.g. {:?}\n{}",
        failed.len(),
        outcomes.len(),
        failed.iter().take(5).map(|o| &o.why).collect::<Vec<_>>(),
        show(&planner)
    );
    // Stopping the planner drains its workers; it exits 0.
    planner.signal("TERM");
    let status = planner
        .wait_exit(Duration::from_secs(40))
        .expect("the planner exits");
    assert!(status.success(), "planner: {status}\n{}", show(&planner));
    wait_workers_gone(admin);
    let log = planner.log();
    assert!(
        !log.contains("drain timed out"),
        "a worker had to be killed:\n{log}"
    );
    assert!(log.contains("worker drained"), "{log}");

    // Each pool went up and then back down, without flapping on the way.
    let decisions = read_decisions(&decisions_path);
    for pool in ["prefill", "decode"] {
        let counts = applied(&decisions, pool);
        let top = counts.iter().position(|&n| n >= 2).expect("scaled up");
        assert!(
            counts[top..].contains(&1),
            "{pool} never came back down: {counts:?}"
        );
        // Up, then down: one turn (1→2→3→2→1 is no flap; 1→2→1→2 is).
        let steps: Vec<bool> = counts
            .windows(2)
            .filter(|w| w[0] != w[1])
            .map(|w| w[1] > w[0])
            .collect();
        let turns = steps.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(turns <= 1, "{pool} flapped: {counts:?}");
        assert_eq!(*counts.last().unwrap(), 1, "{pool}: {counts:?}");
        eprintln!("{pool} per interval: {counts:?}");
    }

    let names = [
        "base rate (2.5/s), 1P+1D",
        "doubled (5/s), until scaled up",
        "doubled (5/s), scaled up",
        "halved (2.5/s), until scaled down",
        "halved (2.5/s), scaled down",
    ];
    eprintln!("| phase | requests | TTFT p50 ms | TTFT p99 ms |");
    eprintln!("|---|---|---|---|");
    for (phase, name) in names.iter().enumerate() {
        let mut t: Vec<Duration> = outcomes
            .iter()
            .filter(|o| o.phase == phase)
            .filter_map(|o| o.ttft)
            .collect();
        t.sort();
        assert!(!t.is_empty(), "no requests in phase {name}");
        eprintln!(
            "| {name} | {} | {:.0} | {:.0} |",
            t.len(),
            percentile(&t, 0.5),
            percentile(&t, 0.99)
        );
    }
    eprintln!(
        "total {} requests, 0 failed, {:.1} s",
        outcomes.len(),
        started.elapsed().as_secs_f64()
    );
    frontend.kill9();
    drop((etcd, nats, rt));
}

/// After the planner's exit, its workers are gone from discovery (they drained and
/// deregistered rather than being killed and left to their leases).
fn wait_workers_gone(addr: SocketAddr) {
    wait_for("the workers to deregister", Duration::from_secs(10), || {
        workers(addr).filter(|&(p, d)| p == 0 && d == 0)
    });
}
