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
use super::holders::{Holders, slot_of, tier_of};

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

/// Level of a block the worker does not hold.
const MISSING: u8 = 3;
/// `cand_of` value of a slot that is not a candidate.
const NOT_CAND: u32 = u32::MAX;

/// A worker that holds block 0.
#[derive(Clone, Copy, Debug)]
struct Cand {
    slot: u32,
    /// Level after the last change seen: changes arrive in position order, so each must start
    /// where the previous one ended.
    level: u8,
    /// Answered by the linear walk.
    linear: bool,
    /// `bounds[k]`: first position whose level is above `k`.
    bounds: [u32; 3],
}

/// State of one query.
struct Search<'a> {
    index: &'a KvIndex,
    hashes: &'a [SequenceHash],
    /// Candidate index per worker slot.
    cand_of: Vec<u32>,
    cands: Vec<Cand>,
    linear: Vec<u32>,
}

/// Entries compared at once when skipping identical runs of two holder lists.
const CHUNK: usize = 16;

/// Whether the first [`CHUNK`] entries of `a` and `b` are equal (both at least that long).
#[inline(always)]
fn same(a: &[u32], b: &[u32]) -> bool {
    a[..CHUNK]
        .iter()
        .zip(&b[..CHUNK])
        .fold(0, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// The level of `slot` in a sorted holder list: its first entry is its fastest tier.
#[inline]
fn level_in(list: &[u32], slot: u32) -> u8 {
    let i = list.partition_point(|&h| slot_of(h) < slot);
    match list.get(i) {
        Some(&h) if slot_of(h) == slot => tier_of(h),
        _ => MISSING,
    }
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
    /// `hashes` are the chained sequence hashes of one prompt (DESIGN.md §3): that chaining is
    /// what turns per-worker prefix closure into monotone levels along `hashes`.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> OverlapScores {
        // Positions are u32; a prompt of 4 billion blocks is cut rather than mis-indexed.
        let hashes = &hashes[..hashes.len().min(u32::MAX as usize)];
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(&h.0)) else {
            return OverlapScores::default();
        };
        let first = first.as_slice();
        let n = hashes.len() as u32;
        let mut s = Search {
            index: self,
            hashes,
            cand_of: vec![NOT_CAND; self.slots.len()],
            cands: Vec::with_capacity(first.len()),
            linear: Vec::new(),
        };
        // Holders are sorted, so a worker's entries are adjacent and its first is its level.
        let mut prev = None;
        for &h in first {
            let slot = slot_of(h);
            if prev == Some(slot) {
                continue;
            }
            prev = Some(slot);
            let c = s.cands.len() as u32;
            s.cand_of[slot as usize] = c;
            // Until a change is found, the worker keeps its first level to the end: levels
            // below it have no blocks, the others end past the prompt.
            let l0 = tier_of(h);
            let bounds = [0, 1, 2].map(|k| if k < l0 { 0 } else { n });
            s.cands.push(Cand {
                slot,
                level: l0,
                linear: false,
                bounds,
            });
            if self.non_closed_workers > 0 && self.worker(slot).non_closed {
                s.make_linear(c);
            }
        }
        if s.linear.len() < s.cands.len() {
            s.solve(0, n - 1, first, s.holders_at(n - 1));
        }
        s.walk_linear();
        s.finish()
    }
}

impl<'a> Search<'a> {
    fn make_linear(&mut self, c: u32) {
        let cand = &mut self.cands[c as usize];
        if !cand.linear {
            cand.linear = true;
            self.linear.push(c);
        }
    }

    #[inline]
    fn holders_at(&self, pos: u32) -> &'a [u32] {
        let index: &'a KvIndex = self.index;
        index
            .blocks
            .get(&self.hashes[pos as usize].0)
            .map_or(&[], Holders::as_slice)
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
        let (mut i, mut j) = (0, 0);
        // The merge always stands at the first entry of a slot in both lists, so a worker's
        // level on each side is the entry under the cursor; its further entries (slower
        // copies of the same block) are skipped.
        while i < a.len() && j < b.len() {
            // Adjacent blocks mostly have the same holders: skip identical runs a chunk at a
            // time (branch-free, vectorized), then step past the rest of the run's last worker.
            if a[i] == b[j] {
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
            let (x, y) = (a[i], b[j]);
            let slot = slot_of(x).min(slot_of(y));
            let from = if slot_of(x) == slot {
                tier_of(x)
            } else {
                MISSING
            };
            let to = if slot_of(y) == slot {
                tier_of(y)
            } else {
                MISSING
            };
            i += (slot_of(x) == slot) as usize;
            j += (slot_of(y) == slot) as usize;
            while i < a.len() && slot_of(a[i]) == slot {
                i += 1;
            }
            while j < b.len() && slot_of(b[j]) == slot {
                j += 1;
            }
            if from != to {
                self.change(slot, from, to, pos);
            }
        }
        // What is left is on one side only: present at `pos - 1` and gone at `pos`, or new.
        let mut prev = u32::MAX;
        for &x in &a[i..] {
            if slot_of(x) != prev {
                prev = slot_of(x);
                self.change(prev, tier_of(x), MISSING, pos);
            }
        }
        for &y in &b[j..] {
            if slot_of(y) != prev {
                prev = slot_of(y);
                self.change(prev, MISSING, tier_of(y), pos);
            }
        }
    }

    /// A worker's level goes from `from` at `pos - 1` to `to` at `pos`.
    #[inline]
    fn change(&mut self, slot: u32, from: u8, to: u8, pos: u32) {
        // Non-candidates do not hold block 0: their answer is zero whatever they hold.
        let c = self.cand_of[slot as usize];
        if c == NOT_CAND || self.cands[c as usize].linear {
            return;
        }
        let cand = &mut self.cands[c as usize];
        if to < from || from != cand.level {
            // The level went down, or changed somewhere a skipped range hid: this worker is not
            // prefix-closed after all.
            self.make_linear(c);
            return;
        }
        cand.level = to;
        for k in from..to {
            cand.bounds[k as usize] = pos;
        }
    }

    /// Exact answers for the linear candidates: one pass over the prompt, dropping each worker
    /// at its first missing block and stopping when none is left.
    fn walk_linear(&mut self) {
        if self.linear.is_empty() {
            return;
        }
        let mut active = self.linear.clone();
        for &c in &active {
            self.cands[c as usize].bounds = [0; 3];
        }
        for pos in 0..self.hashes.len() as u32 {
            if active.is_empty() {
                break;
            }
            let list = self.holders_at(pos);
            let cands = &mut self.cands;
            active.retain(|&c| {
                let cand = &mut cands[c as usize];
                let level = level_in(list, cand.slot);
                if level == MISSING {
                    return false;
                }
                cand.bounds[level as usize] += 1;
                true
            });
        }
        // The walk counted per level; turn counts into cumulative boundaries like the search's.
        for &c in &self.linear {
            let b = &mut self.cands[c as usize].bounds;
            b[1] += b[0];
            b[2] += b[1];
        }
    }

    fn finish(self) -> OverlapScores {
        // Bounds are non-decreasing by construction (see `change`); saturating keeps a broken
        // invariant from panicking the router instead of returning a wrong count.
        let counts = |c: &Cand| TierCounts {
            device: c.bounds[0],
            host: c.bounds[1].saturating_sub(c.bounds[0]),
            disk: c.bounds[2].saturating_sub(c.bounds[1]),
        };
        let by_id = &self.index.by_id;
        // Every candidate holds block 0, so every one is in the answer. Sorting k candidates
        // costs k·log k; walking the id-ordered worker list costs one probe per known worker.
        let scores = if self.cands.len() * 8 >= by_id.len() {
            by_id
                .iter()
                .filter_map(|&(id, slot)| {
                    let c = self.cand_of[slot as usize];
                    (c != NOT_CAND).then(|| (id, counts(&self.cands[c as usize])))
                })
                .collect()
        } else {
            let mut v: Vec<_> = self
                .cands
                .iter()
                .map(|c| (self.index.worker(c.slot).id, counts(c)))
                .collect();
            v.sort_unstable_by_key(|&(id, _)| id);
            v
        };
        OverlapScores { scores }
    }
}
