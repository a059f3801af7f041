//! The compact set of holders of one block.
//!
//! A holder is a (worker slot, tier) pair packed into a `u32`: the slot in the high 30 bits, the
//! tier index (0 = Device, 1 = Host, 2 = Disk) in the low 2. Sets are kept sorted, so a
//! worker's entries are adjacent with its fastest tier first, and `find_matches` can either scan
//! a block's holders once for all workers or binary-search it for a few. Most blocks have few holders (a
//! prompt prefix is usually cached by the one or two workers the router sent it to), so up to
//! [`INLINE`] holders live inline in the map entry and only widely shared blocks (system prompts)
//! spill to the heap. The whole set is 16 bytes, so a map entry is 24 bytes.

/// Bits of a holder that carry the tier.
const TIER_BITS: u32 = 2;
/// Number of worker slots a holder can name.
pub(crate) const MAX_SLOTS: usize = 1 << (32 - TIER_BITS);
/// Holders kept inline before spilling.
const INLINE: usize = 3;
/// A spilled set goes back inline when it shrinks to this size. Lower than [`INLINE`] so that a
/// block whose holder count oscillates around the limit does not allocate on every change.
const UNSPILL_AT: usize = INLINE - 1;

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
    (holder & ((1 << TIER_BITS) - 1)) as u8
}

/// Holders of one block, sorted ascending (by slot, then tier) and without duplicates (the
/// caller checks the worker's own block set before pushing, which is the single source of
/// truth).
#[derive(Debug)]
pub(crate) enum Holders {
    Inline {
        len: u8,
        items: [u32; INLINE],
    },
    // A bare Vec is 24 bytes and would make every map entry 8 bytes larger; the extra
    // indirection is paid only by widely shared blocks.
    #[allow(clippy::box_collection)]
    Spilled(Box<Vec<u32>>),
}

impl Holders {
    /// A set with one holder.
    #[inline]
    pub(crate) fn one(holder: u32) -> Self {
        Holders::Inline {
            len: 1,
            items: [holder, 0, 0],
        }
    }

    #[inline(always)]
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Holders::Inline { len, items } => &items[..*len as usize],
            Holders::Spilled(v) => v,
        }
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Adds a holder the set does not contain, keeping the order.
    #[inline]
    pub(crate) fn push(&mut self, holder: u32) {
        match self {
            Holders::Inline { len, items } if (*len as usize) < INLINE => {
                let n = *len as usize;
                let i = items[..n].partition_point(|&h| h < holder);
                items.copy_within(i..n, i + 1);
                items[i] = holder;
                *len += 1;
            }
            Holders::Inline { items, .. } => {
                let mut v = Vec::with_capacity(INLINE * 2);
                v.extend_from_slice(items);
                let i = v.partition_point(|&h| h < holder);
                v.insert(i, holder);
                *self = Holders::Spilled(Box::new(v));
            }
            Holders::Spilled(v) => {
                let i = v.partition_point(|&h| h < holder);
                v.insert(i, holder);
            }
        }
    }

    /// Removes a holder; returns whether it was there.
    #[inline]
    pub(crate) fn remove(&mut self, holder: u32) -> bool {
        match self {
            Holders::Inline { len, items } => {
                let n = *len as usize;
                let Some(i) = items[..n].iter().position(|&h| h == holder) else {
                    return false;
                };
                items.copy_within(i + 1..n, i);
                *len -= 1;
                true
            }
            Holders::Spilled(v) => {
                let Ok(i) = v.binary_search(&holder) else {
                    return false;
                };
                v.remove(i);
                if v.len() <= UNSPILL_AT {
                    let mut items = [0; INLINE];
                    items[..v.len()].copy_from_slice(v);
                    *self = Holders::Inline {
                        len: v.len() as u8,
                        items,
                    };
                }
                true
            }
        }
    }

    /// Heap bytes owned beyond the map entry itself.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Holders::Inline { .. } => 0,
            Holders::Spilled(v) => size_of::<Vec<u32>>() + v.capacity() * size_of::<u32>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_sixteen_bytes() {
        assert_eq!(size_of::<Holders>(), 16);
    }

    #[test]
    fn packing_round_trips() {
        let h = pack(MAX_SLOTS as u32 - 1, 2);
        assert_eq!(slot_of(h), MAX_SLOTS as u32 - 1);
        assert_eq!(tier_of(h), 2);
        assert_eq!(tier_of(pack(5, 0)), 0);
    }

    #[test]
    fn spills_and_comes_back() {
        let mut hs = Holders::one(pack(0, 0));
        for s in (1..10).rev() {
            hs.push(pack(s, 1));
        }
        assert!(matches!(hs, Holders::Spilled(_)));
        assert_eq!(hs.as_slice().len(), 10);
        assert!(hs.as_slice().windows(2).all(|w| w[0] < w[1]), "kept sorted");
        assert!(
            !hs.remove(pack(0, 1)),
            "different tier is a different holder"
        );
        for s in 1..9 {
            assert!(hs.remove(pack(s, 1)));
        }
        assert!(matches!(hs, Holders::Inline { len: 2, .. }));
        assert_eq!(hs.as_slice(), &[pack(0, 0), pack(9, 1)]);
        assert!(hs.remove(pack(0, 0)) && hs.remove(pack(9, 1)));
        assert!(hs.is_empty());
    }
}
