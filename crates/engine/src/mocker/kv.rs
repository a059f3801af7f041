//! The mocker's KV bytes, per-sequence digests and token function.
//!
//! **Token prefix hash.** `h(t) = xxh3(prev ‖ token[t], seed)` where `prev` is `h(t-1)`, except
//! at a block boundary where it is the previous block's sequence hash (the hash seed for block
//! 0). Both name the whole prefix, and restarting at block boundaries lets a sequence that
//! reused cached blocks resume the chain without rehashing its prefix.
//!
//! **Bytes.** Within a block the layout is `[layer][token][kv][head][dim]`; the slot of
//! (token t, layer l) is filled by a counter-mode PRNG keyed with `xxh3(h(t) ‖ t ‖ l)`.
//!
//! **Digest.** A sequence folds each complete block into its digest exactly once, in block
//! order, as `xxh3(bytes, seed = block sequence hash)` mixed with the block index: the bytes
//! make it sensitive to KV corruption, the sequence hash keeps it prefix-dependent when a
//! timing-only arena has no bytes. The partial last block enters each sampled token as a
//! chain over its tokens' slots, token by token (each token's layers in order), kept per
//! sequence so a decode step reads one token's bytes.

use std::ops::Range;

use tandem_protocol::hashing::local_block_hash;
use tandem_protocol::{BlockHashes, HashSeed};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::arena::{KvArena, KvShape};
use crate::scheduler::Sequence;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Where a token's bytes lie inside a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    block_size: usize,
    layers: usize,
    bytes_per_token_layer: usize,
}

impl KvLayout {
    pub fn new(shape: KvShape, block_size: usize) -> Self {
        KvLayout {
            block_size,
            layers: shape.num_layers as usize,
            bytes_per_token_layer: shape.bytes_per_token_layer(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// True when there are no bytes (timing-only).
    pub fn is_empty(&self) -> bool {
        self.layers == 0 || self.bytes_per_token_layer == 0
    }

    /// Byte range of (token `slot` of the block, `layer`).
    pub fn slot(&self, slot: usize, layer: usize) -> Range<usize> {
        let start = (layer * self.block_size + slot) * self.bytes_per_token_layer;
        start..start + self.bytes_per_token_layer
    }

    /// Byte range of the first `tokens` tokens of `layer` (contiguous in this layout).
    pub fn layer_prefix(&self, layer: usize, tokens: usize) -> Range<usize> {
        let start = layer * self.block_size * self.bytes_per_token_layer;
        start..start + tokens * self.bytes_per_token_layer
    }
}

/// The mocker's state of one sequence, valid for one admission (`epoch`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqDigest {
    epoch: u32,
    digest: u64,
    /// Complete blocks folded into `digest`.
    folded: usize,
    /// Next position to write and the prefix hash of the token before it, so consecutive
    /// chunks continue the chain without rehashing.
    cursor: usize,
    cursor_hash: u64,
    /// The bytes of the partial last block read so far ([`sample`]).
    partial: PartialChain,
}

/// How far [`sample`] has read the partial last block of a sequence: block `block`'s first
/// `tokens` tokens, chained into `hash`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PartialChain {
    block: usize,
    tokens: usize,
    hash: u64,
}

impl SeqDigest {
    pub fn new(epoch: u32) -> Self {
        SeqDigest {
            epoch,
            digest: 0,
            folded: 0,
            cursor: 0,
            cursor_hash: 0,
            partial: PartialChain::default(),
        }
    }

    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    pub fn digest(&self) -> u64 {
        self.digest
    }

    pub fn folded_blocks(&self) -> usize {
        self.folded
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Prefix hash of a token given the one before (see the module docs).
pub fn token_prefix_hash(prev: u64, token: u32, seed: HashSeed) -> u64 {
    let mut buf = [0u8; 12];
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    buf[8..].copy_from_slice(&token.to_le_bytes());
    xxh3_64_with_seed(&buf, seed.0)
}

/// The chain value a block's first token hashes onto.
fn block_start_hash(hashes: &[BlockHashes], block: usize, seed: HashSeed) -> u64 {
    match block.checked_sub(1) {
        None => seed.0,
        Some(parent) => hashes[parent].sequence.0,
    }
}

/// Fills the bytes of one (token, layer) slot.
pub fn fill_slot(slot: &mut [u8], prefix_hash: u64, pos: usize, layer: usize) {
    let mut key_in = [0u8; 24];
    key_in[..8].copy_from_slice(&prefix_hash.to_le_bytes());
    key_in[8..16].copy_from_slice(&(pos as u64).to_le_bytes());
    key_in[16..].copy_from_slice(&(layer as u64).to_le_bytes());
    let key = xxh3_64(&key_in);
    let word =
        |k: usize| splitmix(key.wrapping_add((k as u64 + 1).wrapping_mul(GOLDEN))).to_le_bytes();
    // Whole words as fixed-size stores (no copy call per word), then the tail.
    let mut words = slot.chunks_exact_mut(8);
    let mut k = 0;
    for chunk in &mut words {
        chunk.copy_from_slice(&word(k));
        k += 1;
    }
    let tail = words.into_remainder();
    let n = tail.len();
    tail.copy_from_slice(&word(k)[..n]);
}

/// Writes the KV bytes of tokens `range` of `seq` into its blocks (`table`).
pub fn write_tokens(
    arena: &mut KvArena,
    layout: &KvLayout,
    table: &[u32],
    seq: &Sequence,
    range: Range<usize>,
    state: &mut SeqDigest,
) {
    if layout.is_empty() || range.is_empty() {
        return;
    }
    let (tokens, hashes, seed) = (seq.tokens(), seq.block_hashes(), seq.hash_seed());
    let bs = layout.block_size;
    let mut h = if state.cursor == range.start {
        state.cursor_hash
    } else {
        // Resume the chain from the start of the block (cheap: at most one block of tokens).
        let block_start = range.start - range.start % bs;
        let mut h = block_start_hash(hashes, block_start / bs, seed);
        for &t in &tokens[block_start..range.start] {
            h = token_prefix_hash(h, t, seed);
        }
        h
    };
    // One arena access per block (a lock, or a device round trip, each), not per token.
    let mut pos = range.start;
    while pos < range.end {
        let block_end = ((pos / bs + 1) * bs).min(range.end);
        arena.with_block_mut(table[pos / bs], |block| {
            for (p, &token) in tokens.iter().enumerate().take(block_end).skip(pos) {
                let in_block = p % bs;
                let prev = if in_block == 0 {
                    block_start_hash(hashes, p / bs, seed)
                } else {
                    h
                };
                h = token_prefix_hash(prev, token, seed);
                for layer in 0..layout.layers {
                    fill_slot(&mut block[layout.slot(in_block, layer)], h, p, layer);
                }
            }
        });
        pos = block_end;
    }
    state.cursor = range.end;
    state.cursor_hash = h;
}

/// The chained hash of the bytes of the first `tokens` tokens of the partial block `index`
/// (block `block` of the arena), token by token, each token's layers in order: each token's
/// bytes are read once per admission, resuming from what `state` read at the last step, so a
/// decode step reads one token's bytes, not the whole partial block's.
fn read_partial(
    arena: &KvArena,
    layout: &KvLayout,
    block: u32,
    index: usize,
    tokens: usize,
    parent: u64,
    state: &mut SeqDigest,
) -> u64 {
    let chain = &mut state.partial;
    if chain.tokens == 0 || chain.tokens > tokens || chain.block != index {
        *chain = PartialChain {
            block: index,
            tokens: 0,
            hash: parent,
        };
    }
    if chain.tokens < tokens {
        chain.hash = arena.with_block(block, |bytes| {
            let mut h = chain.hash;
            for t in chain.tokens..tokens {
                for layer in 0..layout.layers {
                    h = xxh3_64_with_seed(&bytes[layout.slot(t, layer)], h);
                }
            }
            h
        });
        chain.tokens = tokens;
    }
    chain.hash
}

/// Folds every complete block below `full_blocks` not folded yet, reading its bytes back from
/// the arena (computed here, reused from the cache, or received by transfer alike): once per
/// write of the block, not once per sequence that reuses it ([`KvArena::read_back_hash`]).
pub fn fold_complete_blocks(
    arena: &mut KvArena,
    table: &[u32],
    hashes: &[BlockHashes],
    full_blocks: usize,
    state: &mut SeqDigest,
) {
    while state.folded < full_blocks {
        let i = state.folded;
        let bytes_hash = arena.read_back_hash(table[i], hashes[i].sequence.0);
        let mut buf = [0u8; 24];
        buf[..8].copy_from_slice(&state.digest.to_le_bytes());
        buf[8..16].copy_from_slice(&bytes_hash.to_le_bytes());
        buf[16..].copy_from_slice(&(i as u64).to_le_bytes());
        state.digest = xxh3_64(&buf);
        state.folded += 1;
    }
}

/// The next token of a sequence whose first `n_tokens` tokens have KV (all complete blocks
/// folded into `state`): a function of the digest, the partial last block (tokens and bytes),
/// the sampling seed and `n_tokens`.
pub fn sample(
    arena: &KvArena,
    layout: &KvLayout,
    table: &[u32],
    seq: &Sequence,
    n_tokens: usize,
    state: &mut SeqDigest,
    vocab_size: u32,
) -> u32 {
    let bs = layout.block_size;
    let full = n_tokens / bs;
    debug_assert_eq!(
        state.folded, full,
        "complete blocks must be folded before sampling"
    );
    let partial_len = n_tokens - full * bs;
    let parent = block_start_hash(seq.block_hashes(), full, seq.hash_seed());
    let (mut tokens_hash, mut bytes_hash) = (parent, parent);
    if partial_len > 0 {
        tokens_hash = local_block_hash(&seq.tokens()[full * bs..n_tokens], HashSeed(parent)).0;
        if !layout.is_empty() {
            bytes_hash = read_partial(arena, layout, table[full], full, partial_len, parent, state);
        }
    }
    let mut buf = [0u8; 40];
    buf[..8].copy_from_slice(&state.digest.to_le_bytes());
    buf[8..16].copy_from_slice(&tokens_hash.to_le_bytes());
    buf[16..24].copy_from_slice(&bytes_hash.to_le_bytes());
    buf[24..32].copy_from_slice(&seq.sampling_seed().to_le_bytes());
    buf[32..].copy_from_slice(&(n_tokens as u64).to_le_bytes());
    (xxh3_64(&buf) % u64::from(vocab_size.max(1))) as u32
}
