//! [`Extents`]: the answer of [`KvIndex::find_extents`], per-worker overlap grouped by shared
//! extent and built without a cost per matching worker.
//!
//! # What it says
//!
//! The same as [`KvIndex::find_matches`] — for every worker that holds the prompt's first block,
//! how many leading blocks it holds and in which tier — but as a short list of groups
//! ([`Extent`]), each one [`TierCounts`] and the set of workers that have exactly those counts.
//! Groups have distinct counts and disjoint members; workers that hold nothing of the prompt
//! (not even its first block) are in no group. Groups come best first: by total matched blocks,
//! then by device blocks, then by host blocks, all descending.
//!
//! # Representation and cost
//!
//! A query over a cluster where most workers share a prefix (a system prompt, a few-shot
//! preamble) finds that the holder list of the prompt's blocks is long up to some position and
//! short after it. [`KvIndex::find_matches`] then writes one entry per worker that held the long
//! list; here those workers are never visited. A group has up to two parts:
//!
//! - **explicit**: a sorted list of worker slots, for the workers the search had to follow one
//!   by one (those that change tier or drop out where few others do, and workers answered by
//!   the exact linear walk);
//! - **lazy**: a reference to holder lists already stored in the index — *the workers whose
//!   first entry in list `base` is in tier `t`, minus the workers in list `minus`, minus every
//!   slot the search touched* (the query's `excluded` list). `base` is the holder list of the
//!   block where those workers' shared extent was last seen whole, `minus` that of the block
//!   where it ends (the few workers that go on), or nothing for workers that hold the whole
//!   prompt.
//!
//! A group has at most one lazy part. On the Mooncake replay (999 of 1,000 workers share a
//! 32-block system prompt, one holds the conversation) the answer is two lazy groups: "the
//! holders of block 31 but not of block 32" (blocks counted from 0) with 32 device blocks,
//! and "the holders of block 32" with 256.
//!
//! Building the answer costs the search's lookups (a few per position where holders change,
//! as for `find_matches`; see `extent_search.rs`) and a few operations per explicit worker,
//! nothing per lazy member: a lazy part's size comes from per-tier counts the index keeps for
//! every long holder list. Shared blocks of one chain usually share one holder list in the
//! index (see `holders.rs`), so comparing their lists is comparing two addresses. Reading it:
//!
//! - [`Extents::iter`], [`Extent::counts`], [`Extent::len`]: O(1) per group;
//! - [`Extent::workers`]: O(`base` + `minus` + `excluded` entries) for a lazy part (a merge of
//!   sorted lists, a few ns per entry), O(members) for the explicit part;
//! - [`Extents::get`]: one worker-id lookup, then O(groups × log(list length));
//! - [`Extents::to_scores`]: the per-worker list, sorted by id, for callers of the old API.
//!
//! The answer borrows the index: it is read under whatever lock guards the index, and the index
//! cannot change while it is alive.
//!
//! # Consuming it (a scorer)
//!
//! Walk [`Extents::iter`] best first; per group, compute what depends on the overlap once
//! from [`Extent::counts`] (prefill blocks saved, transfer cost of host or disk blocks), then
//! combine it with each member's own state by iterating [`Extent::workers`], or skip the
//! group when even its best member cannot beat the best found so far (groups are ordered by
//! overlap, so a scorer whose cost falls with overlap can often stop early).
//! [`Extent::len`] tells in O(1) how many members a group has without walking it.
//!
//! Workers in no group are every known worker that does not hold the prompt's first block:
//! their overlap is zero, and the answer does not list them (nor did `find_matches`). A scorer
//! that also weighs load must take them from its own worker list; knowing a worker's overlap
//! from that list costs [`Extents::get`] per worker, so a scorer that visits every worker
//! anyway should first mark the matched ones by walking the groups (O(matched workers), a
//! few ns each) rather than ask per worker.
//!
//! # Exactness
//!
//! Exactly `find_matches`' answer (`to_scores() == find_matches(..)`, checked by property tests)
//! whenever every worker keeps the contract `find_matches` relies on (Device, Device ∪ Host and
//! Device ∪ Host ∪ Disk prefix-closed) or has been flagged for breaking it (flagged workers are
//! walked linearly by both). For a worker that breaks the contract unflagged (a `Removed` of an
//! interior block), both are approximations and may differ: `find_matches` re-checks every
//! worker at every position where the lists differ, while a lazy part trusts the contract for
//! the workers it represents. Then also a lazy part's [`Extent::len`] may differ from what its
//! iteration yields; the iteration is authoritative.

use std::cmp::Reverse;

use tandem_protocol::WorkerId;

use super::KvIndex;
use super::holders::{MISSING, level_in, slot_of, tier_of};
use super::matches::{OverlapScores, TierCounts};

/// `GroupData::part` of a group without a lazy part.
const NO_PART: u32 = u32::MAX;

/// A lazy set of workers (see the module doc).
#[derive(Clone, Copy, Debug)]
pub(super) struct Part<'a> {
    /// A holder list of the index: members are workers whose first entry here is in `tier`.
    pub(super) base: &'a [u32],
    /// A holder list of the index: workers with any entry here are not members.
    pub(super) minus: &'a [u32],
    pub(super) tier: u8,
    /// Members (see the module doc on exactness).
    pub(super) len: u32,
}

impl Part<'_> {
    /// Whether `slot` is a member (given that it is not excluded).
    fn contains(&self, slot: u32) -> bool {
        level_in(self.base, slot) == self.tier && level_in(self.minus, slot) == MISSING
    }
}

/// One group as stored.
#[derive(Clone, Copy, Debug)]
pub(super) struct GroupData {
    pub(super) counts: TierCounts,
    pub(super) len: u32,
    /// Index into `Extents::parts`, or `NO_PART`.
    pub(super) part: u32,
    /// Range of `Extents::members`.
    pub(super) members: (u32, u32),
}

/// Per-worker overlap with a prompt, grouped by shared extent (see the module doc).
#[derive(Clone)]
pub struct Extents<'a> {
    index: &'a KvIndex,
    groups: Vec<GroupData>,
    /// Lazy parts, with the counts they were made for.
    parts: Vec<(Part<'a>, TierCounts)>,
    /// Explicit members, group after group, each group's run ascending by slot.
    members: Vec<u32>,
    /// Every slot the search touched, ascending: never a member of a lazy part.
    excluded: Vec<u32>,
}

/// The order of groups: best first.
pub(super) fn rank(c: &TierCounts) -> (Reverse<u32>, Reverse<u32>, Reverse<u32>) {
    (Reverse(c.total()), Reverse(c.device), Reverse(c.host))
}

impl<'a> Extents<'a> {
    /// No group: nobody holds the prompt's first block.
    pub(super) fn empty(index: &'a KvIndex) -> Self {
        Extents {
            index,
            groups: Vec::new(),
            parts: Vec::new(),
            members: Vec::new(),
            excluded: Vec::new(),
        }
    }

    /// Assembles the answer. `explicit` is (counts, slot) per explicit candidate, `parts` the
    /// lazy parts with their counts; `excluded` must be sorted.
    pub(super) fn new(
        index: &'a KvIndex,
        mut explicit: Vec<(TierCounts, u32)>,
        parts: Vec<(Part<'a>, TierCounts)>,
        excluded: Vec<u32>,
    ) -> Self {
        explicit.sort_unstable_by(|x, y| rank(&x.0).cmp(&rank(&y.0)).then(x.1.cmp(&y.1)));
        let mut groups: Vec<GroupData> = Vec::new();
        for (i, &(counts, _)) in explicit.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if g.counts == counts => {
                    g.len += 1;
                    g.members.1 += 1;
                }
                _ => groups.push(GroupData {
                    counts,
                    len: 1,
                    part: NO_PART,
                    members: (i as u32, i as u32 + 1),
                }),
            }
        }
        let members = explicit.into_iter().map(|(_, s)| s).collect();
        let explicit_groups = groups.len();
        for (i, &(part, counts)) in parts.iter().enumerate() {
            let i = i as u32;
            // Explicit groups are sorted by rank, hence by counts' rank: one binary search.
            let at =
                groups[..explicit_groups].binary_search_by(|g| rank(&g.counts).cmp(&rank(&counts)));
            match at {
                Ok(g) if groups[g].counts == counts => {
                    groups[g].part = i;
                    groups[g].len += part.len;
                }
                _ => groups.push(GroupData {
                    counts,
                    len: part.len,
                    part: i,
                    members: (0, 0),
                }),
            }
        }
        if groups.len() > explicit_groups {
            groups.sort_by_key(|g| rank(&g.counts));
        }
        Extents {
            index,
            groups,
            parts,
            members,
            excluded,
        }
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether nobody holds the prompt's first block.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The groups, best first.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Extent<'_>> + '_ {
        self.groups
            .iter()
            .map(move |g| Extent { all: self, data: g })
    }

    /// Workers in all groups (O(groups); see [`Extent::len`]).
    pub fn num_workers(&self) -> usize {
        self.groups.iter().map(|g| g.len as usize).sum()
    }

    /// The counts of one worker, `None` when it matched nothing (O(groups × log)).
    pub fn get(&self, worker: WorkerId) -> Option<TierCounts> {
        let &slot = self.index.slot_of.get(&worker)?;
        if self.excluded.binary_search(&slot).is_ok() {
            return self.groups.iter().find_map(|g| {
                let run = &self.members[g.members.0 as usize..g.members.1 as usize];
                run.binary_search(&slot).is_ok().then_some(g.counts)
            });
        }
        self.groups.iter().find_map(|g| {
            let (part, _) = self.parts.get(g.part as usize)?;
            part.contains(slot).then_some(g.counts)
        })
    }

    /// The per-worker answer, sorted by worker id, as [`KvIndex::find_matches`] gives it
    /// (O(workers × log workers)).
    pub fn to_scores(&self) -> OverlapScores {
        let mut scores = Vec::with_capacity(self.num_workers());
        for g in self.iter() {
            let counts = g.counts();
            scores.extend(g.workers().map(|w| (w, counts)));
        }
        scores.sort_unstable_by_key(|&(w, _)| w);
        OverlapScores { scores }
    }

    /// Lazy parts and explicit members (for tests of the representation).
    #[cfg(test)]
    pub(super) fn shape(&self) -> (usize, usize) {
        (self.parts.len(), self.members.len())
    }
}

impl std::fmt::Debug for Extents<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One group of [`Extents`]: the workers that hold exactly [`Extent::counts`] of the prompt.
#[derive(Clone, Copy)]
pub struct Extent<'e> {
    all: &'e Extents<'e>,
    data: &'e GroupData,
}

impl<'e> Extent<'e> {
    /// The leading blocks each member holds, by tier.
    pub fn counts(&self) -> TierCounts {
        self.data.counts
    }

    /// Members (O(1); exact while the index's workers keep the prefix-closure contract, see
    /// the module doc).
    pub fn len(&self) -> usize {
        self.data.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.data.len == 0
    }

    /// The members: the explicit ones ascending by slot, then the lazy part's in slot order
    /// (index-internal order, stable while the index does not change; not by id).
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + 'e {
        let all = self.all;
        let run = &all.members[self.data.members.0 as usize..self.data.members.1 as usize];
        let explicit = run.iter().map(move |&s| all.index.worker(s).id);
        let lazy = all
            .parts
            .get(self.data.part as usize)
            .map(|&(part, _)| PartIter {
                all,
                part,
                i: 0,
                m: 0,
                x: 0,
            })
            .into_iter()
            .flatten();
        explicit.chain(lazy)
    }

    /// Whether `worker` is a member (O(log)).
    pub fn contains(&self, worker: WorkerId) -> bool {
        let all = self.all;
        let Some(&slot) = all.index.slot_of.get(&worker) else {
            return false;
        };
        if all.excluded.binary_search(&slot).is_ok() {
            let run = &all.members[self.data.members.0 as usize..self.data.members.1 as usize];
            return run.binary_search(&slot).is_ok();
        }
        all.parts
            .get(self.data.part as usize)
            .is_some_and(|(p, _)| p.contains(slot))
    }
}

impl std::fmt::Debug for Extent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extent")
            .field("counts", &self.data.counts)
            .field("len", &self.data.len)
            .field("lazy", &(self.data.part != NO_PART))
            .finish()
    }
}

/// The members of a lazy part: a merge of `base` against `minus` and `excluded`.
struct PartIter<'e> {
    all: &'e Extents<'e>,
    part: Part<'e>,
    /// Cursors into `base`, `minus` and `excluded`.
    i: usize,
    m: usize,
    x: usize,
}

impl Iterator for PartIter<'_> {
    type Item = WorkerId;

    fn next(&mut self) -> Option<WorkerId> {
        let (base, minus, excluded) = (self.part.base, self.part.minus, &self.all.excluded);
        while let Some(&h) = base.get(self.i) {
            let slot = slot_of(h);
            // A worker's entries are adjacent and its first one is its level.
            self.i += 1;
            while base.get(self.i).is_some_and(|&x| slot_of(x) == slot) {
                self.i += 1;
            }
            if tier_of(h) != self.part.tier {
                continue;
            }
            while minus.get(self.m).is_some_and(|&x| slot_of(x) < slot) {
                self.m += 1;
            }
            if minus.get(self.m).is_some_and(|&x| slot_of(x) == slot) {
                continue;
            }
            while excluded.get(self.x).is_some_and(|&s| s < slot) {
                self.x += 1;
            }
            if excluded.get(self.x) == Some(&slot) {
                continue;
            }
            return Some(self.all.index.worker(slot).id);
        }
        None
    }
}
