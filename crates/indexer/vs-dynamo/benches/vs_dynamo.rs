//! tandem's index beside Dynamo's (`dynamo-kv-router` 1.6.1), on the very same block events.
//!
//! The events are those of `tandem-indexer`'s `trace_replay` bench (`../benches/common/replay.rs`,
//! included here by path): the conversation trace through one real block pool per worker,
//! twice, with evictions. Each tandem event becomes the Dynamo `RouterEvent` that says the same
//! thing (same worker, event id, parent, sequence and token hashes), converted before any
//! clock starts. Then, for each worker count (`--workers 64,1000`):
//!
//! - apply: block events per second into a fresh index, `--rounds` rounds (median, min–max),
//!   the indexes taken in turn within each round:
//!   - one thread: tandem `KvIndex` (grown from empty, and reserved for the cluster's
//!     capacity), Dynamo `RadixTree` (its single-threaded index) and
//!     `ConcurrentRadixTreeCompressed` behind a `ThreadPoolIndexer` of one thread;
//!   - two threads: tandem `ShardedIndex` of two shards, one writer thread per shard, and
//!     Dynamo's `ThreadPoolIndexer` of two threads (the caller enqueues, its threads apply,
//!     the clock stops at `flush_and_wait`);
//! - memory: heap bytes each index keeps, per resident (block, worker) entry, counted by the
//!   global allocator (Dynamo's events are consumed by its apply, and not counted);
//! - find: the same `--queries` prompts of the trace's last pass asked of every index, the
//!   answers compared worker by worker (a disagreement is a query whose answers differ), and
//!   the latency p50 / p99 of each (tandem's `find_matches`, and `find_extents`, the grouped
//!   answer its router reads).
//!
//! Run (its own workspace, so tandem's build never compiles Dynamo):
//! `cargo bench --manifest-path crates/indexer/vs-dynamo/Cargo.toml` (flags after `--`:
//! `--workers 64,1000`, `--rounds 5`, `--queries 2000`, `--capacity 8192`, `--passes 2`,
//! `--limit REQUESTS`).

use std::alloc::System;
use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData,
};
use dynamo_kv_router::{
    ConcurrentRadixTreeCompressed, LocalBlockHash as DynamoLocal, RadixTree, RouterEvent,
    SyncIndexer, ThreadPoolIndexer,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use tandem_indexer::{ApplyOutcome, KvIndex, ShardedIndex};
use tandem_protocol::{KvEvent, KvEventKind, SequenceHash};
use tandem_workload::{LatencyHistogram, Resolution};

#[path = "../../benches/common/replay.rs"]
mod replay;
use replay::{Batch, ReplayConfig, Workload, generate};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Heap bytes live right now.
fn live() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

struct Opts {
    workers: Vec<u32>,
    rounds: usize,
    queries: usize,
    capacity: u32,
    passes: u64,
    limit: usize,
    trace: String,
}

fn opts() -> Opts {
    let mut o = Opts {
        workers: vec![64, 1000],
        rounds: 5,
        queries: 2000,
        capacity: 8192,
        passes: 2,
        limit: 0,
        trace: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../traces/conversation_trace.jsonl"
        )
        .to_string(),
    };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let val = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--workers" => {
                o.workers = val
                    .split(',')
                    .map(|n| n.parse().expect("--workers N[,N...]"))
                    .collect()
            }
            "--rounds" => o.rounds = val.parse().expect("--rounds N"),
            "--queries" => o.queries = val.parse().expect("--queries N"),
            "--capacity" => o.capacity = val.parse().expect("--capacity BLOCKS"),
            "--passes" => o.passes = val.parse().expect("--passes N"),
            "--limit" => o.limit = val.parse().expect("--limit N"),
            "--trace" => o.trace = val,
            // cargo bench passes `--bench`; ignore flags we do not know.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

/// The Dynamo event that says what `e` says (`dynamo-kv-router` `protocols.rs`: the block's
/// sequence hash is its `block_hash`, its token hash `tokens_hash`; one data-parallel rank).
fn to_dynamo(e: &KvEvent) -> RouterEvent {
    let data = match &e.kind {
        KvEventKind::Stored { parent, blocks } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.0)),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.sequence_hash.0),
                    tokens_hash: DynamoLocal(b.local_hash.0),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        KvEventKind::Removed { blocks } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: blocks
                .iter()
                .map(|h| ExternalSequenceBlockHash(h.0))
                .collect(),
        }),
        KvEventKind::Cleared => KvCacheEventData::Cleared,
    };
    RouterEvent::new(
        e.worker_id.0,
        KvCacheEvent {
            event_id: e.event_id,
            data,
            dp_rank: 0,
        },
    )
}

/// What one apply measured: seconds of wall time and heap bytes the index keeps.
struct Applied<I> {
    secs: f64,
    bytes: i64,
    index: I,
}

fn apply_kv_index(w: &Workload, reserve: Option<usize>) -> Applied<KvIndex> {
    let before = live();
    let mut index = reserve.map_or_else(KvIndex::new, KvIndex::with_capacity);
    let t = Instant::now();
    for e in w.batches.iter().flat_map(|b| &b.events) {
        let out = index.apply(e);
        debug_assert_eq!(out, ApplyOutcome::Applied);
    }
    let secs = t.elapsed().as_secs_f64();
    Applied {
        secs,
        bytes: live() - before,
        index,
    }
}

/// One writer thread per shard, each applying its workers' batches in stream order.
fn apply_sharded(w: &Workload, shards: usize, reserve: Option<usize>) -> Applied<ShardedIndex> {
    let before = live();
    let index = match reserve {
        Some(blocks) => ShardedIndex::with_capacity(shards, blocks),
        None => ShardedIndex::new(shards),
    };
    let mut lanes: Vec<Vec<&Batch>> = vec![Vec::new(); shards];
    for b in &w.batches {
        if let Some(e) = b.events.first() {
            lanes[index.shard_of(e.worker_id)].push(b);
        }
    }
    let t = Instant::now();
    std::thread::scope(|s| {
        for lane in &lanes {
            let index = &index;
            s.spawn(move || {
                for b in lane {
                    let (_, gap) = index.apply_batch(&b.events);
                    debug_assert!(gap.is_none());
                }
            });
        }
    });
    let secs = t.elapsed().as_secs_f64();
    drop(lanes);
    Applied {
        secs,
        bytes: live() - before,
        index,
    }
}

fn apply_radix(events: Converted) -> (Applied<RadixTree>, usize) {
    let before = live() - events.bytes;
    let mut tree = RadixTree::new();
    let mut errors = 0;
    let t = Instant::now();
    for e in events.events {
        errors += usize::from(tree.apply_event(e).is_err());
    }
    let secs = t.elapsed().as_secs_f64();
    let applied = Applied {
        secs,
        bytes: live() - before,
        index: tree,
    };
    (applied, errors)
}

fn apply_pool(
    events: Converted,
    threads: usize,
    rt: &tokio::runtime::Runtime,
) -> Applied<ThreadPoolIndexer<ConcurrentRadixTreeCompressed>> {
    let before = live() - events.bytes;
    let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), threads, 16);
    let t = Instant::now();
    for e in events.events {
        pool.enqueue_event(e).expect("indexer threads run");
    }
    rt.block_on(pool.flush_and_wait()).expect("flushed");
    let secs = t.elapsed().as_secs_f64();
    Applied {
        secs,
        bytes: live() - before,
        index: pool,
    }
}

/// All events in stream order, as Dynamo's, and the heap bytes they hold (their apply
/// consumes them: what is left after it is the index).
struct Converted {
    events: Vec<RouterEvent>,
    bytes: i64,
}

fn convert(w: &Workload) -> Converted {
    let before = live();
    let events: Vec<RouterEvent> = w
        .batches
        .iter()
        .flat_map(|b| &b.events)
        .map(to_dynamo)
        .collect();
    Converted {
        events,
        bytes: live() - before,
    }
}

/// A worker → matched-blocks answer, without zeros, for comparison.
type Answer = BTreeMap<u64, u32>;

fn tandem_answer(index: &KvIndex, q: &[SequenceHash]) -> Answer {
    index
        .find_matches(q)
        .scores
        .iter()
        .filter(|(_, c)| c.total() > 0)
        .map(|(w, c)| (w.0, c.total()))
        .collect()
}

fn dynamo_answer(scores: &dynamo_kv_router::OverlapScores) -> Answer {
    scores
        .scores
        .iter()
        .filter(|&(_, &n)| n > 0)
        .map(|(w, &n)| (w.worker_id, n))
        .collect()
}

/// p50 and p99 in µs of `path` over the queries: three rounds, the last kept (the first ones
/// bring the queries' blocks into cache, as a router's index has the blocks it just saw).
fn time_path(n: usize, mut path: impl FnMut(usize) -> usize) -> (f64, f64) {
    let mut lat = LatencyHistogram::new(Resolution::Nanos);
    for _ in 0..3 {
        lat = LatencyHistogram::new(Resolution::Nanos);
        for i in 0..n {
            let t = Instant::now();
            black_box(path(i));
            lat.record_duration(t.elapsed());
        }
    }
    let us = lat.summary().scaled(1000.0);
    (us.p50, us.p99)
}

fn median_range(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn run(o: &Opts, workers: u32, rt: &tokio::runtime::Runtime) {
    let t = Instant::now();
    let w = generate(&ReplayConfig {
        workers,
        capacity: o.capacity,
        passes: o.passes,
        limit: o.limit,
        trace: o.trace.clone(),
    });
    let reserve = workers as usize * o.capacity as usize;
    println!(
        "\n## {workers} workers x {} blocks, {} passes: {} block events ({} stored, {} removed), generated in {:.1} s\n",
        o.capacity,
        o.passes,
        w.block_events,
        w.stored,
        w.removed,
        t.elapsed().as_secs_f64()
    );
    let names = [
        "tandem KvIndex, grown from empty",
        "tandem KvIndex, reserved as workers join (the frontend)",
        "Dynamo RadixTree",
        "Dynamo ConcurrentRadixTreeCompressed, ThreadPoolIndexer",
        "tandem ShardedIndex, 2 shards, grown from empty",
        "tandem ShardedIndex, 2 shards, reserved",
        "Dynamo ConcurrentRadixTreeCompressed, ThreadPoolIndexer",
    ];
    let threads = [1, 1, 1, 1, 2, 2, 2];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let mut bytes = vec![0i64; names.len()];
    let mut entries = 0usize;
    let mut radix_errors = 0;
    let rate = |secs: f64| w.block_events as f64 / secs / 1e6;
    for round in 0..o.rounds {
        let mut record = |i: usize, secs: f64, b: i64| {
            rates[i].push(rate(secs));
            if round == 0 {
                bytes[i] = b;
            }
        };
        let a = apply_kv_index(&w, None);
        record(0, a.secs, a.bytes);
        entries = a.index.num_entries();
        drop(a);
        let a = apply_kv_index(&w, Some(reserve));
        record(1, a.secs, a.bytes);
        drop(a);
        let (a, errors) = apply_radix(convert(&w));
        record(2, a.secs, a.bytes);
        radix_errors += errors;
        drop(a);
        let a = apply_pool(convert(&w), 1, rt);
        record(3, a.secs, a.bytes);
        drop(a);
        let a = apply_sharded(&w, 2, None);
        record(4, a.secs, a.bytes);
        drop(a);
        let a = apply_sharded(&w, 2, Some(reserve));
        record(5, a.secs, a.bytes);
        drop(a);
        let a = apply_pool(convert(&w), 2, rt);
        record(6, a.secs, a.bytes);
        drop(a);
    }
    assert_eq!(radix_errors, 0, "Dynamo's RadixTree refused events");
    println!(
        "apply ({} rounds; memory: {entries} resident (block, worker) entries, heap per entry counted by the allocator):\n",
        o.rounds
    );
    println!("| index | threads | M block events/s, median | min – max | bytes per entry |");
    println!("|---|---:|---:|---:|---:|");
    let mut medians = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let (m, lo, hi) = median_range(&mut rates[i]);
        medians.push(m);
        println!(
            "| {name} | {} | {m:.2} | {lo:.2} – {hi:.2} | {:.1} |",
            threads[i],
            bytes[i] as f64 / entries as f64
        );
    }
    println!(
        "\nratio, tandem ÷ best Dynamo, medians: 1 thread {:.2}× (grown) / {:.2}× (reserved); 2 threads {:.2}× (grown) / {:.2}× (reserved)",
        medians[0] / medians[2].max(medians[3]),
        medians[1] / medians[2].max(medians[3]),
        medians[4] / medians[6],
        medians[5] / medians[6],
    );

    // Find: every index built once more, the same prompts asked of each.
    let step = (w.prompts.len() / o.queries.max(1)).max(1);
    let prompts: Vec<_> = w.prompts.iter().step_by(step).take(o.queries).collect();
    let seqs: Vec<Vec<SequenceHash>> = prompts
        .iter()
        .map(|p| p.iter().map(|h| h.sequence).collect())
        .collect();
    let locals: Vec<Vec<DynamoLocal>> = prompts
        .iter()
        .map(|p| p.iter().map(|h| DynamoLocal(h.local.0)).collect())
        .collect();
    let tandem = apply_kv_index(&w, None).index;
    let (radix, _) = apply_radix(convert(&w));
    let radix = radix.index;
    let pool = apply_pool(convert(&w), 1, rt).index;
    let (mut radix_differ, mut pool_differ, mut matched) = (0, 0, 0usize);
    for (s, l) in seqs.iter().zip(&locals) {
        let ours = tandem_answer(&tandem, s);
        matched += ours.len();
        radix_differ += usize::from(ours != dynamo_answer(&radix.find_matches(l.clone(), false)));
        pool_differ += usize::from(ours != dynamo_answer(&pool.backend().find_matches(l, false)));
    }
    let n = seqs.len();
    let tm = time_path(n, |i| tandem.find_matches(&seqs[i]).scores.len());
    let te = time_path(n, |i| tandem.find_extents(&seqs[i]).len());
    // RadixTree takes the query by value: the copy is made before the clock starts.
    let mut copies: Vec<Vec<DynamoLocal>> = Vec::new();
    let rm = {
        let mut lat = LatencyHistogram::new(Resolution::Nanos);
        for _ in 0..3 {
            copies.clone_from(&locals);
            lat = LatencyHistogram::new(Resolution::Nanos);
            for q in copies.drain(..) {
                let t = Instant::now();
                black_box(radix.find_matches(q, false).scores.len());
                lat.record_duration(t.elapsed());
            }
        }
        let us = lat.summary().scaled(1000.0);
        (us.p50, us.p99)
    };
    let pm = time_path(n, |i| {
        pool.backend().find_matches(&locals[i], false).scores.len()
    });
    println!(
        "\nfind ({n} prompts of the last pass, {:.1} workers matched on average, {:.0} blocks long on average):\n",
        matched as f64 / n as f64,
        seqs.iter().map(Vec::len).sum::<usize>() as f64 / n as f64
    );
    println!("| query | p50 µs | p99 µs | queries whose answer differs from tandem's |");
    println!("|---|---:|---:|---:|");
    println!(
        "| tandem KvIndex find_matches | {:.2} | {:.2} | |",
        tm.0, tm.1
    );
    println!(
        "| tandem KvIndex find_extents (grouped) | {:.2} | {:.2} | |",
        te.0, te.1
    );
    println!(
        "| Dynamo RadixTree find_matches | {:.2} | {:.2} | {radix_differ} |",
        rm.0, rm.1
    );
    println!(
        "| Dynamo ConcurrentRadixTreeCompressed find_matches | {:.2} | {:.2} | {pool_differ} |",
        pm.0, pm.1
    );
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    println!(
        "tandem-indexer beside dynamo-kv-router 1.6.1 on the conversation trace's block events"
    );
    for &workers in &o.workers {
        run(&o, workers, &rt);
    }
}
