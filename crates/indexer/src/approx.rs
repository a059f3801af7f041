//! [`ApproxIndex`]: approximate mode, for routers whose workers publish no KV events.
//!
//! The router records its own decisions ("this prompt went to that worker") and assumes the
//! worker still caches the prompt's blocks for a while. Entries expire after a TTL, and a size
//! cap prunes the oldest first. Results are all Device tier.
//!
//! The recorded blocks live in an inner [`KvIndex`] so that its sub-linear `find_matches` is
//! reused; that needs each worker's blocks to stay prefix-closed under expiry and pruning. A
//! `record` refreshes the whole prefix at once, so an ancestor is never older than its
//! descendants, and within one record the deepest block is queued first: popping the queue in
//! order therefore always removes children before their parents.

use std::collections::VecDeque;

use tandem_protocol::{SequenceHash, StorageTier, WorkerId};

use crate::hash::MixMap;
use crate::index::{Extents, KvIndex, OverlapScores};

/// Settings of [`ApproxIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApproxConfig {
    /// How long a recorded block counts as cached, in milliseconds.
    pub ttl_ms: u64,
    /// Most (worker, block) entries kept; beyond it the oldest are pruned.
    pub max_entries: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        ApproxConfig {
            ttl_ms: 120_000,
            max_entries: 1 << 20,
        }
    }
}

/// One refresh of one (worker, block), in refresh order.
#[derive(Clone, Copy, Debug)]
struct Queued {
    at_ms: u64,
    /// Matches the entry's current `seq` only if this is its latest refresh.
    seq: u64,
    worker: WorkerId,
    hash: u64,
}

/// Approximate KV index fed by routing decisions instead of events.
#[derive(Debug)]
pub struct ApproxIndex {
    config: ApproxConfig,
    index: KvIndex,
    /// Per worker: block → seq of its latest refresh.
    latest: MixMap<WorkerId, MixMap<u64, u64>>,
    /// Refreshes, oldest first; superseded ones are skipped lazily.
    queue: VecDeque<Queued>,
    next_seq: u64,
    entries: usize,
    /// Time never goes backwards inside: a late `now_ms` is treated as the latest seen, so the
    /// queue stays in time order.
    now_ms: u64,
}

impl ApproxIndex {
    pub fn new(config: ApproxConfig) -> Self {
        ApproxIndex {
            config,
            index: KvIndex::new(),
            latest: MixMap::default(),
            queue: VecDeque::new(),
            next_seq: 0,
            entries: 0,
            now_ms: 0,
        }
    }

    pub fn config(&self) -> ApproxConfig {
        self.config
    }

    /// Records that a request with prompt blocks `hashes` was routed to `worker` at `now_ms`:
    /// every block of the prompt counts as cached there until `now_ms + ttl_ms`.
    pub fn record(&mut self, worker: WorkerId, hashes: &[SequenceHash], now_ms: u64) {
        self.expire(now_ms);
        let now = self.now_ms;
        let latest = self.latest.entry(worker).or_default();
        // Deepest first, so that equal timestamps are pruned tail first.
        for h in hashes.iter().rev() {
            let seq = self.next_seq;
            self.next_seq += 1;
            if latest.insert(h.0, seq).is_none() {
                self.index.insert_raw(worker, StorageTier::Device, h.0);
                self.entries += 1;
            }
            self.queue.push_back(Queued {
                at_ms: now,
                seq,
                worker,
                hash: h.0,
            });
        }
        while self.entries > self.config.max_entries {
            if !self.pop_oldest() {
                break;
            }
        }
        self.compact_if_stale();
    }

    /// Per worker, the number of leading blocks of `hashes` recorded for it and not expired at
    /// `now_ms` (all counted as Device).
    pub fn find_matches(&mut self, hashes: &[SequenceHash], now_ms: u64) -> OverlapScores {
        self.expire(now_ms);
        self.index.find_matches(hashes)
    }

    /// The same answer grouped by shared extent ([`KvIndex::find_extents`]).
    pub fn find_extents(&mut self, hashes: &[SequenceHash], now_ms: u64) -> Extents<'_> {
        self.expire(now_ms);
        self.index.find_extents(hashes)
    }

    /// Drops every entry recorded at or before `now_ms - ttl_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        while let Some(front) = self.queue.front() {
            if front.at_ms.saturating_add(self.config.ttl_ms) > self.now_ms {
                break;
            }
            self.pop_oldest();
        }
    }

    /// Forgets a worker; returns whether it had entries.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        // Its queued refreshes become stale: their worker has no `latest` entry any more.
        let Some(blocks) = self.latest.remove(&worker) else {
            return false;
        };
        self.entries -= blocks.len();
        self.index.remove_worker(worker);
        true
    }

    /// Live (worker, block) entries.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Pops the oldest queued refresh, removing its entry if it is still the latest one.
    /// Returns false when the queue is empty.
    fn pop_oldest(&mut self) -> bool {
        let Some(q) = self.queue.pop_front() else {
            return false;
        };
        let Some(blocks) = self.latest.get_mut(&q.worker) else {
            return true;
        };
        if blocks.get(&q.hash) == Some(&q.seq) {
            blocks.remove(&q.hash);
            self.entries -= 1;
            self.index.remove_raw(q.worker, StorageTier::Device, q.hash);
            if blocks.is_empty() {
                self.latest.remove(&q.worker);
                self.index.remove_worker(q.worker);
            }
        }
        true
    }

    /// Re-recording a prefix leaves superseded refreshes in the queue; drop them once they
    /// outnumber live entries, so the queue stays O(entries).
    fn compact_if_stale(&mut self) {
        if self.queue.len() <= 2 * self.entries + 1024 {
            return;
        }
        let latest = &self.latest;
        self.queue
            .retain(|q| latest.get(&q.worker).and_then(|b| b.get(&q.hash)) == Some(&q.seq));
    }
}

impl Default for ApproxIndex {
    fn default() -> Self {
        Self::new(ApproxConfig::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TierCounts;

    fn p(blocks: &[u64]) -> Vec<SequenceHash> {
        blocks.iter().copied().map(SequenceHash).collect()
    }

    fn device(n: u32) -> Option<TierCounts> {
        Some(TierCounts {
            device: n,
            host: 0,
            disk: 0,
        })
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let mut a = ApproxIndex::new(ApproxConfig {
            ttl_ms: 100,
            max_entries: 1000,
        });
        a.record(WorkerId(1), &p(&[1, 2, 3]), 1_000);
        a.record(WorkerId(2), &p(&[1, 2]), 1_050);
        let m = a.find_matches(&p(&[1, 2, 3]), 1_099);
        assert_eq!(m.get(WorkerId(1)), device(3));
        assert_eq!(m.get(WorkerId(2)), device(2));
        let m = a.find_matches(&p(&[1, 2, 3]), 1_100);
        assert_eq!(m.get(WorkerId(1)), None, "age equal to the TTL is expired");
        assert_eq!(m.get(WorkerId(2)), device(2));
        assert!(a.find_matches(&p(&[1, 2, 3]), 1_150).is_empty());
        assert!(a.is_empty());
    }

    #[test]
    fn re_recording_refreshes() {
        let mut a = ApproxIndex::new(ApproxConfig {
            ttl_ms: 100,
            max_entries: 1000,
        });
        a.record(WorkerId(1), &p(&[1, 2, 3]), 0);
        a.record(WorkerId(1), &p(&[1, 2]), 80);
        // Block 3 expires at 100, its refreshed ancestors at 180: the prefix stays closed.
        assert_eq!(
            a.find_matches(&p(&[1, 2, 3]), 120).get(WorkerId(1)),
            device(2)
        );
        assert_eq!(a.len(), 2);
        assert_eq!(
            a.find_matches(&p(&[1, 2, 3]), 179).get(WorkerId(1)),
            device(2)
        );
        assert!(a.find_matches(&p(&[1, 2, 3]), 180).is_empty());
    }

    #[test]
    fn the_cap_prunes_oldest_first_and_tails_before_parents() {
        let mut a = ApproxIndex::new(ApproxConfig {
            ttl_ms: 10_000,
            max_entries: 5,
        });
        a.record(WorkerId(1), &p(&[1, 2, 3]), 0);
        a.record(WorkerId(2), &p(&[1, 2]), 1);
        assert_eq!(a.len(), 5);
        // Three more entries push out worker 1's three, deepest first.
        a.record(WorkerId(3), &p(&[7]), 2);
        let m = a.find_matches(&p(&[1, 2, 3]), 2);
        assert_eq!(m.get(WorkerId(1)), device(2), "block 3 went first");
        a.record(WorkerId(3), &p(&[7, 8]), 2);
        let m = a.find_matches(&p(&[1, 2, 3]), 2);
        assert_eq!(m.get(WorkerId(1)), device(1));
        assert_eq!(m.get(WorkerId(2)), device(2));
        assert_eq!(a.len(), 5);
        // A prompt longer than the cap keeps its head.
        a.record(WorkerId(4), &p(&[20, 21, 22, 23, 24, 25, 26]), 3);
        assert_eq!(
            a.find_matches(&p(&[20, 21, 22, 23, 24, 25, 26]), 3)
                .get(WorkerId(4)),
            device(5)
        );
        assert_eq!(a.len(), 5);
    }

    #[test]
    fn removing_a_worker_and_late_clocks() {
        let mut a = ApproxIndex::new(ApproxConfig {
            ttl_ms: 100,
            max_entries: 100,
        });
        a.record(WorkerId(1), &p(&[1, 2]), 500);
        // A clock read that goes backwards is treated as the latest one.
        a.record(WorkerId(2), &p(&[1]), 400);
        assert!(a.find_matches(&p(&[1]), 599).get(WorkerId(2)).is_some());
        assert!(a.remove_worker(WorkerId(1)));
        assert!(!a.remove_worker(WorkerId(1)));
        assert_eq!(a.len(), 1);
        assert_eq!(a.find_matches(&p(&[1, 2]), 550).get(WorkerId(1)), None);
        assert!(a.find_matches(&p(&[1]), 600).is_empty());
    }

    #[test]
    fn the_queue_stays_bounded_under_refreshes() {
        let mut a = ApproxIndex::new(ApproxConfig {
            ttl_ms: 1 << 40,
            max_entries: 100,
        });
        let prompt = p(&(1..=10).collect::<Vec<_>>());
        for t in 0..10_000 {
            a.record(WorkerId(t % 3), &prompt, t);
        }
        assert_eq!(a.len(), 30);
        assert!(a.queue.len() <= 2 * 30 + 1024 + prompt.len());
    }
}
