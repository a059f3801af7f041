//! The hasher for keys that are already hashes.
//!
//! Sequence hashes are xxh3 outputs, so hashing them again with SipHash or even foldhash is
//! wasted work on the hottest path of the crate. We still apply one folded multiply (a single
//! `mul` instruction) instead of passing the value through untouched: hashbrown takes its 7-bit
//! control tag from the top bits and the bucket from the low bits, and test or benchmark keys
//! that are small integers (`SequenceHash(1)`, `SequenceHash(i << 20)`) would otherwise all
//! share one tag or one bucket and degrade every probe to a linear key comparison.

use std::hash::{BuildHasherDefault, Hasher};

/// Odd constant from the golden ratio; any odd constant with mixed bits works.
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// Multiplies into 128 bits and folds the halves together: every input bit reaches both the
/// low (bucket) and the high (tag) bits of the result.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// Hasher for `u64`-like keys (`u64`, `WorkerId`): one folded multiply per written word.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline(always)]
    fn write_u64(&mut self, x: u64) {
        self.0 = fold_mul(self.0 ^ x, K);
    }

    // Only reached by key types other than the ones this crate uses; correct, just slower.
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline(always)]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// `BuildHasher` for [`MixHasher`].
pub(crate) type BuildMix = BuildHasherDefault<MixHasher>;

/// A hashbrown map keyed by hashes or worker ids.
pub(crate) type MixMap<K, V> = hashbrown::HashMap<K, V, BuildMix>;

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, Hash};

    use super::*;

    fn hash_of<T: Hash>(v: T) -> u64 {
        BuildMix::default().hash_one(v)
    }

    #[test]
    fn small_integers_get_spread_tags_and_buckets() {
        let tags: std::collections::HashSet<u64> = (0..64u64).map(|i| hash_of(i) >> 57).collect();
        assert!(tags.len() > 32, "top 7 bits should vary for small keys");
        let buckets: std::collections::HashSet<u64> =
            (0..64u64).map(|i| hash_of(i << 20) & 63).collect();
        assert!(buckets.len() > 32, "low bits should vary for strided keys");
    }

    #[test]
    fn worker_id_hashes_like_its_u64() {
        let id = tandem_protocol::WorkerId(42);
        assert_eq!(hash_of(id), hash_of(42u64));
    }
}
