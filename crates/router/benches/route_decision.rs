//! One routing decision, end to end as the frontend makes it: hash a 4,096-token prompt
//! (256 blocks of 16), `find_matches` in the global index, build the 64 candidates' views
//! from the index and the active-sequence tracker, score them with the `kv` policy, and
//! record the request in the tracker. Reports per-decision latency percentiles.
//!
//! State: 64 workers; 512 conversations, each a 32-block system prompt shared by all plus 224
//! blocks of its own history, cached on the worker it lives on (and the system prompt
//! everywhere); 256 requests in flight in the tracker. Each query is one conversation's
//! 4,096-token prompt: all its 256 blocks are cached on one worker, its first 32 on every
//! worker.
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
use tandem_router::{
    ActiveSequences, NewSequence, PolicyConfig, PolicyKind, Rng, RouteRequest, Router,
    RouterConfig, RouterId, TrackerConfig, WorkerView,
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

fn store(index: &mut KvIndex, worker: WorkerId, hashes: &[SequenceHash]) {
    let ev = KvEvent {
        worker_id: worker,
        event_id: index.last_event_id(worker).unwrap_or(0) + 1,
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
    };
    index.apply(&ev);
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

fn main() {
    let bs = BlockSize::DEFAULT;
    let seed = HashSeed::UNSALTED;
    let prompts: Vec<Vec<u32>> = (0..CONVERSATIONS).map(conversation).collect();
    let mut index = KvIndex::new();
    for (c, p) in prompts.iter().enumerate() {
        let hs: Vec<SequenceHash> = compute_block_hashes(p, bs, seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        store(&mut index, WorkerId(c as u64 % WORKERS), &hs);
    }
    for w in 0..WORKERS {
        let hs: Vec<SequenceHash> = compute_block_hashes(&prompts[0][..512], bs, seed)
            .iter()
            .map(|h| h.sequence)
            .collect();
        store(&mut index, WorkerId(w), &hs);
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
    let rounds = 20_000u64;
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
    let us = lat.summary().scaled(1000.0);
    println!(
        "route decision ({} workers, {}-token prompt, kv policy, {} in flight): p50 {:.2} µs, p90 {:.2} µs, p99 {:.2} µs, max {:.1} µs over {} decisions; {:.1} % routed to the worker holding the whole prompt",
        WORKERS,
        PROMPT_TOKENS,
        IN_FLIGHT,
        us.p50,
        us.p90,
        us.p99,
        us.max,
        us.count,
        100.0 * hits as f64 / rounds as f64
    );
}
