//! `tandem replay`: a Mooncake trace through mocker engines, in virtual time.
//!
//! Every worker is a real `MockEngine` (block pool, scheduler, GPU timing model). Each worker's
//! KV events travel to one global `KvIndex` in the versioned envelope, as they would over the
//! event plane, with gap repair from the worker's ring or a dump. Requests are routed either
//! round-robin or to the worker the index says holds the longest prefix (ties to the least
//! busy). The output compares the two: prefix-cache hit rate, how well the index predicted the
//! engines' cache hits, and time to first token.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;
use tandem_engine::{
    BlockPoolConfig, EngineRequest, ErrorClass, KvShape, MockEngine, MockEngineConfig, MockerConfig,
};
use tandem_indexer::{ApplyOutcome, KvIndex};
use tandem_protocol::hashing::compute_block_hashes;
use tandem_protocol::{BlockSize, Envelope, HashSeed, KvEvent, RequestId, SequenceHash, WorkerId};
use tandem_workload::{TraceRecord, expand_tokens, load_trace};

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Mooncake trace (JSONL).
    #[arg(
        long,
        env = "TANDEM_TRACE",
        default_value = "../shared/traces/conversation_trace.jsonl"
    )]
    trace: PathBuf,
    /// Mocker workers.
    #[arg(long, default_value_t = 8)]
    workers: u32,
    /// Device KV blocks per worker.
    #[arg(long, default_value_t = 16_384)]
    device_blocks: u32,
    /// Host KV blocks per worker (0: no host tier).
    #[arg(long, default_value_t = 0)]
    host_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Replay only the first N requests (0: all).
    #[arg(long, default_value_t = 2_000)]
    limit: usize,
    /// Divide the trace's inter-arrival times by this.
    #[arg(long, default_value_t = 1.0)]
    arrival_speedup: f64,
    /// Which routing to run.
    #[arg(long, value_enum, default_value_t = Routing::Both)]
    routing: Routing,
    /// Write the KV bytes too (slower; the figures do not change).
    #[arg(long)]
    kv_bytes: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Routing {
    RoundRobin,
    KvOverlap,
    Both,
}

/// One policy's figures.
#[derive(Debug, Serialize)]
struct ReplayResult {
    policy: &'static str,
    requests: usize,
    /// Requests refused (longer than a worker's KV memory).
    rejected: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    prefix_hit_rate: f64,
    /// Cached tokens the index predicted for the chosen worker at routing time.
    predicted_cached_tokens: u64,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    ttft_p99_ms: f64,
    e2e_p50_ms: f64,
    e2e_p90_ms: f64,
    preemptions: u64,
    index_entries: usize,
    index_blocks: usize,
    events_applied: u64,
    events_duplicate: u64,
    gaps_repaired: u64,
    virtual_seconds: f64,
}

pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    if !(args.arrival_speedup.is_finite() && args.arrival_speedup > 0.0) {
        bail!("--arrival-speedup must be a positive number");
    }
    let block_size = BlockSize::new(args.block_size).context("--block-size")?;
    let mut trace = load_trace(&args.trace)?;
    if args.limit > 0 {
        trace.truncate(args.limit);
    }
    if trace.is_empty() {
        bail!("the trace {} has no requests", args.trace.display());
    }
    println!(
        "replaying {} requests of {} on {} mocker workers ({} device + {} host blocks of {} tokens each), virtual time",
        trace.len(),
        args.trace.display(),
        args.workers,
        args.device_blocks,
        args.host_blocks,
        block_size.get()
    );
    let policies: &[Policy] = match args.routing {
        Routing::RoundRobin => &[Policy::RoundRobin],
        Routing::KvOverlap => &[Policy::KvOverlap],
        Routing::Both => &[Policy::RoundRobin, Policy::KvOverlap],
    };
    let mut results = Vec::new();
    for &policy in policies {
        results.push(Replay::new(&args, block_size, policy)?.run(&trace)?);
    }
    print_table(&results);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    RoundRobin,
    KvOverlap,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::KvOverlap => "kv-overlap",
        }
    }
}

/// A timed happening in virtual time (microseconds). Ties resolve arrivals first, then by
/// worker, so runs are reproducible.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Happening {
    Arrival(usize),
    StepDone(u32),
}

struct Replay {
    policy: Policy,
    block_size: BlockSize,
    arrival_speedup: f64,
    engines: Vec<MockEngine>,
    busy: Vec<bool>,
    in_flight: Vec<usize>,
    published: Vec<u64>,
    index: KvIndex,
    rr_next: usize,
    stats: Counters,
}

#[derive(Default)]
struct Counters {
    prompt_tokens: u64,
    cached_tokens: u64,
    predicted: u64,
    ttft_ms: Vec<f64>,
    e2e_ms: Vec<f64>,
    arrival_us: Vec<u64>,
    rejected: u64,
    applied: u64,
    duplicate: u64,
    gaps: u64,
    worker_of: Vec<u32>,
}

impl Replay {
    fn new(args: &ReplayArgs, block_size: BlockSize, policy: Policy) -> anyhow::Result<Self> {
        let mut engines = Vec::new();
        for w in 0..args.workers {
            let mut pool = BlockPoolConfig::new(WorkerId(u64::from(w)), args.device_blocks);
            pool.block_size = block_size;
            pool.host_blocks = args.host_blocks;
            let mut cfg = MockEngineConfig::new(pool);
            cfg.mocker = MockerConfig {
                kv_shape: if args.kv_bytes {
                    KvShape::MOCKER_DEFAULT
                } else {
                    KvShape::TIMING_ONLY
                },
                ..MockerConfig::default()
            };
            engines.push(MockEngine::new(cfg)?);
        }
        let n = args.workers as usize;
        Ok(Replay {
            policy,
            block_size,
            arrival_speedup: args.arrival_speedup,
            engines,
            busy: vec![false; n],
            in_flight: vec![0; n],
            published: vec![0; n],
            index: KvIndex::new(),
            rr_next: 0,
            stats: Counters::default(),
        })
    }

    fn run(mut self, trace: &[TraceRecord]) -> anyhow::Result<ReplayResult> {
        let mut queue: BinaryHeap<Reverse<(u64, Happening)>> = BinaryHeap::new();
        for (i, rec) in trace.iter().enumerate() {
            let t = (rec.timestamp as f64 * 1000.0 / self.arrival_speedup).round() as u64;
            queue.push(Reverse((t, Happening::Arrival(i))));
        }
        self.stats.arrival_us = vec![0; trace.len()];
        self.stats.worker_of = vec![0; trace.len()];
        let mut now = 0;
        while let Some(Reverse((t, what))) = queue.pop() {
            now = t;
            let worker = match what {
                Happening::Arrival(i) => self.arrive(i, &trace[i], now)?,
                Happening::StepDone(w) => {
                    self.finish_step(w, now);
                    self.busy[w as usize] = false;
                    w
                }
            };
            self.publish(worker)?;
            if !self.busy[worker as usize]
                && let Some(step) = self.engines[worker as usize].begin_step(now)
            {
                self.busy[worker as usize] = true;
                queue.push(Reverse((
                    now + step.duration_us().max(1),
                    Happening::StepDone(worker),
                )));
            }
        }
        Ok(self.result(trace.len(), now))
    }

    /// Routes and queues one request; returns its worker.
    fn arrive(&mut self, i: usize, rec: &TraceRecord, now: u64) -> anyhow::Result<u32> {
        let tokens = expand_tokens(rec);
        let hashes = compute_block_hashes(&tokens, self.block_size, HashSeed::UNSALTED);
        let seq: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
        let scores = self.index.find_matches(&seq);
        let worker = match self.policy {
            Policy::RoundRobin => {
                let w = self.rr_next;
                self.rr_next = (self.rr_next + 1) % self.engines.len();
                w
            }
            Policy::KvOverlap => (0..self.engines.len())
                .max_by_key(|&w| {
                    let held = scores.get(WorkerId(w as u64)).map_or(0, |c| c.total());
                    (held, Reverse(self.in_flight[w]), Reverse(w))
                })
                .expect("at least one worker"),
        };
        let predicted = scores.get(WorkerId(worker as u64)).map_or(0, |c| c.total());
        // The engine always computes the last prompt token, so it can reuse at most this much.
        let reusable = (tokens.len().saturating_sub(1) / self.block_size.tokens()) as u64;
        let predicted = u64::from(predicted).min(reusable) * self.block_size.get() as u64;
        let prompt_tokens = tokens.len() as u64;
        self.stats.arrival_us[i] = now;
        self.stats.worker_of[i] = worker as u32;
        let req = EngineRequest::new(RequestId(i as u64), tokens, rec.output_length.max(1));
        match self.engines[worker].add_request(req, now) {
            Ok(()) => {
                self.in_flight[worker] += 1;
                self.stats.predicted += predicted;
                self.stats.prompt_tokens += prompt_tokens;
            }
            // Too long for a worker's KV memory: refused, as the frontend would with a 4xx.
            Err(e) if e.class() == ErrorClass::InvalidRequest => self.stats.rejected += 1,
            Err(e) => return Err(e).with_context(|| format!("request {i}")),
        }
        Ok(worker as u32)
    }

    fn finish_step(&mut self, w: u32, now: u64) {
        for out in self.engines[w as usize].finish_step(now) {
            let i = out.id.0 as usize;
            if out.first_token {
                self.stats.cached_tokens += out.cached_tokens as u64;
                self.stats
                    .ttft_ms
                    .push((now - self.stats.arrival_us[i]) as f64 / 1000.0);
            }
            if out.finish.is_some() {
                self.stats
                    .e2e_ms
                    .push((now - self.stats.arrival_us[i]) as f64 / 1000.0);
                self.in_flight[w as usize] -= 1;
            }
        }
    }

    /// Moves a worker's new KV events into the index through the wire envelope, repairing a
    /// gap from the worker's ring or with a dump.
    fn publish(&mut self, w: u32) -> anyhow::Result<()> {
        let engine = &self.engines[w as usize];
        let events = match engine.events_since(self.published[w as usize]) {
            Ok(ev) => ev,
            Err(_) => {
                let dump = engine.dump();
                self.index.replace_worker(&dump)?;
                self.stats.gaps += 1;
                self.published[w as usize] = dump.last_event_id;
                return Ok(());
            }
        };
        if events.is_empty() {
            return Ok(());
        }
        let wire = events.encode()?;
        let events = Vec::<KvEvent>::decode(&wire)?;
        for ev in &events {
            match self.index.apply(ev) {
                ApplyOutcome::Applied => self.stats.applied += 1,
                ApplyOutcome::Duplicate => self.stats.duplicate += 1,
                ApplyOutcome::Gap { expected, got } => {
                    bail!("worker {w}: gap in a contiguous batch (expected {expected}, got {got})")
                }
            }
        }
        self.published[w as usize] = events.last().map_or(0, |e| e.event_id);
        Ok(())
    }

    fn result(mut self, requests: usize, end_us: u64) -> ReplayResult {
        let s = &mut self.stats;
        let preemptions = self.engines.iter().map(|e| e.stats().preemptions).sum();
        ReplayResult {
            policy: self.policy.name(),
            requests,
            rejected: s.rejected,
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            prefix_hit_rate: s.cached_tokens as f64 / s.prompt_tokens.max(1) as f64,
            predicted_cached_tokens: s.predicted,
            ttft_p50_ms: percentile(&mut s.ttft_ms, 0.50),
            ttft_p90_ms: percentile(&mut s.ttft_ms, 0.90),
            ttft_p99_ms: percentile(&mut s.ttft_ms, 0.99),
            e2e_p50_ms: percentile(&mut s.e2e_ms, 0.50),
            e2e_p90_ms: percentile(&mut s.e2e_ms, 0.90),
            preemptions,
            index_entries: self.index.num_entries(),
            index_blocks: self.index.num_blocks(),
            events_applied: s.applied,
            events_duplicate: s.duplicate,
            gaps_repaired: s.gaps,
            virtual_seconds: end_us as f64 / 1e6,
        }
    }
}

/// Nearest-rank percentile; 0 for no samples.
fn percentile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len());
    xs[rank - 1]
}

fn print_table(results: &[ReplayResult]) {
    println!();
    println!(
        "| policy | rejected | hit rate | index-predicted hits | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | preemptions | index entries | events applied |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in results {
        println!(
            "| {} | {} | {:.1} % | {:.1} % | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} |",
            r.policy,
            r.rejected,
            100.0 * r.prefix_hit_rate,
            100.0 * r.predicted_cached_tokens as f64 / r.prompt_tokens.max(1) as f64,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.ttft_p99_ms,
            r.e2e_p50_ms,
            r.preemptions,
            r.index_entries,
            r.events_applied,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let mut xs = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&mut xs, 0.5), 3.0);
        assert_eq!(percentile(&mut xs, 0.9), 5.0);
        assert_eq!(percentile(&mut xs, 0.0), 1.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }
}
