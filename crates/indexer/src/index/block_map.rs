//! [`BlockMap`]: the block hash → [`Holders`] table, open addressing with linear probing.
//!
//! # Why not hashbrown
//!
//! Applying a block event is one random access into a table far larger than the caches (2^24
//! slots, 256 MiB at cluster scale), so its cost is memory latency. hashbrown keeps its control
//! bytes apart from its slots: a lookup misses twice (control group, then slot), and the
//! probe's branches depend on the control bytes, which keeps the CPU from running far ahead.
//! Here a slot is 16 bytes (the 8-byte hash and the 8-byte holder list), four to a cache line,
//! found at `mix(hash) & mask` or just after it: one miss per lookup, and the address of that
//! miss is known from the hash alone, so [`BlockMap::touch`] can load the slots of a whole
//! batch of events ahead of applying them (independent loads the CPU overlaps, where applying
//! one block after another waits for each miss in turn).
//!
//! # Layout and invariants
//!
//! - `slots.len()` is a power of two (or zero); a vacant slot holds [`Holders::VACANT`] (a value
//!   no holder list takes), so every 64-bit hash is a valid key.
//! - Linear probing: a key sits at its home slot `mix(key) & mask` or in the run of occupied
//!   slots right after it (cyclically). Removal shifts the rest of the run back into the gap
//!   (no tombstones), so a lookup stops at the first vacant slot.
//! - At most 3/4 of the slots are occupied (the table doubles past that): an absent key probes
//!   about 2.5 slots on average at 1/2 load and 8.5 at 3/4, a present one 1.5 and 2.5
//!   (Knuth's linear-probing estimates), mostly within one or two adjacent cache lines.
//!
//! Memory: 16 bytes per slot, so 21.3 bytes per block at 3/4 load (just before doubling) and
//! 42.7 at 3/8 (just after); hashbrown's 17 bytes per slot at 7/8 made it 19.4 and 38.9.

use super::holders::Holders;

/// Keys whose slots are loaded at once (with [`BlockMap::touch`]) before they are used, by the
/// event path, log compaction and growth: enough independent misses to keep the memory system
/// busy (a core tracks a few dozen, and a miss that also misses the TLB waits for a page walk
/// first), few enough (256 lines) that the slots are still in L1 or L2 when used. 16, 32, 64,
/// 128 and 256 were tried on the trace replay; 64 to 256 were best, within the machine's noise.
pub(crate) const AHEAD: usize = 128;

/// One slot: a block hash and its holders, or [`Holders::VACANT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    key: u64,
    holders: Holders,
}

/// A vacant slot as tables are filled. The key of a vacant slot means nothing; it is not zero
/// so that the table is really written when allocated: an all-zero fill is turned into a
/// zeroed allocation (calloc), whose pages the kernel then faults in one by one on the event
/// path, which measured about 40 % of the time of random inserts into a fresh table.
const VACANT_SLOT: Slot = Slot {
    key: u64::MAX,
    holders: Holders::VACANT,
};

/// Smallest non-empty table.
const MIN_SLOTS: usize = 8;

/// Odd constant from the golden ratio (as in `crate::hash`).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// Spreads a key over the table: block hashes are already xxh3 outputs, but test keys are small
/// integers or strided, so one folded multiply mixes every input bit into the low bits.
#[inline(always)]
fn mix(key: u64) -> u64 {
    let p = u128::from(key) * u128::from(K);
    (p as u64) ^ ((p >> 64) as u64)
}

/// Occupied slots allowed in a table of `slots` slots.
#[inline]
fn max_len(slots: usize) -> usize {
    slots / 4 * 3
}

/// The block map (see the module doc).
#[derive(Clone, Debug, Default)]
pub(crate) struct BlockMap {
    slots: Vec<Slot>,
    len: usize,
}

/// Where a key is, or where it would go: the result of [`BlockMap::find_slot`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The key is in this slot.
    Found(usize),
    /// The key is absent; this vacant slot ends its probe run.
    Vacant(usize),
}

impl BlockMap {
    /// A table with room for `n` keys before it grows. Every slot is written here (see
    /// [`VACANT_SLOT`]), so the pages are faulted in now rather than on the event path.
    pub(crate) fn with_capacity(n: usize) -> Self {
        let mut m = BlockMap::default();
        if n > 0 {
            m.slots = vec![VACANT_SLOT; slots_for(n)];
        }
        m
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Keys the table holds before it grows.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        max_len(self.slots.len())
    }

    /// Heap bytes of the table.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * size_of::<Slot>()
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Loads the home slot of `key` and returns a word of it, for the caller to feed to
    /// `std::hint::black_box`: a batch of these is a batch of independent loads, which brings
    /// the slots of the next keys into the cache while the CPU waits for all of them at once.
    ///
    /// The slot after the home one is loaded too: a probe that does not stop at its home slot
    /// (about half of them at half load) goes on there, which is in the next cache line when
    /// the home slot ends its line.
    #[inline(always)]
    pub(crate) fn touch(&self, key: u64) -> u64 {
        let (mask, home) = (self.mask(), mix(key) as usize);
        let next = self
            .slots
            .get(home.wrapping_add(1) & mask)
            .map_or(0, |s| s.key);
        self.slots.get(home & mask).map_or(0, |s| s.key) ^ next
    }

    /// The slot of `key`, or the vacant slot where it would be inserted. The table must not be
    /// empty (see [`BlockMap::reserve_one`]).
    #[inline(always)]
    pub(crate) fn find_slot(&self, key: u64) -> Probe {
        let mask = self.mask();
        let mut i = mix(key) as usize & mask;
        loop {
            let s = &self.slots[i];
            if s.holders.is_vacant() {
                return Probe::Vacant(i);
            }
            if s.key == key {
                return Probe::Found(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The holders of `key`.
    #[inline(always)]
    pub(crate) fn get(&self, key: u64) -> Option<&Holders> {
        if self.slots.is_empty() {
            return None;
        }
        match self.find_slot(key) {
            Probe::Found(i) => Some(&self.slots[i].holders),
            Probe::Vacant(_) => None,
        }
    }

    /// The holders in slot `i` (occupied).
    #[inline(always)]
    pub(crate) fn at_mut(&mut self, i: usize) -> &mut Holders {
        &mut self.slots[i].holders
    }

    /// Makes room for `n` keys in all, growing the table now if it holds fewer before growing.
    pub(crate) fn reserve(&mut self, n: usize) {
        if max_len(self.slots.len()) < n {
            self.grow_to(slots_for(n));
        }
    }

    /// Makes room for one more key (growing the table if it would pass 3/4 full); call before
    /// [`BlockMap::find_slot`] for an insert, since growing moves every slot.
    #[inline]
    pub(crate) fn reserve_one(&mut self) {
        if self.len + 1 > max_len(self.slots.len()) {
            self.grow();
        }
    }

    /// Fills the vacant slot `i` returned by [`BlockMap::find_slot`] (after
    /// [`BlockMap::reserve_one`]) with `key`.
    #[inline(always)]
    pub(crate) fn fill(&mut self, i: usize, key: u64, holders: Holders) {
        debug_assert!(self.slots[i].holders.is_vacant() && !holders.is_vacant());
        self.slots[i] = Slot { key, holders };
        self.len += 1;
    }

    /// Empties the occupied slot `i`, shifting the rest of its probe run back so that no
    /// lookup stops early.
    pub(crate) fn remove_at(&mut self, mut i: usize) {
        debug_assert!(!self.slots[i].holders.is_vacant());
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.holders.is_vacant() {
                break;
            }
            // `s` may move into the gap at `i` only if its home is not cyclically in (i, j]:
            // otherwise a lookup from its home would start past the gap.
            let home = mix(s.key) as usize & mask;
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(i) & mask) {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = VACANT_SLOT;
        self.len -= 1;
    }

    /// Every (key, holders), in table order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &Holders)> + '_ {
        self.slots
            .iter()
            .filter(|s| !s.holders.is_vacant())
            .map(|s| (s.key, &s.holders))
    }

    #[cold]
    fn grow(&mut self) {
        self.grow_to((self.slots.len() * 2).max(MIN_SLOTS));
    }

    /// Moves every key into a new table of `n` slots (a power of two, more than now).
    #[cold]
    fn grow_to(&mut self, n: usize) {
        debug_assert!(n.is_power_of_two() && n > self.slots.len());
        let old = std::mem::replace(&mut self.slots, vec![VACANT_SLOT; n]);
        let mask = n - 1;
        for chunk in old.chunks(AHEAD) {
            // Random writes into the new table, their slots loaded a chunk at a time.
            let mut acc = 0;
            for s in chunk {
                acc ^= self.slots[mix(s.key) as usize & mask].key;
            }
            std::hint::black_box(acc);
            for s in chunk.iter().filter(|s| !s.holders.is_vacant()) {
                let mut i = mix(s.key) as usize & mask;
                while !self.slots[i].holders.is_vacant() {
                    i = (i + 1) & mask;
                }
                self.slots[i] = *s;
            }
        }
    }
}

/// Slots of a table that holds `n` keys without growing.
fn slots_for(n: usize) -> usize {
    (n.saturating_mul(4).div_ceil(3))
        .next_power_of_two()
        .max(MIN_SLOTS)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::holders::Spills;
    use super::*;

    fn one(h: u32) -> Holders {
        Holders::one(h << 2)
    }

    /// Inserts or overwrites, as the index does with `find_slot` + `fill`.
    fn put(m: &mut BlockMap, key: u64, v: u32) {
        m.reserve_one();
        match m.find_slot(key) {
            Probe::Found(i) => *m.at_mut(i) = one(v),
            Probe::Vacant(i) => m.fill(i, key, one(v)),
        }
    }

    fn del(m: &mut BlockMap, key: u64) -> bool {
        if m.len() == 0 {
            return false;
        }
        match m.find_slot(key) {
            Probe::Found(i) => {
                m.remove_at(i);
                true
            }
            Probe::Vacant(_) => false,
        }
    }

    #[test]
    fn slots_are_sixteen_bytes_and_sizes_are_powers_of_two() {
        assert_eq!(size_of::<Slot>(), 16);
        assert_eq!(slots_for(1), 8);
        assert_eq!(slots_for(6), 8);
        assert_eq!(slots_for(7), 16);
        assert_eq!(slots_for(8_192_000), 1 << 24);
        let m = BlockMap::with_capacity(1000);
        assert!(m.capacity() >= 1000);
        assert_eq!(BlockMap::default().get(5), None);
        assert_eq!(BlockMap::default().touch(5), 0);
    }

    #[test]
    fn reserving_grows_once_ahead_and_never_shrinks() {
        let mut m = BlockMap::default();
        for k in 0..100u64 {
            put(&mut m, k, k as u32);
        }
        m.reserve(10_000);
        let slots = m.slots.len();
        assert!(m.capacity() >= 10_000);
        // The keys moved with the table, and filling up to the reservation moves nothing.
        for k in 0..100u64 {
            assert_eq!(m.get(k), Some(&one(k as u32)));
        }
        for k in 100..10_000u64 {
            put(&mut m, k, k as u32);
        }
        assert_eq!(m.slots.len(), slots);
        m.reserve(10);
        assert_eq!(m.slots.len(), slots);
        assert_eq!(m.len(), 10_000);
    }

    #[test]
    fn vacant_is_not_a_holder_list() {
        let sp = Spills::default();
        assert!(Holders::VACANT.is_vacant());
        assert!(
            !Holders::one(0).is_vacant(),
            "slot 0, device is a real holder"
        );
        assert_eq!(Holders::one(0).as_slice(&sp), &[0]);
    }

    /// Keys crowded into few home slots (long runs that wrap around the end) and key 0.
    #[test]
    fn wrapping_runs_survive_removals() {
        let mut m = BlockMap::default();
        let keys: Vec<u64> = (1..41u64)
            .map(|i| i << 40)
            .chain([0, 1, u64::MAX])
            .collect();
        for (v, &k) in keys.iter().enumerate() {
            put(&mut m, k, v as u32);
        }
        for (v, &k) in keys.iter().enumerate().step_by(3) {
            assert_eq!(m.get(k), Some(&one(v as u32)));
            assert!(del(&mut m, k));
            assert!(!del(&mut m, k));
        }
        for (v, &k) in keys.iter().enumerate() {
            let want = (v % 3 != 0).then(|| one(v as u32));
            assert_eq!(m.get(k).copied(), want, "key {k:#x}");
        }
    }

    proptest! {
        #[test]
        fn behaves_like_a_btreemap(
            ops in proptest::collection::vec((any::<bool>(), 0u64..64, any::<u8>()), 1..400),
            spread in any::<bool>(),
        ) {
            let mut m = BlockMap::default();
            let mut model = BTreeMap::new();
            for (insert, k, v) in ops {
                // Small or strided keys, to stress collisions either way.
                let k = if spread { k << 33 } else { k };
                if insert {
                    put(&mut m, k, u32::from(v));
                    model.insert(k, one(u32::from(v)));
                } else {
                    prop_assert_eq!(del(&mut m, k), model.remove(&k).is_some());
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert!(m.len() <= m.capacity());
            }
            for k in 0..64u64 {
                let k = if spread { k << 33 } else { k };
                prop_assert_eq!(m.get(k), model.get(&k));
            }
            let mut all: Vec<(u64, Holders)> = m.iter().map(|(k, h)| (k, *h)).collect();
            all.sort_by_key(|&(k, _)| k);
            prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        }
    }
}
