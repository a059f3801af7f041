//! `find_extents`: the search behind [`Extents`].
//!
//! It walks the prompt as `find_matches` does (see `matches.rs`: equal holder lists at two
//! positions prove that nobody changes tier between them), with one more kind of state: the
//! **bulk**, the candidates that have not been looked at one by one. At the start every holder
//! of the first block is in the bulk, represented by that holder list itself (`base`) and a
//! count per tier of its workers (kept by the spill arena for long lists, so this costs
//! nothing per worker); nothing is written per worker. The bulk's invariant: each of its
//! workers has kept, from position 0 to the current one, the tier of its first entry in
//! `base` (so it is also in every holder list compared so far, at that tier).
//!
//! At a position where the holder list goes from `a` to `b`:
//!
//! - if `b` is much shorter than `a` (a shared extent ends: most of `a` drops out here), a
//!   **lazy step** looks only at `b`, at the explicit candidates and at the slots already
//!   touched: bulk workers of `b` that keep their tier stay in the bulk, the others become
//!   explicit; the bulk workers not in `b` form a lazy part "first entry of `base` in tier t,
//!   not in `b`" with counts `pos` blocks in tier t; then `b` becomes the bulk's `base`. When
//!   the bulk's and `b`'s workers are all on device, the step does not even read `b`'s
//!   entries: under prefix closure every worker of `b` is in `a` at a tier no better, so they
//!   are all bulk workers that stay;
//! - otherwise a **merge** of `a` and `b`, as in `find_matches`: a bulk worker met changing
//!   tier or dropping out becomes explicit (its level is known: its tier in `a`), which costs
//!   per such worker, and identical runs are skipped 16 entries at a time as there.
//!
//! At the end the bulk that is left holds every block of the prompt: one lazy part per tier
//! with no `minus`. Explicit candidates are then grouped by their counts.
//!
//! Under prefix closure a worker absent from `a` cannot appear in `b` (it would hold a block
//! without its parent), so a slot met in `b` and not in `a` is no candidate; it is marked
//! `SKIP` (and excluded from lazy parts) rather than trusted. Flagged (`non_closed`) workers
//! are explicit from the start and walked linearly, as in `find_matches`.
//!
//! The positions looked at differ from `find_matches`' (see `ExtSearch::solve`): while the
//! holder list is a shared one, the search gallops from the start instead of bisecting from
//! the end, because shared blocks are in cache and a prompt's own blocks are not.

use tandem_protocol::SequenceHash;

use super::KvIndex;
use super::extents::{Extents, Part};
use super::holders::{MISSING, level_in, slot_of, tier_of};
use super::matches::{
    CHUNK, NOT_CAND, SCRATCH, SKIP, Scratch, Search, TierCounts, counts_of, same,
};

/// The candidates not followed one by one (see the module doc).
#[derive(Clone, Copy)]
struct Bulk<'a> {
    base: &'a [u32],
    /// Bulk workers per tier of their first entry in `base`.
    count: [u32; 3],
}

impl Bulk<'_> {
    fn device_only(&self) -> bool {
        self.count[1] == 0 && self.count[2] == 0
    }
}

/// A holder list and its workers per tier of their first entry (kept by the spill arena for
/// long lists, so reading them costs nothing per worker).
#[derive(Clone, Copy)]
struct List<'a> {
    holders: &'a [u32],
    firsts: [u32; 3],
}

impl List<'_> {
    fn device_only(&self) -> bool {
        self.firsts[1] == 0 && self.firsts[2] == 0
    }
}

/// Whether two holder lists are equal (the same list of the index, or the same contents).
#[inline]
fn same_list(a: List<'_>, b: List<'_>) -> bool {
    std::ptr::eq(a.holders, b.holders) || a.holders == b.holders
}

/// The level of `slot` in `list`, searching forward from `*cur` (galloping: the slots asked
/// for ascend, so the cost is logarithmic in the distance covered).
#[inline]
fn gallop_level(list: &[u32], cur: &mut usize, slot: u32) -> u8 {
    let below = |i: usize| list.get(i).is_some_and(|&h| slot_of(h) < slot);
    let (mut lo, mut step) = (*cur, 1);
    while below(lo + step - 1) {
        lo += step;
        step *= 2;
    }
    // The first entry at or past `slot` is in lo..lo + step.
    let end = (lo + step).min(list.len());
    let i = lo + list[lo.min(end)..end].partition_point(|&h| slot_of(h) < slot);
    *cur = i;
    match list.get(i) {
        Some(&h) if slot_of(h) == slot => tier_of(h),
        _ => MISSING,
    }
}

struct ExtSearch<'a, 'h> {
    /// `level`, `bounds`, the linear walk and the per-worker level changes.
    s: Search<'a, 'h>,
    /// `init[l]`: the bounds of a worker at level `l` from position 0 to the end.
    init: [[u32; 3]; 4],
    bulk: Option<Bulk<'a>>,
    /// Every slot whose `level` was written (explicit candidates and `SKIP`), each once.
    touched: Vec<u32>,
    /// Explicit candidates that may still be at a level below `MISSING`; compacted lazily.
    live: Vec<u32>,
    /// Lazy parts with their counts.
    parts: Vec<(Part<'a>, TierCounts)>,
}

impl KvIndex {
    /// [`KvIndex::find_matches`]' answer grouped by shared extent: a few groups of workers
    /// with equal [`TierCounts`], built without visiting the workers that share a prefix (see
    /// [`Extents`] for the representation, its cost and when it is exact).
    pub fn find_extents(&self, hashes: &[SequenceHash]) -> Extents<'_> {
        let hashes = &hashes[..hashes.len().min(u32::MAX as usize)];
        let Some(&h0) = hashes.first() else {
            return Extents::empty(self);
        };
        let (first, firsts) = self.holders_counted(h0.0);
        if first.is_empty() {
            return Extents::empty(self);
        }
        let n = hashes.len() as u32;
        let mut sc = SCRATCH.with(|c| c.take());
        sc.reset(self.slots.len());
        let mut e = ExtSearch {
            s: Search {
                index: self,
                hashes,
                level: sc.level,
                bounds: sc.bounds,
                cands: Vec::new(),
                n_cands: 0,
                dense: false,
                linear: sc.linear,
                live: Vec::new(),
            },
            init: [0u32, 1, 2, 3].map(|l0| [0, 1, 2].map(|k| if k < l0 { 0 } else { n })),
            bulk: Some(Bulk {
                base: first,
                count: firsts,
            }),
            touched: sc.cands,
            live: sc.live,
            parts: Vec::new(),
        };
        e.flagged(first);
        // The last block's slot loads while the search walks the (usually cached) start.
        std::hint::black_box(self.blocks.touch(hashes[n as usize - 1].0));
        let first = List {
            holders: first,
            firsts,
        };
        e.solve(0, n - 1, first, None);
        if let Some(bulk) = e.bulk.take() {
            e.drop_bulk(bulk, &[], [0; 3], n);
        }
        e.s.walk_linear();
        let (extents, scratch) = e.finish();
        SCRATCH.with(|c| c.set(scratch));
        extents
    }
}

impl<'a> ExtSearch<'a, '_> {
    /// Flagged workers: explicit and linear if they hold the first block, else `SKIP`.
    fn flagged(&mut self, first: &[u32]) {
        let index = self.s.index;
        for &slot in &index.non_closed_slots {
            let l = level_in(first, slot);
            if l == MISSING {
                self.skip(slot);
            } else {
                self.explicit(slot, l);
                self.s.make_linear(slot);
            }
        }
    }

    /// Marks a slot that is no candidate.
    fn skip(&mut self, slot: u32) {
        self.s.level[slot as usize] = SKIP;
        self.touched.push(slot);
    }

    /// Follows a bulk worker one by one from now on: it has been at level `l` since position
    /// 0 (the bulk invariant).
    fn explicit(&mut self, slot: u32, l: u8) {
        self.s.level[slot as usize] = l;
        self.s.bounds[slot as usize] = self.init[l as usize];
        self.touched.push(slot);
        self.live.push(slot);
        if let Some(b) = &mut self.bulk {
            b.count[l as usize] = b.count[l as usize].saturating_sub(1);
        }
    }

    fn list_at(&self, pos: u32) -> List<'a> {
        let index: &'a KvIndex = self.s.index;
        let (holders, firsts) = index.holders_counted(self.s.hashes[pos as usize].0);
        List { holders, firsts }
    }

    /// Records the changes between positions `lo` (list `a`) and `hi` (list `b`).
    ///
    /// `find_matches` bisects `lo..hi`. Here, while the current list is held by several
    /// workers, the search gallops instead: lists at `lo + 1`, `lo + 2`, `lo + 4`, … up to the
    /// first that differs, then a bisection of that last gap for the first change, and on from
    /// there. Blocks many workers hold (a shared prefix) are looked up by many queries and are
    /// in cache, while each lookup in a prompt's own blocks is a cache miss; where a shared
    /// prefix ends early, galloping over it finds the end with a couple of misses, where
    /// bisecting from the far end would take one per level (about 8 in a row for 256 blocks).
    /// Once the list is one or two workers', the rest is bisected: galloping over a long
    /// private tail would miss more than bisecting it.
    ///
    /// `b` is read only when needed (`None`: not read yet): the caller has started loading its
    /// slot, and the gallop over cached blocks runs meanwhile.
    fn solve(&mut self, mut lo: u32, hi: u32, mut a: List<'a>, mut b: Option<List<'a>>) {
        while a.holders.len() > 2 {
            let mut prev = lo;
            let mut step = 1;
            let (q, lq) = loop {
                let q = lo.saturating_add(step);
                if q >= hi {
                    break (hi, self.end(&mut b, hi));
                }
                let lq = self.list_at(q);
                if !same_list(a, lq) {
                    break (q, lq);
                }
                prev = q;
                step = step.saturating_mul(2);
            };
            self.bisect(prev, q, a, lq);
            if q == hi {
                return;
            }
            (lo, a) = (q, lq);
        }
        let b = self.end(&mut b, hi);
        self.bisect(lo, hi, a, b);
    }

    /// The list at `hi`, read now if it was not.
    fn end(&mut self, b: &mut Option<List<'a>>, hi: u32) -> List<'a> {
        *b.get_or_insert_with(|| self.list_at(hi))
    }

    /// As `Search::solve`, with this search's `diff`.
    fn bisect(&mut self, lo: u32, hi: u32, a: List<'a>, b: List<'a>) {
        if same_list(a, b) {
            return;
        }
        if hi - lo == 1 {
            self.diff(hi, a, b);
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let m = self.list_at(mid);
        self.bisect(lo, mid, a, m);
        self.bisect(mid, hi, m, b);
    }

    /// Positions `pos - 1` and `pos` have holder lists `a` and `b`.
    fn diff(&mut self, pos: u32, a: List<'a>, b: List<'a>) {
        if let Some(bulk) = self.bulk {
            // A merge costs at least a step per bulk worker that drops out, and at least
            // `a.len() - b.len()` do; a lazy step costs a lookup per touched slot, plus one per
            // entry of `b` unless everything is on device. Lazy when that is less.
            let fast = bulk.device_only() && b.device_only();
            let (a_len, b_len) = (a.holders.len(), b.holders.len());
            let lazy_cost = self.touched.len() + 8 + if fast { 0 } else { b_len };
            if a_len > b_len + lazy_cost {
                self.lazy_step(pos, a.holders, b, bulk, fast);
                return;
            }
        }
        self.merge(pos, a.holders, b.holders);
        if self.bulk.is_some_and(|b| b.count == [0; 3]) {
            self.bulk = None;
        }
    }

    /// See the module doc. `fast`: the bulk's and `b`'s workers are all on device.
    fn lazy_step(&mut self, pos: u32, a: &[u32], b: List<'a>, bulk: Bulk<'a>, fast: bool) {
        let (firsts, b) = (b.firsts, b.holders);
        // Explicit candidates still in the prompt: their levels on both sides.
        let mut live = std::mem::take(&mut self.live);
        live.retain(|&slot| self.s.level[slot as usize] < MISSING);
        for &slot in &live {
            let (from, to) = (level_in(a, slot), level_in(b, slot));
            if from != to {
                self.s.change(slot, from, to, pos);
            }
        }
        self.live = live;
        // Bulk workers of `b` that change tier become explicit; a slot of `b` that is not in
        // `a` is no candidate. Under prefix closure neither happens when all is on device.
        if !fast {
            let (mut prev, mut cur) = (u32::MAX, 0);
            for &h in b {
                let slot = slot_of(h);
                if slot == prev || self.s.level[slot as usize] != NOT_CAND {
                    prev = slot;
                    continue;
                }
                prev = slot;
                let (from, to) = (gallop_level(a, &mut cur, slot), tier_of(h));
                if from == MISSING {
                    self.skip(slot);
                } else if from != to {
                    self.explicit(slot, from);
                    self.s.change(slot, from, to, pos);
                }
            }
        }
        // The untouched workers of `b` are the new bulk.
        let mut stay = firsts;
        for &slot in &self.touched {
            let t = level_in(b, slot);
            if t < MISSING {
                stay[t as usize] = stay[t as usize].saturating_sub(1);
            }
        }
        // `explicit` above took its conversions off `self.bulk`'s counts.
        let bulk = Bulk {
            count: self.bulk.map_or(bulk.count, |b| b.count),
            ..bulk
        };
        self.drop_bulk(bulk, b, stay, pos);
        self.bulk = (stay != [0; 3]).then_some(Bulk {
            base: b,
            count: stay,
        });
    }

    /// The bulk workers not staying (`stay` per tier, in `minus`) end at `pos`: lazy parts.
    fn drop_bulk(&mut self, bulk: Bulk<'a>, minus: &'a [u32], stay: [u32; 3], pos: u32) {
        for t in 0..3u8 {
            let len = bulk.count[t as usize].saturating_sub(stay[t as usize]);
            if len == 0 {
                continue;
            }
            let mut bounds = self.init[t as usize];
            bounds[t as usize..].fill(pos);
            let part = Part {
                base: bulk.base,
                minus,
                tier: t,
                len,
            };
            self.parts.push((part, counts_of(&bounds)));
        }
    }

    /// As `Search::diff`, turning the bulk workers it meets changing into explicit ones.
    fn merge(&mut self, pos: u32, a: &[u32], b: &[u32]) {
        let (mut i, mut j) = (0, 0);
        while i < a.len() {
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

    /// A worker at `from` in `a` goes to `to` in `b`.
    #[inline]
    fn change(&mut self, slot: u32, from: u8, to: u8, pos: u32) {
        if self.s.level[slot as usize] == NOT_CAND {
            if self.bulk.is_none() {
                return;
            }
            self.explicit(slot, from);
        }
        self.s.change(slot, from, to, pos);
    }

    /// As `Search::disappear_run`: workers of `a` from `i` on, below slot `until`, are not in
    /// `b`.
    fn disappear_run(&mut self, pos: u32, a: &[u32], i: usize, until: u32) -> usize {
        let end = i + a[i..].partition_point(|&h| slot_of(h) < until);
        let mut prev = u32::MAX;
        for &x in &a[i..end] {
            let slot = slot_of(x);
            if slot == prev {
                continue;
            }
            prev = slot;
            self.change(slot, tier_of(x), MISSING, pos);
        }
        end
    }

    /// The worker of `b[j]` is not in `a`. Returns the index past its entries.
    fn appear(&mut self, pos: u32, b: &[u32], mut j: usize) -> usize {
        let slot = slot_of(b[j]);
        if self.s.level[slot as usize] == NOT_CAND {
            // No candidate; marked so that it never counts as bulk if `b` becomes a base.
            if self.bulk.is_some() {
                self.skip(slot);
            }
        } else {
            self.s.change(slot, MISSING, tier_of(b[j]), pos);
        }
        j += 1;
        while j < b.len() && slot_of(b[j]) == slot {
            j += 1;
        }
        j
    }

    /// The answer, and the buffers back for the next query (touched entries reset).
    fn finish(mut self) -> (Extents<'a>, Scratch) {
        let mut explicit = Vec::with_capacity(self.touched.len());
        for &slot in &self.touched {
            let l = &mut self.s.level[slot as usize];
            if *l != SKIP {
                let counts = counts_of(&self.s.bounds[slot as usize]);
                // A candidate holds block 0; a broken invariant must not make an empty entry.
                if counts.total() > 0 {
                    explicit.push((counts, slot));
                }
            }
            *l = NOT_CAND;
        }
        debug_assert!(self.s.level.iter().all(|&l| l == NOT_CAND));
        let mut excluded = self.touched.clone();
        excluded.sort_unstable();
        let extents = Extents::new(self.s.index, explicit, self.parts, excluded);
        self.touched.clear();
        self.live.clear();
        self.s.linear.clear();
        let scratch = Scratch {
            level: self.s.level,
            bounds: self.s.bounds,
            cands: self.touched,
            linear: self.s.linear,
            live: self.live,
        };
        (extents, scratch)
    }
}
