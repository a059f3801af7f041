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
//! # Removals, growth and compaction
//!
//! A removal appends the removed hash to a second list, `removed` (its end in cache too). Every
//! entry of a hash in the log but its last is followed by a removal of it, and the last one too
//! when the block is no longer held, so the log's stale entries are exactly, hash by hash, the
//! first entries matched by the removals since the last compaction. Compacting therefore needs
//! nothing from the block map: the removals are counted in a scratch map (small, in cache) and
//! the log is walked once in order, each entry dropped while its hash has removals left to
//! match. An earlier version asked the block map whether each entry was live: a random cache
//! miss per entry, about two per removal amortized, which was a fifth of the event path on a
//! high-churn replay (crates/indexer/BENCHMARKS.md, 2026-12-06).
//!
//! Only when the log is full does it decide: if its length reaches `2 × live + SLACK` it is
//! compacted, else it grows to `max(2 × live + SLACK, 1.125 × len)`. Stale entries and pending
//! removals are equal in number, so the removal list holds about `live + SLACK` hashes at most
//! (it grows to `live + SLACK` at a time, not by doubling). Compacting costs about two
//! sequential entries per removal it settles, all in cache. The log's capacity stays below
//! `1.125 × (2 × live + SLACK)` after a store; a removal compacts when the capacity exceeds
//! twice that bound (a worker that shrinks without storing), and a log whose last live entry
//! goes is freed outright. In the steady state of a full cache (a store per removal) a log and
//! its removal list hold at most about 3.25 × its live entries plus 136; half of that on
//! average over a compaction cycle. (Compacting at `1.5 × live` instead measured 7 bytes per
//! entry less and 5–10 % slower on the 64-worker replay.)

use crate::hash::MixMap;

/// Entries of slack above `2 × live` before a full log is compacted (so that a tiny log is
/// not compacted on every store), and the capacity of a new log.
const SLACK: usize = 64;

/// One worker's blocks in one tier (see the module doc).
#[derive(Debug, Default)]
pub(super) struct TierLog {
    /// Hashes stored, in store order; a superset of the live ones, with repeats.
    hashes: Vec<u64>,
    /// Hashes removed since the last compaction, one per stale entry of `hashes`.
    removed: Vec<u64>,
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

    /// Records a hash whose holder list just gained this worker and tier. `scratch` (empty,
    /// left empty) is used only when the full log is compacted.
    #[inline]
    pub(super) fn push(&mut self, hash: u64, scratch: &mut MixMap<u64, u32>) {
        if self.hashes.len() == self.hashes.capacity() {
            self.make_room(scratch);
        }
        self.hashes.push(hash);
        self.live += 1;
    }

    #[cold]
    fn make_room(&mut self, scratch: &mut MixMap<u64, u32>) {
        let len = self.hashes.len();
        if len >= target(self.live) {
            self.compact(scratch);
        } else {
            let cap = target(self.live).max(len + len / 8);
            self.hashes.reserve_exact(cap - len);
        }
    }

    /// Notes that `hash`'s holder list lost this worker and tier (an entry of it goes stale).
    #[inline]
    pub(super) fn removed(&mut self, hash: u64, scratch: &mut MixMap<u64, u32>) {
        debug_assert!(self.live > 0, "removed more than was stored");
        self.live -= 1;
        if self.live == 0 {
            // Every entry is stale.
            self.hashes = Vec::new();
            self.removed = Vec::new();
        } else {
            let len = self.removed.len();
            if len == self.removed.capacity() {
                let cap = (self.live + SLACK).max(len + len / 8 + 1);
                self.removed.reserve_exact(cap - len);
            }
            self.removed.push(hash);
            if self.hashes.capacity() > 2 * target(self.live) * 9 / 8 {
                self.compact(scratch);
            }
        }
    }

    /// Empties the log, returning its entries (live or not, possibly repeated) and how many
    /// were live.
    pub(super) fn take(&mut self) -> (Vec<u64>, usize) {
        let live = std::mem::take(&mut self.live);
        self.removed = Vec::new();
        (std::mem::take(&mut self.hashes), live)
    }

    /// Drops the stale entries (each hash's first ones, as many as its removals), keeping the
    /// log order, and gives back excess capacity.
    fn compact(&mut self, scratch: &mut MixMap<u64, u32>) {
        debug_assert!(scratch.is_empty());
        for &h in &self.removed {
            *scratch.entry(h).or_insert(0) += 1;
        }
        self.removed.clear();
        self.hashes.retain(|h| match scratch.get_mut(h) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        });
        debug_assert!(
            scratch.values().all(|&n| n == 0),
            "removed what was not logged"
        );
        scratch.clear();
        debug_assert_eq!(self.hashes.len(), self.live, "log lost a live entry");
        let target = target(self.live);
        if self.hashes.capacity() > target + target / 8 {
            self.hashes.shrink_to(target);
        }
    }

    /// Heap bytes of the log.
    pub(super) fn heap_bytes(&self) -> usize {
        (self.hashes.capacity() + self.removed.capacity()) * size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A log against a model set of live hashes, under a store/remove churn with repeats.
    #[test]
    fn compacts_and_keeps_live_entries() {
        let mut log = TierLog::default();
        let mut live = BTreeSet::new();
        let mut scratch = MixMap::default();
        let mut max_cap_ratio: f64 = 0.0;
        let mut compacted_to_live = 0;
        for i in 0..20_000u64 {
            // Keep about 500 live, with repeats of recently removed hashes.
            let h = (i * 7) % 1_300;
            if live.insert(h) {
                log.push(h, &mut scratch);
            }
            if live.len() > 500 {
                let victim = *live.iter().nth((i % 500) as usize).unwrap();
                live.remove(&victim);
                log.removed(victim, &mut scratch);
            }
            assert!(scratch.is_empty());
            assert_eq!(log.live(), live.len());
            assert_eq!(log.removed.len(), log.hashes.len() - live.len());
            let logged: BTreeSet<u64> = log.entries().iter().copied().collect();
            assert!(logged.is_superset(&live));
            if log.hashes.len() == live.len() {
                // Just compacted (or never stale): exactly the live blocks, once each.
                assert_eq!(logged, live);
                compacted_to_live += 1;
            }
            if i > 1_000 {
                max_cap_ratio =
                    max_cap_ratio.max(log.hashes.capacity() as f64 / target(live.len()) as f64);
            }
        }
        assert!(compacted_to_live > 10, "{compacted_to_live}");
        assert!(
            max_cap_ratio <= 1.125 + 1e-9,
            "capacity {max_cap_ratio} × target"
        );
        // Shrinking without stores compacts, and the last removal frees the log.
        while let Some(&h) = live.iter().next() {
            live.remove(&h);
            log.removed(h, &mut scratch);
            assert!(log.hashes.capacity() <= 2 * target(live.len()) * 9 / 8 || live.is_empty());
        }
        assert_eq!(log.hashes.capacity(), 0);
        assert_eq!(log.removed.capacity(), 0);
    }

    /// A block stored, removed and stored again, many times over: compaction keeps its last
    /// entry only, and only while it is held.
    #[test]
    fn a_block_stored_again_is_logged_once_after_compaction() {
        let mut log = TierLog::default();
        let mut scratch = MixMap::default();
        log.push(1, &mut scratch);
        for _ in 0..1_000 {
            log.push(7, &mut scratch);
            log.removed(7, &mut scratch);
        }
        log.push(7, &mut scratch);
        log.compact(&mut scratch);
        assert_eq!(log.entries(), &[1, 7]);
        log.removed(1, &mut scratch);
        log.compact(&mut scratch);
        assert_eq!(log.entries(), &[7]);
        assert!(scratch.is_empty());
    }
}
