//! Two frontend replicas, one view (docs/ARCHITECTURE.md §5, replica sync), on real etcd and NATS: three
//! decode workers, two `tandem frontend` processes, requests sent to them in turn.
//!
//! - **Load.** Each frontend shows what its router's active-sequence tracker counts on every
//!   worker (`tandem_router_tracked_requests{worker,role}` and the prefill-token and
//!   decode-block series, read at scrape time). With replica sync, every scrape while
//!   requests are being routed has the two views within one request of each other per
//!   worker, and once the deltas have landed both equal the truth (where the response headers
//!   say each request went); when the requests end, both go back to zero. The control runs
//!   the same requests with `--replica-sync false`: then each frontend counts only its own,
//!   and the views differ by at least two on some worker. The requests are deliberately
//!   uneven (seven through A, three through B: alternating, then a burst on A) because two
//!   unsynced replicas under an even load can agree with each other while both are wrong;
//!   with four more requests on A than on B over three workers, some worker must differ by
//!   at least two (pigeonhole), whatever the routing.
//! - **Prefixes.** A long prompt routed by one frontend, then the same prefix with another
//!   question routed by the other, lands on the same worker (and hits its cache), in both
//!   directions: both replicas index the same KV events.
//!
//! Requests are held in flight as streams that a thread reads until the test lets go
//! (dropping a stream cancels its request), so nothing depends on how fast the mocker is.
//! Eventual conditions are polled with deadlines (docs/CONVENTIONS.md §10).

use tandem_test_support as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::chat::{chat, serial, streamed};
use common::cluster::{Cluster, Metrics, Options, decode_id, wait_for};
use common::http::{self, Event};
use common::words;

const DECODE: usize = 3;
/// Frontend indices.
const A: usize = 0;
const B: usize = 1;
/// Which frontend each request goes through, in order: alternating, then DECODE + 1 more on
/// A, so that unsynced views must differ by two somewhere (module docs).
const PLAN: [usize; 10] = [A, B, A, B, A, B, A, A, A, A];
/// Long enough that no request ends by itself while the test holds it (minutes at the
/// mocker's speed), short enough that ten of them stay far from the KV saturation threshold
/// even on one worker.
const HOLD_MAX_TOKENS: u32 = 4000;

const SERIES: [&str; 3] = [
    "tandem_router_tracked_requests",
    "tandem_router_tracked_prefill_tokens",
    "tandem_router_tracked_decode_blocks",
];

/// Etcd, NATS, three decode workers at the mocker's real speed, and two frontends.
fn cluster(name: &str, replica_sync: bool) -> Cluster {
    let mut c = Cluster::start(
        name,
        Options {
            decode: DECODE,
            speedup: 1.0,
            frontend_args: vec![format!("--replica-sync={replica_sync}")],
            ..Options::default()
        },
    );
    assert_eq!(c.spawn_frontend(), B);
    c
}

/// One frontend's tracked load: per decode worker (in `decode_id` order), the requests,
/// prefill tokens and decode blocks its tracker counts.
#[derive(Clone, Debug, PartialEq, Eq)]
struct View(Vec<[u64; 3]>);

impl View {
    fn of(m: &Metrics) -> View {
        View(
            (0..DECODE)
                .map(|i| {
                    let w = decode_id(i);
                    SERIES.map(|s| m.get(&format!("{s}{{worker=\"{w}\",role=\"decode\"}}")) as u64)
                })
                .collect(),
        )
    }

    fn requests(&self) -> Vec<u64> {
        self.0.iter().map(|w| w[0]).collect()
    }

    fn total(&self) -> u64 {
        self.requests().iter().sum()
    }

    fn is_zero(&self) -> bool {
        self.0.iter().flatten().all(|&v| v == 0)
    }
}

/// Both frontends' views, scraped back to back (A first); and how long the pair took.
fn sample(c: &Cluster) -> (View, View, Duration) {
    let t0 = Instant::now();
    let a = View::of(&c.metrics_of(A));
    let b = View::of(&c.metrics_of(B));
    (a, b, t0.elapsed())
}

/// The largest per-worker difference in tracked requests.
fn request_diff(a: &View, b: &View) -> u64 {
    a.0.iter()
        .zip(&b.0)
        .map(|(x, y)| x[0].abs_diff(y[0]))
        .max()
        .unwrap_or(0)
}

/// A request held in flight: a thread reads its stream until `stop`, then drops it.
struct Held {
    frontend: usize,
    worker: u64,
    thread: JoinHandle<()>,
}

/// Opens a stream through frontend `i` on a thread; returns once its head (with the decode
/// worker) has arrived.
fn hold(c: &Cluster, i: usize, seed: u64, stop: &Arc<AtomicBool>) -> Held {
    let addr = c.addr_of(i);
    let body = streamed(chat(&words(seed, 40), "Keep talking.", HOLD_MAX_TOKENS)).to_string();
    let (tx, rx) = mpsc::channel();
    let stop = stop.clone();
    let thread = std::thread::spawn(move || {
        let mut s = http::post_stream(addr, "/v1/chat/completions", &body).expect("a stream");
        assert_eq!(s.status, 200, "stream via frontend {i}");
        let worker: u64 = s
            .header("x-tandem-decode-worker")
            .expect("x-tandem-decode-worker")
            .parse()
            .unwrap();
        tx.send(worker).unwrap();
        while !stop.load(Ordering::Relaxed) {
            match s.next_event().expect("reading a held stream") {
                Event::Data(_) => {}
                end => panic!("a held stream ended before the test let go: {end:?}"),
            }
        }
        // Dropping the stream closes the connection: the frontend cancels the request.
    });
    let worker = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("request {seed} via frontend {i} did not start"));
    Held {
        frontend: i,
        worker,
        thread,
    }
}

/// Per decode worker, how many of `held` went there through a frontend in `via`: the truth a
/// tracker should show.
fn truth(held: &[Held], via: &[usize]) -> Vec<u64> {
    (0..DECODE)
        .map(|i| {
            held.iter()
                .filter(|h| h.worker == decode_id(i) && via.contains(&h.frontend))
                .count() as u64
        })
        .collect()
}

/// Lets go of every held request and waits until both trackers are empty again (with
/// sync, each frontend also drops the other's requests: the frees travel too).
fn release(c: &Cluster, held: Vec<Held>, stop: &AtomicBool) {
    stop.store(true, Ordering::Relaxed);
    for h in held {
        h.thread.join().expect("a stream thread failed");
    }
    wait_for(
        "both frontends' trackers to be empty",
        Duration::from_secs(20),
        || {
            let (a, b, _) = sample(c);
            (a.is_zero() && b.is_zero()).then_some(())
        },
    );
}

/// Routes `PLAN` one request at a time, sampling both views after each; returns the held
/// requests and each step's sample (A, B).
fn ramp(
    c: &Cluster,
    stop: &Arc<AtomicBool>,
    mut check: impl FnMut(usize, &View, &View),
) -> Vec<Held> {
    let mut held = Vec::new();
    for (step, &i) in PLAN.iter().enumerate() {
        held.push(hold(c, i, 1000 + step as u64, stop));
        let (a, b, took) = sample(c);
        eprintln!(
            "step {step} (via {}): A {:?} B {:?} (diff {}, scraped in {took:?})",
            ["A", "B"][i],
            a.requests(),
            b.requests(),
            request_diff(&a, &b)
        );
        check(step, &a, &b);
    }
    held
}

#[test]
fn synced_frontends_share_one_view_and_one_cache() {
    let _serial = serial();
    let t0 = Instant::now();
    let c = cluster("two-frontends", true);
    assert!(View::of(&c.metrics_of(A)).is_zero() && View::of(&c.metrics_of(B)).is_zero());

    // A repeated prefix lands on the same worker whichever frontend routes it.
    for (seed, first, second) in [(1, A, B), (2, B, A)] {
        same_worker_for_a_prefix(&c, seed, first, second);
    }

    // Requests in turn through A and B: the views agree all along.
    let stop = Arc::new(AtomicBool::new(false));
    let mut worst_ramp = 0;
    let held = ramp(&c, &stop, |step, a, b| {
        worst_ramp = worst_ramp.max(request_diff(a, b));
        if request_diff(a, b) > 1 {
            // At most the request just routed can be in flight on the event plane; should
            // more be, they must land shortly.
            wait_for(
                &format!("views within one request after step {step}"),
                Duration::from_secs(5),
                || {
                    let (a, b, _) = sample(&c);
                    (request_diff(&a, &b) <= 1).then_some(())
                },
            );
        }
    });
    let all = truth(&held, &[A, B]);
    assert_eq!(all.iter().sum::<u64>(), PLAN.len() as u64);
    // Once the deltas have landed, both views are the truth, and the same in every series.
    let (a, b, _) = {
        let mut last = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (a, b, took) = sample(&c);
            if a.requests() == all && b.requests() == all && a == b {
                break (a, b, took);
            }
            assert!(
                Instant::now() < deadline,
                "the views did not converge on {all:?}: last {last:?}"
            );
            last = Some((a, b));
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    eprintln!("converged: A {:?} B {:?}", a.0, b.0);
    // Nothing moves while the requests are held: every sample agrees.
    let mut worst_held = 0;
    for _ in 0..20 {
        let (a, b, took) = sample(&c);
        let d = request_diff(&a, &b);
        worst_held = worst_held.max(d);
        assert!(
            d <= 1 && a.total() == all.iter().sum::<u64>(),
            "views apart while requests are held: A {:?} B {:?} (scraped in {took:?})",
            a.0,
            b.0
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    eprintln!(
        "replica sync on: largest per-worker difference in tracked requests {worst_ramp} \
         while routing, {worst_held} while held"
    );
    release(&c, held, &stop);
    eprintln!("synced test took {:?}", t0.elapsed());
}

/// Routes a long prompt through `first`, then the same prefix with another question through
/// `second`: the same worker serves both, from its cache.
fn same_worker_for_a_prefix(c: &Cluster, seed: u64, first: usize, second: usize) {
    let system = words(seed, 300);
    // The gauge is refreshed every 250 ms: a baseline read before the last refresh would
    // let the wait below pass before this prefix is indexed. Two equal reads 300 ms apart.
    let indexed = wait_for("the index gauge to settle", Duration::from_secs(10), || {
        let before = c.metrics_of(second).index_entries();
        std::thread::sleep(Duration::from_millis(300));
        (c.metrics_of(second).index_entries() == before).then_some(before)
    });
    let one = c.chat_via(first, &chat(&system, "What is the first thing?", 8));
    let prompt_blocks = u64::from(one.completion.usage.prompt_tokens / 16);
    // The second frontend must know where the prefix is (the KV events) and that the first
    // request has ended (its free), or it would route on a stale view.
    wait_for(
        "the second frontend to index the prefix",
        Duration::from_secs(10),
        || (c.metrics_of(second).index_entries() >= indexed + prompt_blocks).then_some(()),
    );
    wait_for("both trackers empty", Duration::from_secs(10), || {
        let (a, b, _) = sample(c);
        (a.is_zero() && b.is_zero()).then_some(())
    });
    let two = c.chat_via(second, &chat(&system, "And what comes after that one?", 8));
    assert_eq!(
        two.decode, one.decode,
        "the prefix went to worker {} through frontend {first}, to {} through {second}",
        one.decode, two.decode
    );
    assert!(
        two.cached >= 16 * 16,
        "the second request hit only {} cached tokens of a {}-token prefix",
        two.cached,
        one.completion.usage.prompt_tokens
    );
}

#[test]
fn unsynced_frontends_disagree() {
    let _serial = serial();
    let t0 = Instant::now();
    let c = cluster("two-frontends-unsynced", false);
    let stop = Arc::new(AtomicBool::new(false));
    let mut worst_ramp = 0;
    let held = ramp(&c, &stop, |_, a, b| {
        worst_ramp = worst_ramp.max(request_diff(a, b));
    });
    // Each frontend counts exactly its own requests (local tracking is synchronous with
    // routing), never the other's.
    let (only_a, only_b) = (truth(&held, &[A]), truth(&held, &[B]));
    let (a, b) = wait_for(
        "each view to show its own requests",
        Duration::from_secs(10),
        || {
            let (a, b, _) = sample(&c);
            (a.requests() == only_a && b.requests() == only_b).then_some((a, b))
        },
    );
    let via_a = PLAN.iter().filter(|&&i| i == A).count() as u64;
    assert_eq!((a.total(), b.total()), (via_a, PLAN.len() as u64 - via_a));
    let d = request_diff(&a, &b);
    assert!(
        d >= 2,
        "unsynced views should differ by two somewhere: A {:?} B {:?}",
        a.requests(),
        b.requests()
    );
    eprintln!(
        "replica sync off: largest per-worker difference in tracked requests {worst_ramp} \
         while routing, {d} while held (A {:?}, B {:?})",
        a.requests(),
        b.requests()
    );
    release(&c, held, &stop);
    eprintln!("unsynced test took {:?}", t0.elapsed());
}
