//! The index at cluster scale, on a real trace.
//!
//! Replays `traces/conversation_trace.jsonl` (each 512-token hash id expanded to 32
//! blocks of 16 tokens) through 1,000 real block pools of bounded capacity, each request routed
//! to a worker by its conversation (the trace's second hash id), `--passes` times with a
//! different cache salt per pass, so that the pools evict and the event stream holds both
//! stored and removed blocks. Then it measures, on one core:
//! - apply: block events per second into a fresh `KvIndex` (by wall time, and by the thread's
//!   CPU time, the machine being shared);
//! - memory: heap bytes per resident (block, worker) entry, counted by the global allocator;
//! - find_matches against find_extents latency (p50/p99/max) on the same queries: prompts cut
//!   to 256, 1,024 and 8,192 blocks (999 of the 1,000 workers match), and the 256-block ones
//!   without their shared first 32 blocks (one or two match);
//! - concurrency: find_matches latency while a writer applies the stream, `ShardedIndex` with
//!   1 shard against 16.
//!
//! Run: `cargo bench -p tandem-indexer --bench trace_replay` (flags after `--`: `--workers N`,
//! `--capacity BLOCKS`, `--passes N`, `--limit REQUESTS`, `--trace PATH`, `--only
//! apply,grown,queries,concurrent` to run some phases, `--apply-rounds N` to repeat the
//! reserved apply).

use std::alloc::System;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tandem_indexer::{ApplyOutcome, KvIndex, ShardedIndex};
use tandem_protocol::SequenceHash;
use tandem_workload::{LatencyHistogram, Resolution};
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[path = "common/replay.rs"]
mod replay;
use replay::{ReplayConfig, Workload, generate};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

struct Opts {
    workers: u32,
    capacity: u32,
    passes: u64,
    limit: usize,
    trace: String,
    /// Phases to run (`--only apply,grown,queries,concurrent`); all by default.
    only: Vec<String>,
    /// Extra timed applies into fresh reserved indexes after the measured one
    /// (`--apply-rounds N`), for a range within one run and for profiling.
    apply_rounds: u32,
}

impl Opts {
    fn runs(&self, phase: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == phase)
    }
}

fn opts() -> Opts {
    let mut o = Opts {
        workers: 1000,
        capacity: 8192,
        passes: 2,
        limit: 0,
        trace: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../traces/conversation_trace.jsonl"
        )
        .to_string(),
        only: Vec::new(),
        apply_rounds: 0,
    };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let val = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--workers" => o.workers = val.parse().expect("--workers N"),
            "--capacity" => o.capacity = val.parse().expect("--capacity BLOCKS"),
            "--passes" => o.passes = val.parse().expect("--passes N"),
            "--limit" => o.limit = val.parse().expect("--limit N"),
            "--trace" => o.trace = val,
            "--only" => o.only = val.split(',').map(str::to_string).collect(),
            "--apply-rounds" => o.apply_rounds = val.parse().expect("--apply-rounds N"),
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

/// The machine's latency for a load that misses every cache and the TLB: a dependent walk
/// over a random cycle through 256 MiB (what a cold block-map lookup pays), in ns.
fn miss_latency() -> f64 {
    let n: usize = 1 << 26;
    let mut next: Vec<u32> = (0..n as u32).collect();
    // Sattolo's shuffle: one cycle through every entry.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        next.swap(i, (x % i as u64) as usize);
    }
    let steps = 2_000_000;
    let (mut p, t) = (0usize, Instant::now());
    for _ in 0..steps {
        p = next[p] as usize;
    }
    black_box(p);
    t.elapsed().as_secs_f64() * 1e9 / steps as f64
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Latency percentiles of one query path, in microseconds, and what it answered per query.
struct Timed {
    p50: f64,
    p99: f64,
    max: f64,
    /// Mean of the path's answer size (workers matched, or groups).
    answer: f64,
}

/// A query path under test: returns the size of its answer.
type QueryFn<'a> = &'a dyn Fn(&[SequenceHash]) -> usize;

/// Times several query paths on the same queries: `rounds` rounds, each running every path
/// over all queries in turn, and the last round kept (the first ones warm the scratch buffers
/// and bring the queries' blocks into the last-level cache, as the same prompts' blocks are
/// for a router that just saw their events). Paths do not run query by query in turn: the
/// second would find the first one's blocks in L1. Each query's own hashes are read just
/// before it is timed, as a router has them in cache, having just computed them.
fn time_paths(queries: &[Vec<SequenceHash>], paths: &[QueryFn<'_>]) -> Vec<Timed> {
    // A benchmark knob, read by the benchmark itself (not by library code).
    #[allow(clippy::disallowed_methods)]
    let rounds = std::env::var("TANDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let mut lat: Vec<LatencyHistogram> = Vec::new();
    let mut answer = vec![0usize; paths.len()];
    for _ in 0..rounds {
        lat = paths
            .iter()
            .map(|_| LatencyHistogram::new(Resolution::Nanos))
            .collect();
        answer.fill(0);
        for (p, path) in paths.iter().enumerate() {
            for q in queries {
                // A router hashes the prompt just before it asks: the query is in cache.
                black_box(q.iter().fold(0, |acc, h| acc ^ h.0));
                let t = Instant::now();
                let n = black_box(path(black_box(q)));
                lat[p].record_duration(t.elapsed());
                answer[p] += n;
            }
        }
    }
    lat.iter()
        .zip(answer)
        .map(|(l, a)| {
            let us = l.summary().scaled(1000.0);
            Timed {
                p50: us.p50,
                p99: us.p99,
                max: us.max,
                answer: a as f64 / queries.len().max(1) as f64,
            }
        })
        .collect()
}

/// find_matches against find_extents (building the grouped answer, and building it then
/// walking every member as a scorer that visits all matched workers would), one table row.
fn compare_queries(index: &KvIndex, label: &str, qs: &[Vec<SequenceHash>]) {
    let matches = |q: &[SequenceHash]| index.find_matches(q).len();
    let extents = |q: &[SequenceHash]| index.find_extents(q).len();
    let walked = |q: &[SequenceHash]| {
        let e = index.find_extents(q);
        e.iter()
            .map(|g| g.workers().fold(0u64, |acc, w| acc ^ w.0) as usize & 1)
            .sum::<usize>()
            + e.len()
    };
    let t = time_paths(qs, &[&matches, &extents, &walked]);
    println!(
        "| {label} | {} | {:.1} | {:.1} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.1}× / {:.1}× | {:.1} / {:.1} |",
        qs.len(),
        t[0].answer,
        t[1].answer,
        t[0].p50,
        t[0].p99,
        t[1].p50,
        t[1].p99,
        t[2].p50,
        t[2].p99,
        t[0].p50 / t[1].p50,
        t[0].p99 / t[1].p99,
        t[0].max,
        t[1].max,
    );
}

/// Queries of exactly `n` blocks: prompts of at least `min` blocks, cut to `n`, or extended
/// with blocks nobody holds (a long prompt whose tail is new).
fn queries(
    prompts: &[Vec<SequenceHash>],
    n: usize,
    min: usize,
    max_queries: usize,
) -> Vec<Vec<SequenceHash>> {
    let mut out: Vec<Vec<SequenceHash>> = prompts
        .iter()
        .filter(|p| p.len() >= min)
        .map(|p| {
            let mut q: Vec<SequenceHash> = p.iter().take(n).copied().collect();
            let mut fresh = 0u64;
            while q.len() < n {
                fresh += 1;
                q.push(SequenceHash(xxh3_64_with_seed(
                    &fresh.to_le_bytes(),
                    q.len() as u64 ^ 0xfeed,
                )));
            }
            q
        })
        .collect();
    // Spread the sample over the whole trace.
    if out.len() > max_queries {
        let step = out.len() / max_queries;
        out = out.into_iter().step_by(step).take(max_queries).collect();
    }
    out
}

/// A writer applies the second half of the stream while a reader queries (the first half is
/// loaded beforehand, so the reader works on a populated index). The writer runs flat out
/// (`rate` = None) or paced to `rate` block events per second, as a cluster's event plane
/// delivers them. Returns the writer's achieved rate and the reader's p50/p99 in µs.
fn concurrent(
    workload: &Workload,
    shards: usize,
    rate: Option<f64>,
    qs: &[Vec<SequenceHash>],
) -> (f64, f64, f64) {
    let index = ShardedIndex::new(shards);
    let (before, during) = workload.batches.split_at(workload.batches.len() / 2);
    for b in before {
        assert!(
            index.apply_batch(&b.events).1.is_none(),
            "contiguous stream"
        );
    }
    // Paced runs stop after 2 s of writing: enough samples, bounded time.
    let budget = std::time::Duration::from_secs(2);
    let done = AtomicBool::new(false);
    let mut lat = LatencyHistogram::new(Resolution::Nanos);
    let mut written = (0u64, 0.0);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let t = Instant::now();
            let mut n = 0u64;
            for b in during {
                let (_, gap) = index.apply_batch(&b.events);
                assert!(gap.is_none(), "contiguous stream");
                n += b.events.iter().map(|e| e.block_count() as u64).sum::<u64>();
                if let Some(rate) = rate {
                    let due = std::time::Duration::from_secs_f64(n as f64 / rate);
                    if let Some(ahead) = due.checked_sub(t.elapsed()) {
                        std::thread::sleep(ahead);
                    }
                    if t.elapsed() > budget {
                        break;
                    }
                }
            }
            done.store(true, Ordering::Release);
            (n, t.elapsed().as_secs_f64())
        });
        let mut i = 0;
        while !done.load(Ordering::Acquire) {
            let t = Instant::now();
            black_box(index.find_matches(&qs[i % qs.len()]));
            lat.record_duration(t.elapsed());
            i += 1;
        }
        written = writer.join().expect("writer");
    });
    let us = lat.summary().scaled(1000.0);
    (written.0 as f64 / written.1 / 1e6, us.p50, us.p99)
}

fn main() {
    let o = opts();
    let t = Instant::now();
    let w = generate(&ReplayConfig {
        workers: o.workers,
        capacity: o.capacity,
        passes: o.passes,
        limit: o.limit,
        trace: o.trace.clone(),
    });
    let prompts: Vec<Vec<SequenceHash>> = w
        .prompts
        .iter()
        .map(|p| p.iter().map(|h| h.sequence).collect())
        .collect();
    println!(
        "workload: {} workers x {} blocks, {} passes: {} batches, {} events, {} block events ({} stored, {} removed), generated in {:.1} s",
        o.workers,
        o.capacity,
        o.passes,
        w.batches.len(),
        w.batches.iter().map(|b| b.events.len()).sum::<usize>(),
        w.block_events,
        w.stored,
        w.removed,
        t.elapsed().as_secs_f64()
    );

    // Apply, single-threaded, into an index reserved for the cluster's capacity (as a
    // frontend does from the worker records), and into one that grows as it goes.
    // Wall time is what counts, but this machine is shared: the thread's CPU time is also
    // recorded (it leaves out the time the thread waited for a core, not cache interference).
    let cpu_secs = std::cell::Cell::new(0.0);
    let apply_all = |index: &mut KvIndex| {
        let (t, c) = (Instant::now(), thread_cpu());
        for b in &w.batches {
            for e in &b.events {
                let out = index.apply(e);
                debug_assert_eq!(out, ApplyOutcome::Applied);
            }
        }
        cpu_secs.set(thread_cpu() - c);
        t.elapsed().as_secs_f64()
    };
    let grown_secs = if o.runs("grown") {
        let mut grown = KvIndex::new();
        apply_all(&mut grown)
    } else {
        f64::NAN
    };
    // With the allocator counting what the index keeps.
    let region = Region::new(GLOBAL);
    let mut index = KvIndex::with_capacity(o.workers as usize * o.capacity as usize);
    let secs = apply_all(&mut index);
    let cpu = cpu_secs.get();
    let stats = region.change();
    // stats_alloc already books a realloc's growth in bytes_allocated (and its shrinkage in
    // bytes_deallocated); bytes_reallocated repeats it, so it is not added here.
    let live = stats.bytes_allocated as i64 - stats.bytes_deallocated as i64;
    let entries = index.num_entries();
    let rate = |s: f64| w.block_events as f64 / s / 1e6;
    println!(
        "apply: {:.2} M block events/s ({:.2} by CPU time) into an index reserved for the cluster's capacity, {:.2} M/s into one grown from empty ({} events)",
        rate(secs),
        rate(cpu),
        rate(grown_secs),
        w.block_events,
    );
    println!(
        "memory: {} resident (block, worker) entries over {} blocks; {:.1} bytes/entry counted by the allocator, {:.1} bytes/entry by heap_bytes()",
        entries,
        index.num_blocks(),
        live as f64 / entries as f64,
        index.heap_bytes() as f64 / entries as f64
    );
    let mut rates = Vec::new();
    for _ in 0..o.apply_rounds {
        let mut again = KvIndex::with_capacity(o.workers as usize * o.capacity as usize);
        let secs = apply_all(&mut again);
        rates.push(format!("{:.2} ({:.2})", rate(secs), rate(cpu_secs.get())));
    }
    if !rates.is_empty() {
        println!(
            "apply again, reserved: {} M/s (by CPU time)",
            rates.join(", ")
        );
    }

    let q256 = queries(&prompts, 256, 1, 4000);
    let q1k = queries(&prompts, 1024, 1024, 2000);
    let q8k = queries(&prompts, 8192, 4096, 500);
    if !o.runs("queries") {
        return;
    }
    println!(
        "memory: a load that misses cache and TLB (dependent walk over 256 MiB) takes {:.0} ns",
        miss_latency()
    );
    // The same prompts without their first 32 blocks (the trace's shared first hash id): a
    // query whose first block is held only by the workers of its conversation, the case where
    // few workers match.
    let few: Vec<Vec<SequenceHash>> = q256
        .iter()
        .filter(|q| q.len() > 64)
        .map(|q| q[32..].to_vec())
        .collect();
    println!(
        "| prompt blocks | queries | workers matched | groups | find_matches p50 / p99 µs | find_extents p50 / p99 µs | find_extents + walk every member p50 / p99 µs | find_matches ÷ find_extents p50 / p99 | max µs (matches / extents) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (label, qs) in [
        ("256", &q256),
        ("1,024", &q1k),
        ("8,192", &q8k),
        ("224 (first 32 dropped)", &few),
    ] {
        compare_queries(&index, label, qs);
    }

    if !o.runs("concurrent") {
        return;
    }
    println!("| shards | writer | writer M block events/s | reader find_matches p50 µs | p99 µs |");
    println!("|---:|---|---:|---:|---:|");
    for shards in [1, 16] {
        for (label, rate) in [("paced 1 M/s", Some(1e6)), ("flat out", None)] {
            let (r, p50, p99) = concurrent(&w, shards, rate, &q256);
            println!("| {shards} | {label} | {r:.2} | {p50:.2} | {p99:.2} |");
        }
    }
}
