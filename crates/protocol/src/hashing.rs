//! KV block identity (docs/ARCHITECTURE.md §3).
//!
//! `local_hash = xxh3_64(token ids as u32 LE, seed)`; `sequence_hash[0] = local_hash[0]`,
//! `sequence_hash[i] = xxh3_64(sequence_hash[i-1] LE ‖ local_hash[i] LE, seed)`. Only full
//! blocks are hashed: a trailing partial block has no identity and is never shared.

use std::borrow::Cow;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;
use zerocopy::IntoBytes;

use crate::ids::{LocalBlockHash, SequenceHash};

/// Fixed constant mixed into every seed, so that tandem's hashes never coincide with another
/// system's plain xxh3 of the same tokens.
const SEED_CONSTANT: u64 = 0x7a6e_6465_6d2d_6b76; // "tandem-kv"-ish

/// Tokens per KV block; never zero. Default 16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct BlockSize(NonZeroU32);

/// A block size of zero was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("block size must be at least 1 token, got {0}")]
pub struct InvalidBlockSize(pub u32);

impl BlockSize {
    /// The default block size, 16 tokens.
    pub const DEFAULT: BlockSize = BlockSize(NonZeroU32::new(16).expect("16 is not zero"));

    /// Validates a block size: zero is an error.
    pub fn new(tokens: u32) -> Result<Self, InvalidBlockSize> {
        NonZeroU32::new(tokens)
            .map(BlockSize)
            .ok_or(InvalidBlockSize(tokens))
    }

    /// Tokens per block.
    pub const fn get(self) -> u32 {
        self.0.get()
    }

    /// Tokens per block as usize.
    pub const fn tokens(self) -> usize {
        self.0.get() as usize
    }

    /// Number of full blocks in `tokens` tokens.
    pub const fn full_blocks(self, tokens: usize) -> usize {
        tokens / self.tokens()
    }

    /// Number of blocks (full or partial) needed to hold `tokens` tokens.
    pub const fn blocks_for(self, tokens: usize) -> usize {
        tokens.div_ceil(self.tokens())
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl TryFrom<u32> for BlockSize {
    type Error = InvalidBlockSize;
    fn try_from(v: u32) -> Result<Self, Self::Error> {
        BlockSize::new(v)
    }
}

impl From<BlockSize> for u32 {
    fn from(b: BlockSize) -> u32 {
        b.get()
    }
}

/// The hash seed of one cache namespace: a fixed constant mixed with the request's cache salt
/// (tenant, `cache_salt`, LoRA name). Requests share blocks only when they share a seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HashSeed(pub u64);

impl HashSeed {
    /// The seed of requests without a salt.
    pub const UNSALTED: HashSeed = HashSeed(SEED_CONSTANT);

    /// The seed for a salt; `None` is the unsalted namespace.
    pub fn from_salt(salt: Option<&[u8]>) -> HashSeed {
        match salt {
            None => Self::UNSALTED,
            // Length-prefixing keeps "a" + "bc" and "ab" + "c" apart if salts are ever composed.
            Some(s) => {
                let mut buf = Vec::with_capacity(8 + s.len());
                buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
                buf.extend_from_slice(s);
                HashSeed(xxh3_64_with_seed(&buf, SEED_CONSTANT))
            }
        }
    }
}

impl HashSeed {
    /// The seed of a request: its cache salt, then its LoRA adapter. A request on an adapter
    /// never shares blocks with the base model or another adapter (the adapter changes every
    /// layer's KV), as in vLLM, whose block hash keys start with the LoRA name
    /// (`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`). Without an
    /// adapter it is [`HashSeed::from_salt`].
    pub fn for_request(salt: Option<&[u8]>, adapter: Option<&str>) -> HashSeed {
        let salted = Self::from_salt(salt);
        match adapter {
            None => salted,
            Some(a) => {
                let mut buf = Vec::with_capacity(13 + a.len());
                buf.extend_from_slice(b"lora\x1f");
                buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
                buf.extend_from_slice(a.as_bytes());
                HashSeed(xxh3_64_with_seed(&buf, salted.0))
            }
        }
    }
}

impl Default for HashSeed {
    fn default() -> Self {
        Self::UNSALTED
    }
}

/// The two hashes of one full block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockHashes {
    pub local: LocalBlockHash,
    pub sequence: SequenceHash,
}

/// Hash of one block's tokens.
pub fn local_block_hash(tokens: &[u32], seed: HashSeed) -> LocalBlockHash {
    LocalBlockHash(xxh3_64_with_seed(&le_bytes(tokens), seed.0))
}

/// `tokens` as little-endian bytes, what a block's hash reads: the tokens' own memory on a
/// little-endian target (no copy), a copy on a big-endian one.
fn le_bytes(tokens: &[u32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(tokens.as_bytes())
    } else {
        Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

/// Chains a block onto its parent's sequence hash (`None` for the first block).
pub fn chain_sequence_hash(
    parent: Option<SequenceHash>,
    local: LocalBlockHash,
    seed: HashSeed,
) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.0.to_le_bytes());
            buf[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&buf, seed.0))
        }
    }
}

/// Hashes every full block of `tokens`; a trailing partial block is ignored.
pub fn compute_block_hashes(
    tokens: &[u32],
    block_size: BlockSize,
    seed: HashSeed,
) -> Vec<BlockHashes> {
    let n = block_size.full_blocks(tokens.len());
    let mut out = Vec::with_capacity(n);
    // The prompt's bytes in one buffer, each block's hash reading its slice of it.
    let bytes = le_bytes(&tokens[..n * block_size.tokens()]);
    let mut parent = None;
    for block in bytes.chunks_exact(block_size.tokens() * 4) {
        let local = LocalBlockHash(xxh3_64_with_seed(block, seed.0));
        let sequence = chain_sequence_hash(parent, local, seed);
        parent = Some(sequence);
        out.push(BlockHashes { local, sequence });
    }
    out
}

/// Incremental hasher for a growing sequence (decode appends one token at a time): yields the
/// hashes of each block as it fills, equal to what [`compute_block_hashes`] gives on the whole.
#[derive(Clone, Debug)]
pub struct TokenBlockHasher {
    seed: HashSeed,
    block_size: BlockSize,
    pending: Vec<u32>,
    last: Option<SequenceHash>,
    full_blocks: usize,
}

impl TokenBlockHasher {
    pub fn new(block_size: BlockSize, seed: HashSeed) -> Self {
        TokenBlockHasher {
            seed,
            block_size,
            pending: Vec::with_capacity(block_size.tokens()),
            last: None,
            full_blocks: 0,
        }
    }

    /// Appends one token; returns the block's hashes when it completes a block.
    pub fn push(&mut self, token: u32) -> Option<BlockHashes> {
        self.pending.push(token);
        if self.pending.len() < self.block_size.tokens() {
            return None;
        }
        let local = local_block_hash(&self.pending, self.seed);
        let sequence = chain_sequence_hash(self.last, local, self.seed);
        self.pending.clear();
        self.last = Some(sequence);
        self.full_blocks += 1;
        Some(BlockHashes { local, sequence })
    }

    /// Appends many tokens, pushing each completed block's hashes onto `out`.
    pub fn extend(&mut self, tokens: &[u32], out: &mut Vec<BlockHashes>) {
        for &t in tokens {
            if let Some(h) = self.push(t) {
                out.push(h);
            }
        }
    }

    /// Sequence hash of the last full block, if any.
    pub fn last_sequence_hash(&self) -> Option<SequenceHash> {
        self.last
    }

    /// Number of full blocks hashed so far.
    pub fn full_blocks(&self) -> usize {
        self.full_blocks
    }

    pub fn seed(&self) -> HashSeed {
        self.seed
    }

    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn an_adapter_is_its_own_namespace_within_each_salt() {
        let seeds = [
            HashSeed::for_request(None, None),
            HashSeed::for_request(None, Some("a")),
            HashSeed::for_request(None, Some("b")),
            HashSeed::for_request(Some(b"t"), None),
            HashSeed::for_request(Some(b"t"), Some("a")),
            // Neither the salt nor the adapter can stand in for the other.
            HashSeed::from_salt(Some(b"a")),
        ];
        for (i, x) in seeds.iter().enumerate() {
            for y in &seeds[i + 1..] {
                assert_ne!(x, y);
            }
        }
        assert_eq!(seeds[0], HashSeed::UNSALTED);
        assert_eq!(seeds[3], HashSeed::from_salt(Some(b"t")));
        assert_eq!(seeds[4], HashSeed::for_request(Some(b"t"), Some("a")));
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(BlockSize::new(0), Err(InvalidBlockSize(0)));
        assert_eq!(BlockSize::new(16).unwrap().get(), 16);
        let err = serde_json_like_roundtrip_zero();
        assert!(err, "deserializing a zero block size must fail");
    }

    // Deserializing goes through the same validation (bincode round trip of a raw 0).
    fn serde_json_like_roundtrip_zero() -> bool {
        let cfg = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec(0u32, cfg).unwrap();
        bincode::serde::decode_from_slice::<BlockSize, _>(&bytes, cfg).is_err()
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let bs = BlockSize::new(4).unwrap();
        let h = compute_block_hashes(&[1, 2, 3, 4, 5, 6, 7], bs, HashSeed::UNSALTED);
        assert_eq!(h.len(), 1);
        assert!(compute_block_hashes(&[1, 2, 3], bs, HashSeed::UNSALTED).is_empty());
    }

    #[test]
    fn formula_matches_design() {
        let seed = HashSeed::UNSALTED;
        let bs = BlockSize::new(2).unwrap();
        let h = compute_block_hashes(&[7, 8, 9, 10], bs, seed);
        let l0 = xxh3_64_with_seed(&[7, 0, 0, 0, 8, 0, 0, 0], seed.0);
        let l1 = xxh3_64_with_seed(&[9, 0, 0, 0, 10, 0, 0, 0], seed.0);
        assert_eq!(h[0].local.0, l0);
        assert_eq!(h[0].sequence.0, l0);
        let mut buf = l0.to_le_bytes().to_vec();
        buf.extend_from_slice(&l1.to_le_bytes());
        assert_eq!(h[1].local.0, l1);
        assert_eq!(h[1].sequence.0, xxh3_64_with_seed(&buf, seed.0));
    }

    #[test]
    fn large_blocks_use_the_heap_path_consistently() {
        let bs = BlockSize::new(200).unwrap();
        let tokens: Vec<u32> = (0..400).collect();
        let h = compute_block_hashes(&tokens, bs, HashSeed::UNSALTED);
        let bytes: Vec<u8> = tokens[..200].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(
            h[0].local.0,
            xxh3_64_with_seed(&bytes, HashSeed::UNSALTED.0)
        );
        // One block at a time (a decode worker's incremental hashing) agrees.
        assert_eq!(
            local_block_hash(&tokens[..200], HashSeed::UNSALTED),
            h[0].local
        );
        let small = BlockSize::new(16).unwrap();
        let h16 = compute_block_hashes(&tokens, small, HashSeed::UNSALTED);
        assert_eq!(
            local_block_hash(&tokens[16..32], HashSeed::UNSALTED),
            h16[1].local
        );
    }

    proptest! {
        #[test]
        fn hashes_of_a_prefix_are_a_prefix_of_the_hashes(
            tokens in proptest::collection::vec(any::<u32>(), 0..300),
            cut in 0usize..300,
            bs in 1u32..40,
        ) {
            let bs = BlockSize::new(bs).unwrap();
            let cut = cut.min(tokens.len());
            let all = compute_block_hashes(&tokens, bs, HashSeed::UNSALTED);
            let prefix = compute_block_hashes(&tokens[..cut], bs, HashSeed::UNSALTED);
            prop_assert_eq!(prefix.len(), cut / bs.tokens());
            prop_assert_eq!(&all[..prefix.len()], &prefix[..]);
        }

        #[test]
        fn different_salts_never_collide(
            tokens in proptest::collection::vec(any::<u32>(), 16..200),
            a in proptest::collection::vec(any::<u8>(), 0..24),
            b in proptest::collection::vec(any::<u8>(), 0..24),
            a_none in any::<bool>(),
        ) {
            prop_assume!(a != b || a_none);
            let bs = BlockSize::DEFAULT;
            let sa = if a_none { HashSeed::from_salt(None) } else { HashSeed::from_salt(Some(&a)) };
            let sb = HashSeed::from_salt(Some(&b));
            prop_assert_ne!(sa, sb);
            let ha = compute_block_hashes(&tokens, bs, sa);
            let hb = compute_block_hashes(&tokens, bs, sb);
            for (x, y) in ha.iter().zip(&hb) {
                prop_assert_ne!(x.local, y.local);
                prop_assert_ne!(x.sequence, y.sequence);
            }
        }

        #[test]
        fn incremental_equals_batch(
            tokens in proptest::collection::vec(any::<u32>(), 0..300),
            bs in 1u32..40,
        ) {
            let bs = BlockSize::new(bs).unwrap();
            let seed = HashSeed::from_salt(Some(b"tenant"));
            let mut inc = TokenBlockHasher::new(bs, seed);
            let mut got = Vec::new();
            inc.extend(&tokens, &mut got);
            prop_assert_eq!(got, compute_block_hashes(&tokens, bs, seed));
        }
    }
}
