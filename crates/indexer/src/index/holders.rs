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
//!   prompts) pay that extra indirection and the vector's 24 + 4 × capacity bytes.
//!
//! A list with no holder is never stored: removing the last holder reports
//! [`Removal::Emptied`] and the caller drops the map entry.

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

/// Spilled holder lists (blocks with more than [`INLINE`] holders), indexed by the tag in
/// their [`Holders`]. Released indices are reused before the arena grows.
#[derive(Debug, Default)]
pub(crate) struct Spills {
    lists: Vec<Vec<u32>>,
    free: Vec<u32>,
}

impl Spills {
    fn alloc(&mut self, list: Vec<u32>) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.lists[i as usize] = list;
                i
            }
            None => {
                // Each spilled list is a block with 3+ holders; 2^30 of them would need tens
                // of GiB of map first.
                assert!(
                    self.lists.len() < MAX_SPILLS,
                    "more than 2^30 spilled lists"
                );
                self.lists.push(list);
                (self.lists.len() - 1) as u32
            }
        }
    }

    /// Takes a list out of the arena and frees its index (its vector goes with it).
    fn release(&mut self, i: u32) -> Vec<u32> {
        self.free.push(i);
        std::mem::take(&mut self.lists[i as usize])
    }

    /// Spilled lists in use.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lists.len() - self.free.len()
    }

    /// Heap bytes of the arena and its lists (O(spilled lists)).
    pub(crate) fn heap_bytes(&self) -> usize {
        let lists: usize = self.lists.iter().map(|l| l.capacity()).sum();
        self.lists.capacity() * size_of::<Vec<u32>>()
            + lists * size_of::<u32>()
            + self.free.capacity() * size_of::<u32>()
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
        let [a, b] = self.0;
        if let Some(i) = self.spilled() {
            let list = &mut spills.lists[i as usize];
            return match list.binary_search(&holder) {
                Ok(_) => false,
                Err(pos) => {
                    list.insert(pos, holder);
                    true
                }
            };
        }
        if holder == a || holder == b {
            return false;
        }
        if b == EMPTY {
            self.0 = if holder < a { [holder, a] } else { [a, holder] };
            return true;
        }
        let mut list = Vec::with_capacity(SPILL_CAPACITY);
        list.extend_from_slice(&self.0);
        let pos = list.partition_point(|&h| h < holder);
        list.insert(pos, holder);
        let i = spills.alloc(list);
        self.0 = [(i << TIER_BITS) | SPILL_TAG, 0];
        true
    }

    /// Removes a holder.
    #[inline]
    pub(crate) fn remove(&mut self, holder: u32, spills: &mut Spills) -> Removal {
        let [a, b] = self.0;
        if let Some(i) = self.spilled() {
            let list = &mut spills.lists[i as usize];
            let Ok(pos) = list.binary_search(&holder) else {
                return Removal::Absent;
            };
            list.remove(pos);
            if list.len() <= UNSPILL_AT {
                // UNSPILL_AT is 1: exactly one holder is left.
                let list = spills.release(i);
                *self = Holders::one(list[0]);
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

    #[test]
    fn levels() {
        let list = [pack(1, 1), pack(1, 2), pack(3, 0)];
        assert_eq!(level_in(&list, 1), 1);
        assert_eq!(level_in(&list, 2), MISSING);
        assert_eq!(level_in(&list, 3), 0);
        assert_eq!(level_in(&[], 3), MISSING);
    }
}
