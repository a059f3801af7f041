//! [`TierLog`]: the blocks one worker holds in one tier, as an append-only log with lazy
//! deletion.
//!
//! The block map already answers "does this worker hold this block in this tier" (its holder
//! list), so the per-worker side only has to *enumerate* a worker's blocks, for `Cleared`,
//! `remove_worker` and `replace_worker`. A hash set per worker and tier did that at the price of
//! a second random cache miss per block event and ~9 bytes × hash-table slack per entry. The log
//! is a `Vec<u64>` of the hashes stored, in store order: a store appends (the vector's end is in
//! cache), a removal only decrements `live`. Entries whose holder is gone (stale) and repeats (a
//! block removed and stored again) stay until the log is compacted.
//!
//! # Growth and compaction
//!
//! Only when the log is full does it decide: if its length reaches `2 × live + SLACK` it is
//! compacted (kept: entries whose block's holder list still names this worker and tier, once
//! each, in log order), else it grows to `max(2 × live + SLACK, 1.125 × len)`. Compacting a log
//! of `len` entries costs `len` map lookups and removes `len - live ≥ len / 2` entries, each left
//! by one removal since the last compaction, so a removal costs about two lookups at most,
//! amortized and done in batches of [`AHEAD`] whose map slots are loaded together (independent
//! misses, which overlap). Repeats are looked for (with a scratch set) only when more entries
//! than live blocks survive, which is rare: a block removed and stored again. The capacity
//! thus stays below `1.125 × (2 × live + SLACK)` after a store; a removal compacts when the
//! capacity exceeds twice that bound (a worker that shrinks without storing), and a log whose
//! last live entry goes is freed outright. In the steady state of a full cache (a store per
//! removal) a log's capacity is at most 2.25 × its live entries plus 72: up to 18 bytes per
//! (block, worker, tier).

use super::block_map::AHEAD;
use crate::hash::MixSet;

/// What a log asks of the index when it compacts: which of its entries are live.
pub(super) trait Liveness {
    /// Whether `hash`'s holder list names this log's worker and tier.
    fn is_live(&self, hash: u64) -> bool;
    /// Starts loading what [`Liveness::is_live`] will read for `hashes` (a few at a time, see
    /// [`AHEAD`]), so that their cache misses overlap.
    fn prefetch(&self, hashes: &[u64]);
}

/// Entries of slack above `2 × live` before a full log is compacted (so that a tiny log is
/// not compacted on every store), and the capacity of a new log.
const SLACK: usize = 64;

/// One worker's blocks in one tier (see the module doc).
#[derive(Debug, Default)]
pub(super) struct TierLog {
    /// Hashes stored, in store order; a superset of the live ones, with repeats.
    hashes: Vec<u64>,
    /// Blocks whose holder list contains this worker and tier.
    live: usize,
}

/// The capacity a log with `live` entries may grow to before compacting.
#[inline]
fn target(live: usize) -> usize {
    2 * live + SLACK
}

impl TierLog {
    /// Blocks held in this tier.
    #[inline]
    pub(super) fn live(&self) -> usize {
        self.live
    }

    /// Every entry, live or not, possibly repeated: callers check each against the block map.
    pub(super) fn entries(&self) -> &[u64] {
        &self.hashes
    }

    /// Records a hash whose holder list just gained this worker and tier. `live` is asked
    /// (and `seen`, an empty scratch set, used) only when the full log is compacted.
    #[inline]
    pub(super) fn push(&mut self, hash: u64, seen: &mut MixSet<u64>, live: &impl Liveness) {
        if self.hashes.len() == self.hashes.capacity() {
            self.make_room(hash, seen, live);
        }
        self.hashes.push(hash);
        self.live += 1;
    }

    /// `hash` is about to be pushed: its holder list already names this worker and tier, so
    /// compaction must not keep an older entry of it.
    #[cold]
    fn make_room(&mut self, hash: u64, seen: &mut MixSet<u64>, live: &impl Liveness) {
        let len = self.hashes.len();
        if len >= target(self.live) {
            self.compact(seen, live, Some(hash));
        } else {
            let cap = target(self.live).max(len + len / 8);
            self.hashes.reserve_exact(cap - len);
        }
    }

    /// Notes that a hash's holder list lost this worker and tier (its entry goes stale).
    #[inline]
    pub(super) fn removed(&mut self, seen: &mut MixSet<u64>, live: &impl Liveness) {
        debug_assert!(self.live > 0, "removed more than was stored");
        self.live -= 1;
        if self.live == 0 {
            // Every entry is stale.
            self.hashes = Vec::new();
        } else if self.hashes.capacity() > 2 * target(self.live) * 9 / 8 {
            self.compact(seen, live, None);
        }
    }

    /// Empties the log, returning its entries (live or not, possibly repeated) and how many
    /// were live.
    pub(super) fn take(&mut self) -> (Vec<u64>, usize) {
        let live = std::mem::take(&mut self.live);
        (std::mem::take(&mut self.hashes), live)
    }

    /// Drops stale entries, repeats and `except`, keeping the log order, and gives back excess
    /// capacity.
    fn compact(&mut self, seen: &mut MixSet<u64>, live: &impl Liveness, except: Option<u64>) {
        debug_assert!(seen.is_empty());
        let mut kept = 0;
        let mut start = 0;
        while start < self.hashes.len() {
            let end = (start + AHEAD).min(self.hashes.len());
            live.prefetch(&self.hashes[start..end]);
            for i in start..end {
                let h = self.hashes[i];
                if Some(h) != except && live.is_live(h) {
                    self.hashes[kept] = h;
                    kept += 1;
                }
            }
            start = end;
        }
        self.hashes.truncate(kept);
        // Every live block is logged at least once; more entries than live blocks means
        // repeats (blocks removed and stored again), rare enough to look for only then.
        if kept > self.live {
            self.hashes.retain(|&h| seen.insert(h));
            seen.clear();
        }
        debug_assert_eq!(self.hashes.len(), self.live, "log lost a live entry");
        let target = target(self.live);
        if self.hashes.capacity() > target + target / 8 {
            self.hashes.shrink_to(target);
        }
    }

    /// Heap bytes of the log.
    pub(super) fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    struct Model<'a>(&'a BTreeSet<u64>);

    impl Liveness for Model<'_> {
        fn is_live(&self, hash: u64) -> bool {
            self.0.contains(&hash)
        }
        fn prefetch(&self, _: &[u64]) {}
    }

    /// A log against a model set of live hashes, under a store/remove churn.
    #[test]
    fn compacts_and_keeps_live_entries() {
        let mut log = TierLog::default();
        let mut live = BTreeSet::new();
        let mut seen = MixSet::default();
        let mut max_cap_ratio: f64 = 0.0;
        for i in 0..20_000u64 {
            // Keep about 500 live, with repeats of recently removed hashes.
            let h = (i * 7) % 1_300;
            if live.insert(h) {
                log.push(h, &mut seen, &Model(&live));
            }
            if live.len() > 500 {
                let victim = *live.iter().nth((i % 500) as usize).unwrap();
                live.remove(&victim);
                log.removed(&mut seen, &Model(&live));
            }
            assert_eq!(log.live(), live.len());
            let logged: BTreeSet<u64> = log.entries().iter().copied().collect();
            assert!(logged.is_superset(&live));
            if i > 1_000 {
                max_cap_ratio =
                    max_cap_ratio.max(log.hashes.capacity() as f64 / target(live.len()) as f64);
            }
        }
        assert!(
            max_cap_ratio <= 1.125 + 1e-9,
            "capacity {max_cap_ratio} × target"
        );
        // Shrinking without stores compacts, and the last removal frees the log.
        while let Some(&h) = live.iter().next() {
            live.remove(&h);
            log.removed(&mut seen, &Model(&live));
            assert!(log.hashes.capacity() <= 2 * target(live.len()) * 9 / 8 || live.is_empty());
        }
        assert_eq!(log.hashes.capacity(), 0);
    }
}
