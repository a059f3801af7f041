//! [`ShardedIndex`]: [`KvIndex`] for concurrent readers and writers.
//!
//! Workers are spread over shards by a hash of their id; each shard is a [`KvIndex`] behind a
//! `parking_lot::RwLock`. An event, dump or removal locks only its worker's shard for writing;
//! `find_matches` takes each shard's read lock in turn, queries it and merges the answers;
//! `with_extents` holds every shard's read lock while the caller reads the shards' grouped
//! answers ([`Extents`] borrow the index they come from).
//!
//! # Why shard by worker, not by block
//!
//! - Everything a write touches belongs to one worker: its event-id counter, its per-tier block
//!   sets and its holders. With worker shards a write is one lock, gap detection stays a plain
//!   check under that lock, and `Cleared` / `replace_worker` / `remove_worker` stay atomic.
//!   Block shards would make every multi-block event, every clear and every dump lock many
//!   shards (and order them, to avoid deadlock).
//! - A query's answer is per worker, and what must be consistent is each worker's own view
//!   (its prefix as of one point in its event stream); a shard query gives exactly that. The
//!   bisection in `find_matches` then runs inside one shard under one read lock; block shards
//!   would need a lock per looked-up block, and a worker's walk could straddle a write.
//! - Writes from different workers, the common case of many workers streaming at once, go to
//!   different shards in parallel.
//!
//! The cost: a block held by workers of several shards has a map entry in each, and a query
//! does its few lookups once per shard, then merges the shards' answers.
//!
//! # How many shards (measured, `benches/trace_replay.rs`, crates/indexer/BENCHMARKS.md)
//!
//! Readers never wait for each other: a shard is a reader-writer lock. A writer holds a shard
//! for one event at a time (`apply_batch` hands the lock to waiting readers between events),
//! so a query waits at most for one event being applied. With the event rate of a large
//! cluster (1 M block events/s) a query on one shard costs about what it costs alone, while
//! 16 shards cost every query 16 sets of lookups and a merge (4-6× slower at 1,000 workers).
//! Shards pay off only when several threads apply events at once (a standalone indexer with
//! several subscribers); a frontend with one subscriber uses one, the default.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tandem_protocol::{KvDump, KvEvent, SequenceHash, WorkerId};

use crate::error::IndexError;
use crate::hash::BuildMix;
use crate::index::{ApplyOutcome, Extents, KvIndex, OverlapScores, TierCounts, WorkerBlocks};

/// A [`KvIndex`] sharded by worker for concurrent use (`Send + Sync`).
#[derive(Debug)]
pub struct ShardedIndex {
    shards: Box<[RwLock<KvIndex>]>,
}

impl ShardedIndex {
    /// An index with `shards` shards (at least one). A few times the number of writer threads
    /// is plenty; more shards make each query do its first lookups more times.
    pub fn new(shards: usize) -> Self {
        ShardedIndex {
            shards: (0..shards.max(1))
                .map(|_| RwLock::new(KvIndex::new()))
                .collect(),
        }
    }

    /// An index with `shards` shards, each reserved for its share of `blocks` distinct blocks
    /// (see [`KvIndex::with_capacity`]).
    pub fn with_capacity(shards: usize, blocks: usize) -> Self {
        let n = shards.max(1);
        ShardedIndex {
            shards: (0..n)
                .map(|_| RwLock::new(KvIndex::with_capacity(blocks.div_ceil(n))))
                .collect(),
        }
    }

    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// The shard that holds `worker` (in `0..num_shards()`): writers that each take the
    /// workers of one shard never wait for each other.
    pub fn shard_of(&self, worker: WorkerId) -> usize {
        use std::hash::BuildHasher;
        let h = BuildMix::default().hash_one(worker);
        // The high bits are the best mixed; multiply-shift maps them onto the shard count.
        (((h >> 32) * self.shards.len() as u64) >> 32) as usize
    }

    fn shard(&self, worker: WorkerId) -> &RwLock<KvIndex> {
        &self.shards[self.shard_of(worker)]
    }

    /// [`KvIndex::apply`] under the worker's shard lock.
    pub fn apply(&self, event: &KvEvent) -> ApplyOutcome {
        self.shard(event.worker_id).write().apply(event)
    }

    /// Applies a batch of one worker's events under one lock, stopping at the first gap (whose
    /// outcome is returned); duplicates are skipped. Returns the number applied and the gap.
    /// Events of other workers in the batch are applied under their own shard's lock.
    pub fn apply_batch(&self, events: &[KvEvent]) -> (usize, Option<ApplyOutcome>) {
        let mut applied = 0;
        let mut rest = events;
        while let Some(first) = rest.first() {
            let worker = first.worker_id;
            let run = rest.iter().take_while(|e| e.worker_id == worker).count();
            let mut shard = self.shard(worker).write();
            for e in &rest[..run] {
                match shard.apply(e) {
                    ApplyOutcome::Applied => applied += 1,
                    ApplyOutcome::Duplicate => {}
                    gap @ ApplyOutcome::Gap { .. } => return (applied, Some(gap)),
                }
                // Between events, hand the lock to a waiting reader (free when none waits):
                // a query never waits for more than one event, however long the batch.
                RwLockWriteGuard::bump(&mut shard);
            }
            rest = &rest[run..];
        }
        (applied, None)
    }

    /// [`KvIndex::replace_worker`] under the worker's shard lock: readers see the worker either
    /// before or after the dump, never half of it.
    pub fn replace_worker(&self, dump: &KvDump) -> Result<(), IndexError> {
        self.shard(dump.worker_id).write().replace_worker(dump)
    }

    /// [`KvIndex::remove_worker`] under the worker's shard lock.
    pub fn remove_worker(&self, worker: WorkerId) -> bool {
        self.shard(worker).write().remove_worker(worker)
    }

    /// [`KvIndex::find_matches`] over every shard, merged and sorted by worker id. Each worker's
    /// answer reflects one point of its event stream; different workers may be seen at slightly
    /// different moments, which no caller can tell apart from a query a moment earlier or later.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        let mut parts = Vec::with_capacity(self.shards.len());
        // Shards a writer holds right now are visited last: by then the writer has most
        // likely moved on, and the query never queues behind a write while other shards are
        // free. Only the second pass may wait.
        let mut busy = Vec::new();
        for (i, shard) in self.shards.iter().enumerate() {
            match shard.try_read() {
                Some(guard) => parts.push(guard.find_matches(hashes).scores),
                None => busy.push(i),
            }
        }
        for i in busy {
            parts.push(self.shards[i].read().find_matches(hashes).scores);
        }
        OverlapScores {
            scores: merge_sorted(parts),
        }
    }

    /// [`KvIndex::find_extents`] on every shard, handed to `f` as one answer per shard (a
    /// worker is in at most one of them). The answers borrow the shards, so `f` runs under
    /// every shard's read lock: writers wait for it, so it should only read the answer (score,
    /// pick a worker, or copy what it needs).
    pub fn with_extents<R>(
        &self,
        hashes: &[SequenceHash],
        f: impl FnOnce(&[Extents<'_>]) -> R,
    ) -> R {
        // As in `find_matches`, shards free now are taken first. Writers hold one shard at a
        // time and never wait while holding it, so holding several read locks cannot deadlock.
        let mut guards: Vec<Option<RwLockReadGuard<'_, KvIndex>>> =
            self.shards.iter().map(|s| s.try_read()).collect();
        for (guard, shard) in guards.iter_mut().zip(self.shards.iter()) {
            if guard.is_none() {
                *guard = Some(shard.read());
            }
        }
        let answers: Vec<Extents<'_>> = guards
            .iter()
            .flatten()
            .map(|g| g.find_extents(hashes))
            .collect();
        f(&answers)
    }

    pub fn last_event_id(&self, worker: WorkerId) -> Option<u64> {
        self.shard(worker).read().last_event_id(worker)
    }

    pub fn is_non_closed(&self, worker: WorkerId) -> bool {
        self.shard(worker).read().is_non_closed(worker)
    }

    pub fn worker_blocks(&self, worker: WorkerId) -> Option<WorkerBlocks> {
        self.shard(worker).read().worker_blocks(worker)
    }

    /// Known workers, sorted by id.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut out: Vec<WorkerId> = self
            .shards
            .iter()
            .flat_map(|s| s.read().workers().collect::<Vec<_>>())
            .collect();
        out.sort_unstable();
        out
    }

    /// Resident (block, worker, tier) entries over all shards.
    pub fn num_entries(&self) -> usize {
        self.shards.iter().map(|s| s.read().num_entries()).sum()
    }

    /// Sum of the shards' distinct blocks: a block held in several shards counts once per shard.
    pub fn num_block_entries(&self) -> usize {
        self.shards.iter().map(|s| s.read().num_blocks()).sum()
    }

    /// Estimated heap bytes of all shards (see [`KvIndex::heap_bytes`]).
    pub fn heap_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.read().heap_bytes()).sum()
    }
}

impl Default for ShardedIndex {
    /// One shard: the best choice with one event subscriber (see the module docs).
    fn default() -> Self {
        Self::new(1)
    }
}

/// Merges per-shard answers, each sorted by worker id (a worker lives in one shard), by
/// merging pairs until one list is left: n·log2(shards) moves instead of an n·log n sort.
fn merge_sorted(mut parts: Vec<Vec<(WorkerId, TierCounts)>>) -> Vec<(WorkerId, TierCounts)> {
    parts.retain(|p| !p.is_empty());
    while parts.len() > 1 {
        let mut next = Vec::with_capacity(parts.len().div_ceil(2));
        let mut it = parts.into_iter();
        while let Some(a) = it.next() {
            match it.next() {
                None => next.push(a),
                Some(b) => {
                    let mut out = Vec::with_capacity(a.len() + b.len());
                    let (mut i, mut j) = (0, 0);
                    while i < a.len() && j < b.len() {
                        if a[i].0 <= b[j].0 {
                            out.push(a[i]);
                            i += 1;
                        } else {
                            out.push(b[j]);
                            j += 1;
                        }
                    }
                    out.extend_from_slice(&a[i..]);
                    out.extend_from_slice(&b[j..]);
                    next.push(out);
                }
            }
        }
        parts = next;
    }
    parts.pop().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tandem_protocol::{KvEventKind, LocalBlockHash, StorageTier, StoredBlock};

    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    /// Worker `w`'s stream: grow a chain on device, offload its head to host, trim the tail.
    fn stream(w: u64, n: u64) -> Vec<KvEvent> {
        let mut out = Vec::new();
        let mut id = 0;
        let mut next = |tier, kind| {
            id += 1;
            KvEvent {
                worker_id: WorkerId(w),
                event_id: id,
                tier,
                kind,
            }
        };
        for b in 1..=n {
            let parent = (b > 1).then(|| SequenceHash(b - 1));
            let blocks = vec![StoredBlock {
                sequence_hash: SequenceHash(b),
                local_hash: LocalBlockHash(b),
            }];
            out.push(next(
                StorageTier::Device,
                KvEventKind::Stored {
                    parent,
                    blocks: blocks.clone(),
                },
            ));
            if b % 3 == 0 {
                out.push(next(
                    StorageTier::Host,
                    KvEventKind::Stored { parent, blocks },
                ));
            }
            if b % 7 == 0 && b > w % 5 {
                out.push(next(
                    StorageTier::Device,
                    KvEventKind::Removed {
                        blocks: vec![SequenceHash(b)],
                    },
                ));
            }
            if b % 50 == 0 {
                out.push(next(StorageTier::Host, KvEventKind::Cleared));
            }
        }
        out
    }

    #[test]
    fn is_send_and_sync() {
        assert_send_sync::<ShardedIndex>();
    }

    #[test]
    fn writers_that_each_take_one_shard_end_like_a_single_index() {
        let sharded = ShardedIndex::with_capacity(3, 4096);
        let streams: Vec<Vec<KvEvent>> = (0..12).map(|w| stream(w, 200)).collect();
        let shard_of: Vec<usize> = (0..12).map(|w| sharded.shard_of(WorkerId(w))).collect();
        assert!(shard_of.iter().all(|&s| s < 3));
        // Twelve workers land on more than one shard (the mix spreads them).
        assert!(shard_of.iter().any(|&s| s != shard_of[0]));
        std::thread::scope(|scope| {
            for shard in 0..3 {
                let (sharded, streams, shard_of) = (&sharded, &streams, &shard_of);
                scope.spawn(move || {
                    for (s, _) in streams.iter().zip(shard_of).filter(|&(_, &o)| o == shard) {
                        assert_eq!(sharded.apply_batch(s), (s.len(), None));
                    }
                });
            }
        });
        let mut single = KvIndex::new();
        for e in streams.iter().flatten() {
            single.apply(e);
        }
        let query: Vec<SequenceHash> = (1..=200).map(SequenceHash).collect();
        assert_eq!(sharded.find_matches(&query), single.find_matches(&query));
        assert_eq!(sharded.num_entries(), single.num_entries());
    }

    #[test]
    fn concurrent_writers_and_readers_end_like_a_single_index() {
        let sharded = Arc::new(ShardedIndex::new(4));
        let streams: Vec<Vec<KvEvent>> = (0..8).map(|w| stream(w, 300)).collect();
        let done = Arc::new(AtomicBool::new(false));
        let query: Vec<SequenceHash> = (1..=300).map(SequenceHash).collect();
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (idx, done, q) = (sharded.clone(), done.clone(), query.clone());
                std::thread::spawn(move || {
                    let mut queries = 0u64;
                    while !done.load(Ordering::Relaxed) {
                        let m = idx.find_matches(&q);
                        assert!(m.scores.windows(2).all(|p| p[0].0 < p[1].0));
                        for (_, c) in &m.scores {
                            assert!(c.total() as usize <= q.len());
                        }
                        queries += 1;
                    }
                    queries
                })
            })
            .collect();
        let writers: Vec<_> = streams
            .chunks(2)
            .map(|chunk| {
                let (idx, chunk) = (sharded.clone(), chunk.to_vec());
                std::thread::spawn(move || {
                    // Interleave the two workers' streams, one event at a time.
                    let longest = chunk.iter().map(Vec::len).max().unwrap_or(0);
                    for i in 0..longest {
                        for s in &chunk {
                            if let Some(e) = s.get(i) {
                                assert_eq!(idx.apply(e), ApplyOutcome::Applied);
                            }
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }

        let mut single = KvIndex::new();
        for s in &streams {
            for e in s {
                single.apply(e);
            }
        }
        assert_eq!(sharded.find_matches(&query), single.find_matches(&query));
        for prefix in [1, 3, 300] {
            let q = &query[..prefix];
            let merged = sharded.with_extents(q, |parts| {
                assert_eq!(parts.len(), 4);
                let all: Vec<_> = parts.iter().map(|e| e.to_scores().scores).collect();
                OverlapScores {
                    scores: merge_sorted(all),
                }
            });
            assert_eq!(merged, single.find_matches(q));
            assert_eq!(single.find_extents(q).to_scores(), merged);
        }
        assert_eq!(sharded.num_entries(), single.num_entries());
        assert_eq!(sharded.workers(), single.workers().collect::<Vec<_>>());
        for w in single.workers() {
            assert_eq!(sharded.worker_blocks(w), single.worker_blocks(w));
            assert_eq!(sharded.last_event_id(w), single.last_event_id(w));
        }
        for prefix in [1, 10, 49, 100, 299] {
            assert_eq!(
                sharded.find_matches(&query[..prefix]),
                single.find_matches(&query[..prefix])
            );
        }
    }

    #[test]
    fn batches_stop_at_gaps_and_dumps_replace() {
        let idx = ShardedIndex::new(3);
        let mut events = stream(1, 5);
        let later = events.split_off(3);
        assert_eq!(idx.apply_batch(&events), (3, None));
        assert_eq!(
            idx.apply_batch(&later[1..]),
            (
                0,
                Some(ApplyOutcome::Gap {
                    expected: 4,
                    got: later[1].event_id
                })
            )
        );
        assert_eq!(idx.apply_batch(&later), (later.len(), None));
        let dump = KvDump {
            worker_id: WorkerId(1),
            last_event_id: 99,
            events: vec![],
        };
        idx.replace_worker(&dump).unwrap();
        assert_eq!(idx.last_event_id(WorkerId(1)), Some(99));
        assert!(idx.find_matches(&[SequenceHash(1)]).is_empty());
        assert!(idx.remove_worker(WorkerId(1)));
        assert!(idx.workers().is_empty());
    }
}
