//! One routing decision, end to end as the frontend makes it: hash a 4,096-token prompt
//! (256 blocks of 16), `find_matches` in the global index, build the 64 candidates' views
//! from the index and the active-sequence tracker, score them with the `kv` policy, and
//! record the request in the tracker. Reports per-decision latency percentiles, twice in one
//! run: over the bare pieces (index, tracker, `Router`), and through `RoutingReplica::route`,
//! the path the frontend and the simulator take (its candidate views, warm-up and busy rules,
//! the prefill part of the plan, the sync messages), in alternating passes so that the two
//! figures compare within one run.
//!
//! State: 64 workers; 512 conversations, each a 32-block system prompt shared by all plus 224
//! blocks of its own history, cached on the worker it lives on (and the system prompt on the
//! first 64 workers: every worker at 64); 256 requests in flight in the tracker. Each query
//! is one conversation's 4,096-token prompt: all its 256 blocks are cached on one worker, its
//! first 32 on 64 workers. The replica path is timed at 64, 1,000 and 10,000 workers: all but
//! at most 576 of them hold nothing of any prompt.
//!
//! Run: `cargo bench -p tandem-router --bench route_decision`.

use std::hint::black_box;
use std::time::Instant;

use tandem_indexer::{KvIndex, OverlapScores, TierCounts};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{
    BlockSize, HashSeed, KvEvent, KvEventKind, RequestId, SequenceHash, StorageTier, StoredBlock,
    WorkerId,
};
use tandem_protocol::{KvDump, WorkerRole};
use tandem_router::{
    ActiveSequences, Input, KvSource, NewSequence, PolicyConfig, PolicyKind, RepairReply,
    ReplicaConfig, Rng, RouteInput, RouteRequest, Router, RouterConfig, RouterId, RoutingConfig,
    RoutingReplica, TrackerConfig, WorkerView,
};
use tandem_workload::{LatencyHistogram, Resolution};

const WORKERS: u64 = 64;
const CONVERSATIONS: u32 = 512;
const PROMPT_TOKENS: u32 = 4096;
const IN_FLIGHT: usize = 256;

fn conversation(c: u32) -> Vec<u32> {
    // 512 shared tokens (32 blocks), then the conversation's own.
    (0..PROMPT_TOKENS)
        .map(|i| {
            if i < 512 {
                i
            } else {
                1_000_000 + c * 10_000 + i
            }
        })
        .collect()
}

fn stored(worker: WorkerId, event_id: u64, hashes: &[SequenceHash]) -> KvEvent {
    KvEvent {
        worker_id: worker,
        event_id,
        tier: StorageTier::Device,
        kind: KvEventKind::Stored {
            parent: None,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    sequence_hash: h,
                    local_hash: tandem_protocol::LocalBlockHash(h.0),
                })
                .collect(),
        },
    }
}

/// Every conversation cached on its worker, the shared system prompt on the first 64
/// workers (all of them at 64), as the (worker, sequence hashes) of each store, in order.
fn stores(prompts: &[Vec<u32>], workers: u64) -> Vec<(WorkerId, Vec<SequenceHash>)> {
    let (bs, seed) = (BlockSize::DEFAULT, HashSeed::UNSALTED);
    let hashes = |t: &[u32]| -> Vec<SequenceHash> {
        compute_block_hashes(t, bs, seed)
            .iter()
            .map(|h| h.sequence)
            .collect()
    };
    let mut out: Vec<_> = (0..prompts.len())
        .map(|c| (WorkerId(c as u64 % workers), hashes(&prompts[c])))
        .collect();
    out.extend((0..workers.min(64)).map(|w| (WorkerId(w), hashes(&prompts[0][..512]))));
    out
}

fn views(scores: &OverlapScores, tracker: &ActiveSequences, out: &mut Vec<WorkerView>) {
    out.clear();
    // Both sides are sorted by worker id: a merge, not a lookup per worker.
    let mut it = scores.iter().peekable();
    for w in 0..WORKERS {
        let id = WorkerId(w);
        let mut overlap = TierCounts::default();
        while let Some(&&(sid, c)) = it.peek() {
            if sid < id {
                it.next();
            } else {
                if sid == id {
                    overlap = c;
                }
                break;
            }
        }
        let mut v = WorkerView::new(id, tracker.load(id).to_worker_load());
        v.overlap = overlap;
        out.push(v);
    }
}

/// Decisions over the bare pieces; returns the timed ones' histogram and the whole-prompt hits.
fn bare(prompts: &[Vec<u32>], rounds: u64) -> (LatencyHistogram, u64) {
    let bs = BlockSize::DEFAULT;
    let seed = HashSeed::UNSALTED;
    let mut index = KvIndex::new();
    for (w, hs) in stores(prompts, WORKERS) {
        let id = index.last_event_id(w).unwrap_or(0) + 1;
        index.apply(&stored(w, id, &hs));
    }
    let mut router = Router::new(RouterConfig {
        policy: PolicyConfig::new(PolicyKind::Kv),
        pool: Default::default(),
    })
    .expect("router");
    let mut tracker = ActiveSequences::new(RouterId(1), TrackerConfig::default());
    let mut rng = Rng::seed_from_u64(7);
    let mut buf = Vec::with_capacity(WORKERS as usize);
    let mut lat = LatencyHistogram::new(Resolution::Nanos);
    let mut hits = 0u64;
    for i in 0..rounds {
        let tokens = &prompts[(i as usize * 7919) % prompts.len()];
        let t = Instant::now();
        let hashes = compute_block_hashes(tokens, bs, seed);
        let seq: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
        let req = RouteRequest::from_tokens(tokens, bs, seed);
        let scores = index.find_matches(&seq);
        views(&scores, &tracker, &mut buf);
        let d = router.select(&req, &buf, &mut rng).expect("decision");
        let cached = buf
            .iter()
            .find(|v| v.id == d.worker)
            .map_or(0, |v| v.overlap.total());
        let prefill = u64::from(PROMPT_TOKENS) - u64::from(cached) * 16;
        tracker.add(
            NewSequence {
                request: RequestId(i),
                worker: d.worker,
                blocks: seq,
                prefill_tokens: prefill,
                private_blocks: NewSequence::private_blocks_for(u64::from(PROMPT_TOKENS), 128, bs),
            },
            i,
        );
        let elapsed = t.elapsed();
        black_box(&d);
        if cached as usize == hashes.len() {
            hits += 1;
        }
        // Steady state: the request routed IN_FLIGHT decisions ago ends (not timed).
        if let Some(old) = i.checked_sub(IN_FLIGHT as u64) {
            tracker.free(RequestId(old), i);
        }
        if i >= 1000 {
            lat.record_duration(elapsed);
        }
    }
    (lat, hits)
}

/// The same decisions through the routing replica, over `workers` workers.
/// `full_scan`: score every worker on every decision, as before the shortcut (a busy
/// threshold no worker reaches turns it off without changing any decision).
fn replica(
    prompts: &[Vec<u32>],
    rounds: u64,
    workers: u64,
    full_scan: bool,
) -> (LatencyHistogram, u64) {
    let (bs, seed) = (BlockSize::DEFAULT, HashSeed::UNSALTED);
    let mut routing = RoutingConfig::default();
    if full_scan {
        routing.pool.busy_prefill_tokens = Some(u64::MAX);
    }
    let mut r = RoutingReplica::new(ReplicaConfig {
        router_id: RouterId(1),
        seed: 7,
        routing,
    })
    .expect("replica");
    for w in 0..workers {
        let worker = WorkerId(w);
        let role = WorkerRole::Aggregated;
        r.apply(
            Input::Joined {
                worker,
                role,
                kv: KvSource::Events,
                device_blocks: 0,
            },
            0,
        )
        .expect("join");
        let reply = RepairReply::Dump(KvDump {
            worker_id: worker,
            last_event_id: 0,
            events: vec![],
        });
        r.apply(Input::Repaired { worker, reply }, 0).expect("dump");
    }
    for (w, hs) in stores(prompts, workers) {
        let id = r.feed().index().last_event_id(w).unwrap_or(0) + 1;
        r.apply(Input::KvEvents(&[stored(w, id, &hs)]), 0)
            .expect("events");
    }
    let mut lat = LatencyHistogram::new(Resolution::Nanos);
    let mut hits = 0u64;
    let mut flights = std::collections::VecDeque::new();
    let mut scored = 0usize;
    for i in 0..rounds {
        let tokens = &prompts[(i as usize * 7919) % prompts.len()];
        let t = Instant::now();
        let hashes: Vec<SequenceHash> = compute_block_hashes(tokens, bs, seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        let input = RouteInput {
            request: RequestId(i),
            route: RouteRequest::from_tokens(tokens, bs, seed),
            hashes: &hashes,
            expected_output_tokens: 128,
            overlap: None,
            session: None,
        };
        let plan = r.route(&input, &[], i).expect("plan");
        let elapsed = t.elapsed();
        scored += plan.decision.decode.explain.len();
        let cached = plan
            .decision
            .decode
            .chosen_terms()
            .map_or(0, |t| t.overlap.total());
        if cached as usize == hashes.len() {
            hits += 1;
        }
        flights.push_back(plan.flight);
        black_box(&plan.sync);
        if flights.len() > IN_FLIGHT
            && let Some(old) = flights.pop_front()
        {
            r.finish(old, i);
        }
        if i >= 1000 {
            lat.record_duration(elapsed);
        }
    }
    eprintln!(
        "    ({workers} workers: {:.1} candidates scored per decision)",
        scored as f64 / rounds as f64
    );
    (lat, hits)
}

/// The pauses this machine takes from a thread that never yields (interrupts, a virtual
/// machine's host): spins for `secs` reading the clock and counts the gaps over 5 µs. A
/// decision of `t` µs meets one with a probability of about `t` × the rate, which sets a
/// floor under the tail percentiles whatever the code does.
fn pauses(secs: f64) -> (f64, f64) {
    let (start, mut prev) = (Instant::now(), Instant::now());
    let (mut n, mut total) = (0u64, 0f64);
    while start.elapsed().as_secs_f64() < secs {
        let now = Instant::now();
        let gap = now.duration_since(prev).as_secs_f64() * 1e6;
        if gap > 5.0 {
            n += 1;
            total += gap;
        }
        prev = now;
    }
    (n as f64 / secs, if n > 0 { total / n as f64 } else { 0.0 })
}

fn main() {
    let (rate, mean) = pauses(1.0);
    println!(
        "this machine: {rate:.0} pauses over 5 µs a second, {mean:.1} µs on average (a decision of 30 µs meets one {:.1} % of the time)",
        100.0 * rate * 30e-6
    );
    let prompts: Vec<Vec<u32>> = (0..CONVERSATIONS).map(conversation).collect();
    let rounds = 20_000u64;
    let report = |pass: u32, what: &str, workers: u64, (lat, hits): (LatencyHistogram, u64)| {
        let us = lat.summary().scaled(1000.0);
        println!(
            "pass {pass}, {what} ({workers} workers, {PROMPT_TOKENS}-token prompt, kv policy, {IN_FLIGHT} in flight): p50 {:.2} µs, p90 {:.2} µs, p99 {:.2} µs, max {:.1} µs over {} decisions; {:.1} % routed to the worker holding the whole prompt",
            us.p50,
            us.p90,
            us.p99,
            us.max,
            us.count,
            100.0 * hits as f64 / rounds as f64
        );
    };
    // `cargo bench … -- 1000 no-full-scan` times one pool size only and skips the full-scan
    // passes (for a profile).
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut sizes: Vec<u64> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![WORKERS, 1_000, 10_000];
    }
    let full_scan = !args.iter().any(|a| a == "no-full-scan");
    for pass in 1..=2 {
        report(pass, "bare pieces", WORKERS, bare(&prompts, rounds));
        for &workers in &sizes {
            let r = replica(&prompts, rounds, workers, false);
            report(pass, "RoutingReplica::route", workers, r);
            if full_scan {
                let r = replica(&prompts, rounds, workers, true);
                report(pass, "RoutingReplica::route, full scan", workers, r);
            }
        }
    }
}
