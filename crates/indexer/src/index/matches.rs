//! `find_matches`: per worker, how many leading blocks of a prompt it holds, and in which tier.
//!
//! # Why it is sub-linear
//!
//! A worker's *level* at a prompt position is the best tier it holds that block in (0 = Device,
//! 1 = Host, 2 = Disk) or 3 when it does not hold it. Workers keep each of Device,
//! Device ∪ Host and Device ∪ Host ∪ Disk prefix-closed — a block pool evicts leaves first and
//! offloads a block only after its parent — so along a prompt each worker's level never
//! decreases. A worker's answer is then fixed by its boundaries: `bounds[k]` = the first
//! position whose level is above `k`.
//!
//! A block's holder list (sorted (slot, tier) pairs) gives every worker's level there at once.
//! If the lists at two positions are equal, every worker has the same level at both, hence —
//! levels being monotone — at every position between: the whole range is skipped with one
//! `memcmp`, however many workers and blocks it spans. Otherwise the range is split at its
//! middle block; at two adjacent positions with different lists, a merge of the two lists
//! finds the workers that change level there. A query therefore costs about
//! (positions where some worker changes level) × log2(prompt blocks) lookups, plus one merge
//! per such position, instead of one lookup per block: a thousand workers that all hold the
//! same 32-block system prompt and nothing else cost ~log2(n) lookups and one merge. Block 0
//! yields the candidates (nobody holding it ends the query at once); the last block is
//! compared first, so "everyone holds everything they held at the start" is one comparison.
//!
//! Workers flagged `non_closed`, and any worker seen going *down* a level between two adjacent
//! positions, are answered by an exact linear walk over the prompt instead, restricted to them.

use tandem_protocol::{SequenceHash, StorageTier, WorkerId};

use super::KvIndex;
use super::holders::{MISSING, level_in, slot_of, tier_of};

/// How many leading blocks of a prompt a worker holds, split by the tier it holds them in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TierCounts {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
}

impl TierCounts {
    /// All matched leading blocks, whatever the tier.
    pub fn total(&self) -> u32 {
        self.device + self.host + self.disk
    }

    /// The count of one tier.
    pub fn get(&self, tier: StorageTier) -> u32 {
        match tier {
            StorageTier::Device => self.device,
            StorageTier::Host => self.host,
            StorageTier::Disk => self.disk,
        }
    }
}

/// Per-worker overlap with a prompt, sorted by worker id; workers with no match are absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub scores: Vec<(WorkerId, TierCounts)>,
}

impl OverlapScores {
    /// The counts of one worker, `None` when it matched nothing.
    pub fn get(&self, worker: WorkerId) -> Option<TierCounts> {
        self.scores
            .binary_search_by_key(&worker, |&(w, _)| w)
            .ok()
            .map(|i| self.scores[i].1)
    }

    /// Number of workers with at least one matched block.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &(WorkerId, TierCounts)> + '_ {
        self.scores.iter()
    }
}

/// A worker's counts from its boundaries (`bounds[k]`: first position whose level is above `k`).
#[inline]
pub(super) fn counts_of(b: &[u32; 3]) -> TierCounts {
    // Bounds are non-decreasing by construction (see `Search::change`); saturating keeps a
    // broken invariant from panicking the router instead of returning a wrong count.
    TierCounts {
        device: b[0],
        host: b[1].saturating_sub(b[0]),
        disk: b[2].saturating_sub(b[1]),
    }
}

/// `level` of a slot that is not a candidate (does not hold block 0).
pub(super) const NOT_CAND: u8 = u8::MAX;
/// `level` flag of a candidate answered by the linear walk.
pub(super) const LINEAR: u8 = 0x80;
/// `level` of a slot that `find_extents` saw in a holder list and knows is no candidate (see
/// `extent_search.rs`); `find_matches` never sets it.
pub(super) const SKIP: u8 = 0x40;

/// State of one query, indexed directly by worker slot (struct of arrays: the hot loops touch
/// one byte per worker to classify it, and its bounds only when it changes level).
pub(super) struct Search<'a, 'h> {
    pub(super) index: &'a KvIndex,
    pub(super) hashes: &'h [SequenceHash],
    /// Per slot: `NOT_CAND`, or the candidate's level after the last change seen (changes
    /// arrive in position order, so each must start where the previous one ended), with
    /// `LINEAR` set when it is answered by the linear walk.
    pub(super) level: Vec<u8>,
    /// Per slot, `bounds[k]`: first position whose level is above `k` (candidates only).
    pub(super) bounds: Vec<[u32; 3]>,
    /// Candidate slots, ascending; only filled when not `dense`.
    pub(super) cands: Vec<u32>,
    pub(super) n_cands: usize,
    /// Candidates are many compared to all workers (see `finish`).
    pub(super) dense: bool,
    /// Slots answered by the linear walk.
    pub(super) linear: Vec<u32>,
    /// `find_extents`' explicit candidates still in the prompt (unused by `find_matches`,
    /// which only carries the buffer back to the scratch).
    pub(super) live: Vec<u32>,
}

/// Per-thread buffers of [`Search`], kept between queries so that a query costs nothing per
/// worker slot it does not touch: `level` is all `NOT_CAND` and the vectors empty between
/// queries (a query resets only its candidates' entries).
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) level: Vec<u8>,
    pub(super) bounds: Vec<[u32; 3]>,
    pub(super) cands: Vec<u32>,
    pub(super) linear: Vec<u32>,
    /// `find_extents`' list of explicit candidates still in the prompt.
    pub(super) live: Vec<u32>,
}

impl Scratch {
    /// Sizes the per-slot arrays for `slots` workers (they only grow).
    pub(super) fn reset(&mut self, slots: usize) {
        if self.level.len() < slots {
            self.level.resize(slots, NOT_CAND);
            self.bounds.resize(slots, [0; 3]);
        }
    }
}

thread_local! {
    pub(super) static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// Entries compared at once when skipping identical runs of two holder lists.
pub(super) const CHUNK: usize = 16;

/// Whether the first [`CHUNK`] entries of `a` and `b` are equal (both at least that long).
#[inline(always)]
pub(super) fn same(a: &[u32], b: &[u32]) -> bool {
    a[..CHUNK]
        .iter()
        .zip(&b[..CHUNK])
        .fold(0, |acc, (x, y)| acc | (x ^ y))
        == 0
}

impl KvIndex {
    /// Per worker, the number of leading blocks of `hashes` it holds and in which tier; a
    /// worker's walk stops at its first block missing from all its tiers. A block held in
    /// several tiers counts in the fastest.
    ///
    /// Assumes each worker keeps Device, Device ∪ Host and Device ∪ Host ∪ Disk prefix-closed,
    /// which makes a worker's tier non-decreasing along the prompt and lets this bisect for the
    /// positions where holders change instead of walking every block (see the module doc).
    /// Workers whose events broke the assumption (a `Stored` whose parent they did not hold at
    /// that tier or better) are flagged and answered by an exact linear walk. A `Removed` of an
    /// interior block is not detected when applied; the search catches it only if it sees the
    /// worker's level go down between two adjacent blocks it compares.
    ///
    /// `hashes` are the chained sequence hashes of one prompt (docs/ARCHITECTURE.md §3): that chaining is
    /// what turns per-worker prefix closure into monotone levels along `hashes`.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        // Positions are u32; a prompt of 4 billion blocks is cut rather than mis-indexed.
        let hashes = &hashes[..hashes.len().min(u32::MAX as usize)];
        let first = hashes.first().map_or(&[][..], |h| self.holders(h.0));
        if first.is_empty() {
            return OverlapScores::default();
        }
        let n = hashes.len() as u32;
        let mut s = SCRATCH.with(|c| c.take());
        s.reset(self.slots.len());
        let mut s = Search {
            index: self,
            hashes,
            level: s.level,
            bounds: s.bounds,
            cands: s.cands,
            n_cands: 0,
            dense: false,
            linear: s.linear,
            live: s.live,
        };
        // Few candidates among many workers: keep their slots to sort them at the end;
        // otherwise `finish` walks the id-ordered worker list and needs no list.
        s.dense = first.len() * 8 >= self.by_id.len();
        // Until a change is found, a worker keeps its first level to the end: levels below it
        // have no blocks, the others end past the prompt.
        let init = [0u8, 1, 2, 3].map(|l0| [0, 1, 2].map(|k| if k < l0 { 0 } else { n }));
        // Holders are sorted, so a worker's entries are adjacent and its first is its level.
        let mut prev = u32::MAX;
        for &h in first {
            let slot = slot_of(h);
            if slot == prev {
                continue;
            }
            prev = slot;
            let l0 = tier_of(h);
            s.level[slot as usize] = l0;
            s.bounds[slot as usize] = init[l0 as usize];
            s.n_cands += 1;
            if !s.dense {
                s.cands.push(slot);
            }
            if !self.non_closed_slots.is_empty() && self.worker(slot).non_closed {
                s.make_linear(slot);
            }
        }
        if s.linear.len() < s.n_cands {
            s.solve(0, n - 1, first, s.holders_at(n - 1));
        }
        s.walk_linear();
        let (scores, scratch) = s.finish();
        SCRATCH.with(|c| c.set(scratch));
        scores
    }
}

impl<'a> Search<'a, '_> {
    pub(super) fn make_linear(&mut self, slot: u32) {
        let l = &mut self.level[slot as usize];
        if *l & LINEAR == 0 {
            *l |= LINEAR;
            self.linear.push(slot);
        }
    }

    #[inline]
    pub(super) fn holders_at(&self, pos: u32) -> &'a [u32] {
        let index: &'a KvIndex = self.index;
        index.holders(self.hashes[pos as usize].0)
    }

    /// Records the level changes between positions `lo` and `hi`, whose holder lists are `a`
    /// and `b`. Equal lists mean every worker has the same level at both ends, hence (levels
    /// being monotone) all the way between: the range is skipped whatever its length.
    fn solve(&mut self, lo: u32, hi: u32, a: &'a [u32], b: &'a [u32]) {
        if a == b {
            return;
        }
        if hi - lo == 1 {
            self.diff(hi, a, b);
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let m = self.holders_at(mid);
        self.solve(lo, mid, a, m);
        self.solve(mid, hi, m, b);
    }

    /// Merges the holder lists of positions `pos - 1` (`a`) and `pos` (`b`): every candidate
    /// whose level differs between them crosses its boundaries at `pos`.
    fn diff(&mut self, pos: u32, a: &[u32], b: &[u32]) {
        // The merge always stands at the first entry of a slot in both lists, so a worker's
        // level on each side is the entry under the cursor; its further entries (slower
        // copies of the same block) are skipped.
        let (mut i, mut j) = (0, 0);
        while i < a.len() {
            // Adjacent blocks mostly have the same holders: skip identical runs a chunk at a
            // time (branch-free, vectorized), then step past the rest of the run's last worker.
            if j < b.len() && a[i] == b[j] {
                let start = i;
                while i + CHUNK <= a.len() && j + CHUNK <= b.len() && same(&a[i..], &b[j..]) {
                    i += CHUNK;
                    j += CHUNK;
                }
                if i > start {
                    let last = slot_of(a[i - 1]);
                    while i < a.len() && slot_of(a[i]) == last {
                        i += 1;
                    }
                    while j < b.len() && slot_of(b[j]) == last {
                        j += 1;
                    }
                    continue;
                }
            }
            let next_b = b.get(j).map_or(u32::MAX, |&y| slot_of(y));
            let slot = slot_of(a[i]);
            if slot < next_b {
                // The common bulk case (a shared prefix ends here): a run of workers that hold
                // the previous block and not this one, in a tight loop.
                i = self.disappear_run(pos, a, i, next_b);
                continue;
            }
            if next_b < slot {
                j = self.appear(pos, b, j);
                continue;
            }
            let (from, to) = (tier_of(a[i]), tier_of(b[j]));
            if from != to {
                self.change(slot, from, to, pos);
            }
            i += 1;
            while i < a.len() && slot_of(a[i]) == slot {
                i += 1;
            }
            j += 1;
            while j < b.len() && slot_of(b[j]) == slot {
                j += 1;
            }
        }
        while j < b.len() {
            j = self.appear(pos, b, j);
        }
    }

    /// Workers of `a` from `i` on with slots below `until` hold the block at `pos - 1` but
    /// not at `pos`. Returns the index of the first entry not handled.
    #[inline]
    fn disappear_run(&mut self, pos: u32, a: &[u32], i: usize, until: u32) -> usize {
        let end = i + a[i..].partition_point(|&h| slot_of(h) < until);
        let mut prev = u32::MAX;
        for &x in &a[i..end] {
            let slot = slot_of(x);
            if slot == prev {
                continue;
            }
            prev = slot;
            let from = tier_of(x);
            let level = self.level[slot as usize];
            if level == from {
                // The bulk case, inlined: a candidate at its expected level leaves the
                // prompt here, so every level from `from` up ends at `pos`.
                self.level[slot as usize] = MISSING;
                let b = &mut self.bounds[slot as usize];
                if from == 0 {
                    b[0] = pos;
                }
                if from <= 1 {
                    b[1] = pos;
                }
                b[2] = pos;
            } else {
                self.change(slot, from, MISSING, pos);
            }
        }
        end
    }

    /// The worker of `b[j]` is not in the previous list: it appears at `pos`. Returns the
    /// index past its entries.
    #[inline]
    fn appear(&mut self, pos: u32, b: &[u32], mut j: usize) -> usize {
        let slot = slot_of(b[j]);
        self.change(slot, MISSING, tier_of(b[j]), pos);
        j += 1;
        while j < b.len() && slot_of(b[j]) == slot {
            j += 1;
        }
        j
    }

    /// A worker's level goes from `from` at `pos - 1` to `to` at `pos`.
    #[inline]
    pub(super) fn change(&mut self, slot: u32, from: u8, to: u8, pos: u32) {
        // Non-candidates do not hold block 0: their answer is zero whatever they hold.
        let level = self.level[slot as usize];
        // `NOT_CAND` has every bit set, so this also drops non-candidates.
        if level & (LINEAR | SKIP) != 0 {
            return;
        }
        if to < from || from != level {
            // The level went down, or changed somewhere a skipped range hid: this worker is not
            // prefix-closed after all.
            self.make_linear(slot);
            return;
        }
        self.level[slot as usize] = to;
        // Levels from..to end here.
        self.bounds[slot as usize][from as usize..to as usize].fill(pos);
    }

    /// Exact answers for the linear candidates: one pass over the prompt, dropping each worker
    /// at its first missing block and stopping when none is left.
    pub(super) fn walk_linear(&mut self) {
        if self.linear.is_empty() {
            return;
        }
        let mut active = self.linear.clone();
        for &slot in &active {
            self.bounds[slot as usize] = [0; 3];
        }
        for pos in 0..self.hashes.len() as u32 {
            if active.is_empty() {
                break;
            }
            let list = self.holders_at(pos);
            let bounds = &mut self.bounds;
            active.retain(|&slot| {
                let level = level_in(list, slot);
                if level == MISSING {
                    return false;
                }
                bounds[slot as usize][level as usize] += 1;
                true
            });
        }
        // The walk counted per level; turn counts into cumulative boundaries like the search's.
        for &slot in &self.linear {
            let b = &mut self.bounds[slot as usize];
            b[1] += b[0];
            b[2] += b[1];
        }
    }

    /// The answer, and the buffers back for the next query (candidates' entries reset).
    fn finish(mut self) -> (OverlapScores, Scratch) {
        let counts = counts_of;
        let by_id = &self.index.by_id;
        let mut scores = Vec::with_capacity(if self.dense {
            by_id.len()
        } else {
            self.n_cands
        });
        // Every candidate holds block 0, so every one is in the answer. Sorting k candidates
        // costs k·log k; walking the id-ordered worker list costs one probe per known worker.
        if self.dense {
            // One entry per known worker (an exact-size, branch-light pass that also resets
            // the candidates' levels for the next query), then the non-candidates dropped:
            // a candidate holds block 0, so its total is never zero.
            let (level, bounds) = (&mut self.level, &self.bounds);
            scores.extend(by_id.iter().map(|&(id, slot)| {
                let l = &mut level[slot as usize];
                let c = if *l != NOT_CAND {
                    *l = NOT_CAND;
                    counts(&bounds[slot as usize])
                } else {
                    TierCounts::default()
                };
                (id, c)
            }));
            scores.retain(|(_, c)| c.total() > 0);
        } else {
            scores.extend(self.cands.iter().map(|&slot| {
                (
                    self.index.worker(slot).id,
                    counts(&self.bounds[slot as usize]),
                )
            }));
            scores.sort_unstable_by_key(|&(id, _)| id);
            for &slot in &self.cands {
                self.level[slot as usize] = NOT_CAND;
            }
        }
        self.cands.clear();
        self.linear.clear();
        let scratch = Scratch {
            level: self.level,
            bounds: self.bounds,
            cands: self.cands,
            linear: self.linear,
            live: self.live,
        };
        (OverlapScores { scores }, scratch)
    }
}
