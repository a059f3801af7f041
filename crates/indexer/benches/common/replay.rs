//! The event stream of the conversation trace at cluster scale, shared by `trace_replay.rs`
//! and the side-by-side bench against Dynamo's indexes (`../../vs-dynamo`), which include
//! this file by path so that both measure the very same events.
//!
//! Each request of `traces/conversation_trace.jsonl` (each 512-token hash id expanded to 32
//! blocks of 16 tokens) goes through the real block pool of one worker, chosen by its
//! conversation (the trace's second hash id), `passes` times with a different cache salt per
//! pass, so that the pools evict and the stream holds both stored and removed blocks.

use tandem_engine::{BlockPool, BlockPoolConfig};
use tandem_protocol::hashing::{BlockHashes, compute_block_hashes};
use tandem_protocol::{BlockSize, HashSeed, KvEvent, KvEventKind, RequestId, WorkerId};
use tandem_workload::{expand_tokens, load_trace};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What to replay.
pub struct ReplayConfig {
    pub workers: u32,
    /// Device blocks per worker's pool.
    pub capacity: u32,
    pub passes: u64,
    /// Requests of the trace to use (0: all).
    pub limit: usize,
    pub trace: String,
}

/// One request's events, all from one worker.
pub struct Batch {
    pub events: Vec<KvEvent>,
}

pub struct Workload {
    pub batches: Vec<Batch>,
    pub block_events: u64,
    pub stored: u64,
    pub removed: u64,
    /// Prompts of the last pass, both hashes of every block.
    pub prompts: Vec<Vec<BlockHashes>>,
}

/// Runs the trace through the pools and collects their events.
pub fn generate(o: &ReplayConfig) -> Workload {
    let mut trace = load_trace(&o.trace).expect("trace");
    if o.limit > 0 {
        trace.truncate(o.limit);
    }
    let bs = BlockSize::DEFAULT;
    let mut pools: Vec<BlockPool> = (0..o.workers)
        .map(|w| {
            let mut cfg = BlockPoolConfig::new(WorkerId(u64::from(w)), o.capacity);
            cfg.event_ring = 1 << 16;
            BlockPool::new(cfg).expect("pool")
        })
        .collect();
    let mut taken = vec![0u64; o.workers as usize];
    let mut w = Workload {
        batches: Vec::new(),
        block_events: 0,
        stored: 0,
        removed: 0,
        prompts: Vec::new(),
    };
    let mut seq = 0u64;
    for pass in 0..o.passes {
        let seed = HashSeed::from_salt(Some(&pass.to_le_bytes()));
        for rec in &trace {
            let tokens = expand_tokens(rec);
            let hashes = compute_block_hashes(&tokens, bs, seed);
            let key = rec.hash_ids.get(1).unwrap_or(&rec.hash_ids[0]);
            let wi = (xxh3_64_with_seed(&key.to_le_bytes(), pass) % u64::from(o.workers)) as usize;
            let pool = &mut pools[wi];
            seq += 1;
            let id = RequestId(seq);
            // Longer than the pool: keep what fits, like a worker would refuse the rest.
            let fit = hashes.len().min(o.capacity as usize);
            pool.acquire_prefix(id, &hashes[..fit], fit)
                .expect("acquire");
            if pool.allocate(id, fit * bs.tokens()).is_ok() {
                pool.commit(id, &hashes[..fit]).expect("commit");
            }
            pool.free(id).expect("free");
            let events = pool
                .events_since(taken[wi])
                .expect("ring holds one request's events");
            taken[wi] = pool.last_event_id();
            for e in &events {
                let n = e.block_count() as u64;
                w.block_events += n;
                match e.kind {
                    KvEventKind::Stored { .. } => w.stored += n,
                    KvEventKind::Removed { .. } => w.removed += n,
                    KvEventKind::Cleared => {}
                }
            }
            w.batches.push(Batch { events });
            if pass + 1 == o.passes {
                w.prompts.push(hashes);
            }
        }
    }
    w
}
