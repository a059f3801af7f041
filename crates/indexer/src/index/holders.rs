//! The compact holder list of one block, and the arena its long lists spill to.
//!
//! A holder is a (worker slot, tier) pair packed into a `u32`: the slot in the high 30 bits, the
//! tier index (0 = Device, 1 = Host, 2 = Disk) in the low 2. Lists are kept sorted, so a
//! worker's entries are adjacent with its fastest tier first, and `find_matches` can either scan
//! a block's holders once for all workers or binary-search it for a few.
//!
//! Most blocks have one or two holders (a prompt prefix is usually cached by the one or two
//! workers the router sent it to), so [`Holders`] is two `u32`s stored in the block map itself,
//! which makes a map slot 16 bytes (8-byte key + 8-byte value):
//!
//! - **inline**: `[a, b]`, `a` a holder and `b` either a holder above it or [`EMPTY`];
//! - **spilled**: `a`'s tier bits are 3 (no tier has that index) and `a >> 2` indexes a sorted
//!   `Vec<u32>` in [`Spills`], an arena owned by the index. Only widely shared blocks (system
//!   prompts) pay that extra indirection and the list's 24 + 12 + 4 bytes of arena slot plus 4
//!   × capacity bytes; the blocks of one shared chain usually share one list (copy on write,
//!   see [`Spills`]), and each list keeps its workers' count per tier ([`first_tiers`]) for
//!   `find_extents`.
//!
//! A list with no holder is never stored: removing the last holder reports
//! [`Removal::Emptied`] and the caller drops the map entry. `[0, 0]` (slot 0 twice) is no list
//! either way, and marks a vacant slot of the block map ([`Holders::VACANT`]).

/// Bits of a holder that carry the tier.
const TIER_BITS: u32 = 2;
const TIER_MASK: u32 = (1 << TIER_BITS) - 1;
/// Number of worker slots a holder can name.
pub(crate) const MAX_SLOTS: usize = 1 << (32 - TIER_BITS);
/// Tier bits of the first word of a spilled list (no tier has index 3).
const SPILL_TAG: u32 = TIER_MASK;
/// Number of spilled lists the tag can index.
const MAX_SPILLS: usize = 1 << (32 - TIER_BITS);
/// The second inline word when only one holder is inline. Its tier bits are 3, so it is never
/// a holder, and it sorts after every holder.
const EMPTY: u32 = u32::MAX;
/// Holders kept inline before spilling.
const INLINE: usize = 2;
/// A spilled list goes back inline when it shrinks to this size. Lower than [`INLINE`] so that a
/// block whose holder count oscillates around the limit does not allocate on every change.
const UNSPILL_AT: usize = INLINE - 1;
/// Initial capacity of a spilled list (it spills at `INLINE + 1` holders).
const SPILL_CAPACITY: usize = 4;

/// Packs a slot and a tier index into a holder.
#[inline(always)]
pub(crate) fn pack(slot: u32, tier: usize) -> u32 {
    debug_assert!((slot as usize) < MAX_SLOTS && tier < 3);
    (slot << TIER_BITS) | tier as u32
}

/// The worker slot of a holder.
#[inline(always)]
pub(crate) fn slot_of(holder: u32) -> u32 {
    holder >> TIER_BITS
}

/// The tier index (the worker's "level" for this block) of a holder.
#[inline(always)]
pub(crate) fn tier_of(holder: u32) -> u8 {
    (holder & TIER_MASK) as u8
}

/// Level of a worker that does not hold a block.
pub(crate) const MISSING: u8 = 3;

/// The level of `slot` in a sorted holder list: its first entry is its fastest tier, or
/// [`MISSING`].
#[inline]
pub(crate) fn level_in(list: &[u32], slot: u32) -> u8 {
    let i = list.partition_point(|&h| slot_of(h) < slot);
    match list.get(i) {
        Some(&h) if slot_of(h) == slot => tier_of(h),
        _ => MISSING,
    }
}

/// Workers of a sorted holder list per tier of their first entry (their level there).
pub(crate) fn first_tiers(list: &[u32]) -> [u32; 3] {
    let mut c = [0u32; 3];
    let mut prev = u32::MAX;
    for &h in list {
        if slot_of(h) != prev {
            prev = slot_of(h);
            c[tier_of(h) as usize] += 1;
        }
    }
    c
}

/// Spilled holder lists (blocks with more than [`INLINE`] holders), indexed by the tag in
/// their [`Holders`]. Released indices are reused before the arena grows.
///
/// A list may be shared by several blocks (copy on write, with a count of the blocks pointing
/// at it). The blocks of a chain that many workers hold (a system prompt) have equal holder
/// lists, and a worker storing or evicting the chain changes them all in the same way, one
/// after the other: the arena remembers the last copy it made (`memo`: this list, this change,
/// that result) and hands the same result to the next block whose list and change are the
/// same. Such a chain then costs one list instead of one per block, a worker joining it one
/// copy instead of a memmove per block, and `find_extents` compares its blocks' lists by
/// address instead of entry by entry. Lists that were equal but reached by other paths stay
/// separate (the arena does not look lists up by content).
#[derive(Debug, Default)]
pub(crate) struct Spills {
    lists: Vec<Vec<u32>>,
    /// Per list, [`first_tiers`] of it, kept up to date by inserts and removals so that
    /// `find_extents` counts a long list's workers per tier without reading it.
    firsts: Vec<[u32; 3]>,
    /// Per list, the blocks whose [`Holders`] point at it (0 for a free index).
    refs: Vec<u32>,
    free: Vec<u32>,
    memo: Option<Memo>,
}

/// The last copy-on-write change: `from` with `holder` inserted (or removed) is `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Memo {
    from: Holders,
    holder: u32,
    insert: bool,
    to: Holders,
}

impl Spills {
    /// A new list with one block pointing at it.
    fn alloc(&mut self, list: Vec<u32>, firsts: [u32; 3]) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.firsts[i as usize] = firsts;
                self.lists[i as usize] = list;
                self.refs[i as usize] = 1;
                i
            }
            None => {
                // Each spilled list is a block with 3+ holders; 2^30 of them would need tens
                // of GiB of map first.
                assert!(
                    self.lists.len() < MAX_SPILLS,
                    "more than 2^30 spilled lists"
                );
                self.firsts.push(firsts);
                self.lists.push(list);
                self.refs.push(1);
                (self.lists.len() - 1) as u32
            }
        }
    }

    /// Forgets the memo if it names list `i` (about to change or go).
    #[inline]
    fn forget(&mut self, i: u32) {
        if let Some(m) = self.memo
            && (m.from.spilled() == Some(i) || m.to.spilled() == Some(i))
        {
            self.memo = None;
        }
    }

    /// The result the memo holds for this change of `from`, counted as one more user.
    #[inline]
    fn recall(&mut self, from: Holders, holder: u32, insert: bool) -> Option<Holders> {
        let m = self.memo?;
        if m.from != from || m.holder != holder || m.insert != insert {
            return None;
        }
        if let Some(j) = m.to.spilled() {
            self.refs[j as usize] += 1;
        }
        Some(m.to)
    }

    /// One block fewer points at list `i`; the last one frees it.
    fn unref(&mut self, i: u32) {
        self.refs[i as usize] -= 1;
        if self.refs[i as usize] == 0 {
            self.forget(i);
            self.free.push(i);
            self.lists[i as usize] = Vec::new();
        }
    }

    /// List `i`, or a copy of it if other blocks share it, ready to be changed for one block
    /// (which then points at the returned index).
    fn own(&mut self, i: u32) -> u32 {
        if self.refs[i as usize] == 1 {
            self.forget(i);
            return i;
        }
        self.refs[i as usize] -= 1;
        let mut copy = Vec::with_capacity(self.lists[i as usize].len() + 1);
        copy.extend_from_slice(&self.lists[i as usize]);
        self.alloc(copy, self.firsts[i as usize])
    }

    /// Inserts `holder` at `pos` of list `i` (owned), keeping its [`first_tiers`].
    fn insert_at(&mut self, i: u32, pos: usize, holder: u32) {
        let (list, f) = (&mut self.lists[i as usize], &mut self.firsts[i as usize]);
        // The holder becomes its worker's first entry unless one sorts before it.
        let slot = slot_of(holder);
        if pos == 0 || slot_of(list[pos - 1]) != slot {
            f[tier_of(holder) as usize] += 1;
            if let Some(&next) = list.get(pos)
                && slot_of(next) == slot
            {
                f[tier_of(next) as usize] -= 1;
            }
        }
        list.insert(pos, holder);
    }

    /// Removes entry `pos` of list `i` (owned), keeping its [`first_tiers`]; returns the
    /// list's new length.
    fn remove_at(&mut self, i: u32, pos: usize) -> usize {
        let (list, f) = (&mut self.lists[i as usize], &mut self.firsts[i as usize]);
        let holder = list[pos];
        let slot = slot_of(holder);
        if pos == 0 || slot_of(list[pos - 1]) != slot {
            f[tier_of(holder) as usize] -= 1;
            if let Some(&next) = list.get(pos + 1)
                && slot_of(next) == slot
            {
                f[tier_of(next) as usize] += 1;
            }
        }
        list.remove(pos);
        list.len()
    }

    /// Spilled lists in use.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lists.len() - self.free.len()
    }

    /// Blocks pointing at list `i` (for invariant checks).
    #[cfg(test)]
    pub(crate) fn refs(&self, i: u32) -> u32 {
        self.refs[i as usize]
    }

    /// Heap bytes of the arena and its lists (O(spilled lists)).
    pub(crate) fn heap_bytes(&self) -> usize {
        let lists: usize = self.lists.iter().map(|l| l.capacity()).sum();
        self.lists.capacity() * size_of::<Vec<u32>>()
            + self.firsts.capacity() * size_of::<[u32; 3]>()
            + lists * size_of::<u32>()
            + (self.refs.capacity() + self.free.capacity()) * size_of::<u32>()
    }
}

/// What [`Holders::remove`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Removal {
    /// The holder was not in the list.
    Absent,
    /// Removed; others remain.
    Removed,
    /// Removed the last holder: the list is now meaningless and its map entry must go.
    Emptied,
}

/// Holders of one block, sorted ascending (by slot, then tier), without duplicates and never
/// empty (see the module doc for the encoding). Plain data: a spilled list is owned by
/// [`Spills`], and dropping a spilled `Holders` without [`Holders::remove`]-ing its holders
/// would leak the list's arena slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holders([u32; INLINE]);

impl Holders {
    /// Not a holder list (the first holder repeated is never stored): the block map's mark for
    /// a vacant slot.
    pub(crate) const VACANT: Holders = Holders([0, 0]);

    #[inline(always)]
    pub(crate) fn is_vacant(&self) -> bool {
        self.0 == [0, 0]
    }

    /// A list with one holder.
    #[inline]
    pub(crate) fn one(holder: u32) -> Self {
        Holders([holder, EMPTY])
    }

    /// The arena index of a spilled list.
    #[inline(always)]
    fn spilled(&self) -> Option<u32> {
        (self.0[0] & TIER_MASK == SPILL_TAG).then_some(self.0[0] >> TIER_BITS)
    }

    #[inline(always)]
    pub(crate) fn as_slice<'a>(&'a self, spills: &'a Spills) -> &'a [u32] {
        match self.spilled() {
            Some(i) => &spills.lists[i as usize],
            None => &self.0[..1 + usize::from(self.0[1] != EMPTY)],
        }
    }

    /// [`first_tiers`] of the list (O(1)).
    #[inline]
    pub(crate) fn first_tiers(&self, spills: &Spills) -> [u32; 3] {
        match self.spilled() {
            Some(i) => spills.firsts[i as usize],
            None => first_tiers(self.as_slice(spills)),
        }
    }

    #[inline]
    pub(crate) fn contains(&self, holder: u32, spills: &Spills) -> bool {
        match self.spilled() {
            Some(i) => spills.lists[i as usize].binary_search(&holder).is_ok(),
            None => self.0[0] == holder || self.0[1] == holder,
        }
    }

    /// Adds a holder, keeping the order; returns false (and changes nothing) if it is there.
    #[inline]
    pub(crate) fn insert(&mut self, holder: u32, spills: &mut Spills) -> bool {
        debug_assert!(tier_of(holder) != MISSING);
        let old = *self;
        let [a, b] = self.0;
        if let Some(i) = self.spilled() {
            if let Some(to) = spills.recall(old, holder, true) {
                spills.unref(i);
                *self = to;
                return true;
            }
            let Err(pos) = spills.lists[i as usize].binary_search(&holder) else {
                return false;
            };
            let k = spills.own(i);
            spills.insert_at(k, pos, holder);
            *self = Holders::spill(k);
            if k != i {
                spills.memo = Some(Memo {
                    from: old,
                    holder,
                    insert: true,
                    to: *self,
                });
            }
            return true;
        }
        if holder == a || holder == b {
            return false;
        }
        if b == EMPTY {
            self.0 = if holder < a { [holder, a] } else { [a, holder] };
            return true;
        }
        if let Some(to) = spills.recall(old, holder, true) {
            *self = to;
            return true;
        }
        let mut list = Vec::with_capacity(SPILL_CAPACITY);
        list.extend_from_slice(&self.0);
        let pos = list.partition_point(|&h| h < holder);
        list.insert(pos, holder);
        let firsts = first_tiers(&list);
        *self = Holders::spill(spills.alloc(list, firsts));
        spills.memo = Some(Memo {
            from: old,
            holder,
            insert: true,
            to: *self,
        });
        true
    }

    /// Removes a holder.
    #[inline]
    pub(crate) fn remove(&mut self, holder: u32, spills: &mut Spills) -> Removal {
        let old = *self;
        let [a, b] = self.0;
        if let Some(i) = self.spilled() {
            if let Some(to) = spills.recall(old, holder, false) {
                spills.unref(i);
                *self = to;
                return Removal::Removed;
            }
            let Ok(pos) = spills.lists[i as usize].binary_search(&holder) else {
                return Removal::Absent;
            };
            let k = spills.own(i);
            if spills.remove_at(k, pos) <= UNSPILL_AT {
                // UNSPILL_AT is 1: exactly one holder is left.
                *self = Holders::one(spills.lists[k as usize][0]);
                spills.unref(k);
            } else {
                *self = Holders::spill(k);
            }
            if k != i {
                spills.memo = Some(Memo {
                    from: old,
                    holder,
                    insert: false,
                    to: *self,
                });
            }
            return Removal::Removed;
        }
        if holder == b {
            self.0[1] = EMPTY;
            Removal::Removed
        } else if holder != a {
            Removal::Absent
        } else if b == EMPTY {
            Removal::Emptied
        } else {
            self.0 = [b, EMPTY];
            Removal::Removed
        }
    }

    /// A list spilled to arena index `i`.
    #[inline(always)]
    fn spill(i: u32) -> Self {
        Holders([(i << TIER_BITS) | SPILL_TAG, 0])
    }

    /// The arena index of a spilled list (for invariant checks).
    #[cfg(test)]
    pub(crate) fn spill_index(&self) -> Option<u32> {
        self.spilled()
    }

    /// Whether the list lives in the arena.
    #[cfg(test)]
    pub(crate) fn is_spilled(&self) -> bool {
        self.spilled().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_eight_bytes_and_map_slots_sixteen() {
        assert_eq!(size_of::<Holders>(), 8);
        assert_eq!(size_of::<(u64, Holders)>(), 16);
    }

    #[test]
    fn packing_round_trips() {
        let h = pack(MAX_SLOTS as u32 - 1, 2);
        assert_eq!(slot_of(h), MAX_SLOTS as u32 - 1);
        assert_eq!(tier_of(h), 2);
        assert_eq!(tier_of(pack(5, 0)), 0);
        assert!(h < EMPTY, "EMPTY sorts after every holder");
    }

    #[test]
    fn inline_insert_remove() {
        let mut sp = Spills::default();
        let mut hs = Holders::one(pack(4, 1));
        assert!(!hs.insert(pack(4, 1), &mut sp), "no duplicates");
        assert!(hs.insert(pack(2, 0), &mut sp));
        assert_eq!(hs.as_slice(&sp), &[pack(2, 0), pack(4, 1)]);
        assert!(hs.contains(pack(4, 1), &sp) && !hs.contains(pack(4, 0), &sp));
        assert_eq!(hs.remove(pack(3, 0), &mut sp), Removal::Absent);
        assert_eq!(hs.remove(pack(2, 0), &mut sp), Removal::Removed);
        assert_eq!(hs.as_slice(&sp), &[pack(4, 1)]);
        assert_eq!(hs.remove(pack(4, 1), &mut sp), Removal::Emptied);
        assert_eq!(sp.len(), 0);
    }

    #[test]
    fn spills_and_comes_back() {
        let mut sp = Spills::default();
        let mut hs = Holders::one(pack(0, 0));
        for s in (1..10).rev() {
            assert!(hs.insert(pack(s, 1), &mut sp));
        }
        assert!(!hs.insert(pack(5, 1), &mut sp));
        assert!(hs.is_spilled());
        assert_eq!(hs.first_tiers(&sp), [1, 9, 0]);
        // A faster copy of a worker's block takes its first place; a slower one does not.
        assert!(hs.insert(pack(3, 0), &mut sp) && hs.insert(pack(4, 2), &mut sp));
        assert_eq!(hs.first_tiers(&sp), [2, 8, 0]);
        assert_eq!(hs.remove(pack(3, 0), &mut sp), Removal::Removed);
        assert_eq!(hs.remove(pack(4, 2), &mut sp), Removal::Removed);
        assert_eq!(hs.first_tiers(&sp), [1, 9, 0]);
        assert_eq!(hs.remove(pack(2, 1), &mut sp), Removal::Removed);
        assert_eq!(hs.first_tiers(&sp), [1, 8, 0]);
        assert!(hs.insert(pack(2, 1), &mut sp));
        assert_eq!(sp.len(), 1);
        assert_eq!(hs.as_slice(&sp).len(), 10);
        assert!(
            hs.as_slice(&sp).windows(2).all(|w| w[0] < w[1]),
            "kept sorted"
        );
        assert_eq!(
            hs.remove(pack(0, 1), &mut sp),
            Removal::Absent,
            "different tier is a different holder"
        );
        for s in 1..9 {
            assert_eq!(hs.remove(pack(s, 1), &mut sp), Removal::Removed);
        }
        assert!(hs.is_spilled(), "two holders stay spilled (hysteresis)");
        assert_eq!(hs.as_slice(&sp), &[pack(0, 0), pack(9, 1)]);
        assert_eq!(hs.remove(pack(0, 0), &mut sp), Removal::Removed);
        assert!(!hs.is_spilled());
        assert_eq!(sp.len(), 0);
        assert_eq!(hs.as_slice(&sp), &[pack(9, 1)]);
        // The released index is reused.
        let mut other = Holders::one(pack(1, 0));
        other.insert(pack(2, 0), &mut sp);
        other.insert(pack(3, 0), &mut sp);
        assert_eq!(sp.lists.len(), 1);
        assert_eq!(other.as_slice(&sp), &[pack(1, 0), pack(2, 0), pack(3, 0)]);
    }

    /// Blocks of a chain changed the same way one after the other share one list.
    #[test]
    fn equal_changes_share_lists() {
        let mut sp = Spills::default();
        let mut chain = [Holders::one(pack(1, 0)); 10];
        for w in 2..=6 {
            for hs in &mut chain {
                assert!(hs.insert(pack(w, 0), &mut sp));
            }
        }
        assert_eq!(sp.len(), 1, "one list for the whole chain");
        let i = chain[0].spill_index().unwrap();
        assert_eq!(sp.refs(i), 10);
        assert!(chain.iter().all(|hs| hs.as_slice(&sp).len() == 6));
        // A change to one block alone copies its list.
        assert!(chain[3].insert(pack(9, 1), &mut sp));
        assert_eq!(sp.len(), 2);
        assert_eq!(chain[3].first_tiers(&sp), [6, 1, 0]);
        assert_eq!(chain[4].first_tiers(&sp), [6, 0, 0]);
        // Removing a worker from the whole chain: shared again, the odd block apart.
        for hs in &mut chain {
            assert_eq!(hs.remove(pack(2, 0), &mut sp), Removal::Removed);
        }
        assert_eq!(
            sp.len(),
            2,
            "the old list is freed, the odd block keeps its own"
        );
        assert_eq!(chain[0].as_slice(&sp), chain[9].as_slice(&sp));
        assert!(std::ptr::eq(chain[0].as_slice(&sp), chain[9].as_slice(&sp)));
        // Down to one holder: inline again, every list freed.
        for w in [1, 3, 4, 5] {
            for hs in &mut chain {
                assert_eq!(hs.remove(pack(w, 0), &mut sp), Removal::Removed);
            }
        }
        assert_eq!(chain[3].remove(pack(9, 1), &mut sp), Removal::Removed);
        assert!(chain.iter().all(|hs| !hs.is_spilled()));
        assert_eq!(sp.len(), 0);
    }

    proptest::proptest! {
        /// Random changes to a few blocks against a model, sharing and memo included.
        #[test]
        fn lists_behave_like_sets(
            ops in proptest::collection::vec((0usize..4, 0u32..6, 0usize..3, proptest::bool::ANY), 1..300),
        ) {
            let mut sp = Spills::default();
            let mut blocks = [Holders::VACANT; 4];
            let mut model: [std::collections::BTreeSet<u32>; 4] = Default::default();
            for (b, slot, tier, insert) in ops {
                let h = pack(slot, tier);
                if model[b].is_empty() {
                    if insert {
                        blocks[b] = Holders::one(h);
                        model[b].insert(h);
                    }
                    continue;
                }
                if insert {
                    proptest::prop_assert_eq!(blocks[b].insert(h, &mut sp), model[b].insert(h));
                } else {
                    let out = blocks[b].remove(h, &mut sp);
                    proptest::prop_assert_eq!(out != Removal::Absent, model[b].remove(&h));
                    proptest::prop_assert_eq!(out == Removal::Emptied, model[b].is_empty());
                }
                let mut users = std::collections::BTreeMap::<u32, u32>::new();
                for (hs, m) in blocks.iter().zip(&model) {
                    if m.is_empty() {
                        continue;
                    }
                    let list: Vec<u32> = m.iter().copied().collect();
                    proptest::prop_assert_eq!(hs.as_slice(&sp), &list[..]);
                    proptest::prop_assert_eq!(hs.first_tiers(&sp), first_tiers(&list));
                    if let Some(i) = hs.spill_index() {
                        *users.entry(i).or_default() += 1;
                    }
                }
                proptest::prop_assert_eq!(users.len(), sp.len());
                for (i, n) in users {
                    proptest::prop_assert_eq!(sp.refs(i), n);
                }
            }
        }
    }

    #[test]
    fn levels() {
        let list = [pack(1, 1), pack(1, 2), pack(3, 0)];
        assert_eq!(level_in(&list, 1), 1);
        assert_eq!(level_in(&list, 2), MISSING);
        assert_eq!(level_in(&list, 3), 0);
        assert_eq!(level_in(&[], 3), MISSING);
    }
}
