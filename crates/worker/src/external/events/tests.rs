//! Unit tests of the KV event path: the codec (shapes, golden bytes, garbage), the mirror
//! (chains, seeds, salts, removals, tier moves, clears, divergence, dumps), the sequence
//! rules and the log.

use hashbrown::{HashMap, HashSet};
use rmpv::Value;
use tandem_protocol::hashing::{chain_sequence_hash, compute_block_hashes, local_block_hash};
use tandem_protocol::{
    BlockSize, HashSeed, KvEventKind, Rng, SequenceHash, StorageTier, StoredBlock, WorkerId,
};

use super::codec::{EngineBatch, EngineEvent, EngineHash, WireShape, decode_batch, encode_batch};
use super::log::RelayLog;
use super::mirror::{KvMirror, tier_of_medium};
use super::subscriber::{SeqTracker, Verdict};

const W: WorkerId = WorkerId(7);

fn bs(n: u32) -> BlockSize {
    BlockSize::new(n).unwrap()
}

fn h(v: i64) -> EngineHash {
    EngineHash::Int(v)
}

fn stored(hashes: &[i64], parent: Option<i64>, tokens: &[u32], block_size: u32) -> EngineEvent {
    EngineEvent::BlockStored {
        block_hashes: hashes.iter().copied().map(h).collect(),
        parent_block_hash: parent.map(h),
        token_ids: tokens.to_vec(),
        block_size,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }
}

/// `stored` with one field changed through a closure over the variant's fields.
fn with_stored(mut e: EngineEvent, f: impl FnOnce(&mut StoredFields<'_>)) -> EngineEvent {
    if let EngineEvent::BlockStored {
        lora_id,
        medium,
        lora_name,
        extra_keys,
        group_idx,
        kv_cache_spec_kind,
        kv_cache_spec_sliding_window,
        ..
    } = &mut e
    {
        f(&mut StoredFields {
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
            kv_cache_spec_sliding_window,
        });
    }
    e
}

struct StoredFields<'a> {
    lora_id: &'a mut Option<i64>,
    medium: &'a mut Option<String>,
    lora_name: &'a mut Option<String>,
    extra_keys: &'a mut Option<Vec<Option<Vec<Value>>>>,
    group_idx: &'a mut Option<i64>,
    kv_cache_spec_kind: &'a mut Option<String>,
    kv_cache_spec_sliding_window: &'a mut Option<i64>,
}

fn removed(hashes: &[i64], medium: Option<&str>) -> EngineEvent {
    EngineEvent::BlockRemoved {
        block_hashes: hashes.iter().copied().map(h).collect(),
        medium: medium.map(str::to_string),
        group_idx: None,
    }
}

fn chain(
    parent: Option<SequenceHash>,
    tokens: &[u32],
    size: u32,
    seed: HashSeed,
) -> Vec<StoredBlock> {
    let mut prev = parent;
    tokens
        .chunks_exact(size as usize)
        .map(|block| {
            let local = local_block_hash(block, seed);
            let sequence = chain_sequence_hash(prev, local, seed);
            prev = Some(sequence);
            StoredBlock {
                sequence_hash: sequence,
                local_hash: local,
            }
        })
        .collect()
}

fn seqs(blocks: &[StoredBlock]) -> Vec<SequenceHash> {
    blocks.iter().map(|b| b.sequence_hash).collect()
}

// --- mirror -----------------------------------------------------------------------------------

#[test]
fn a_chain_from_the_root_gets_tandem_hashes() {
    let mut m = KvMirror::new(W, bs(4));
    let tokens: Vec<u32> = (0..8).collect();
    let changes = m.apply(&stored(&[11, 12], None, &tokens, 4));
    let expected: Vec<StoredBlock> = compute_block_hashes(&tokens, bs(4), HashSeed::UNSALTED)
        .iter()
        .map(|b| StoredBlock {
            sequence_hash: b.sequence,
            local_hash: b.local,
        })
        .collect();
    assert_eq!(
        changes,
        vec![(
            StorageTier::Device,
            KvEventKind::Stored {
                parent: None,
                blocks: expected.clone()
            }
        )]
    );
    assert_eq!(m.len(), 2);
    assert_eq!(
        m.lookup(&h(12)),
        Some((expected[1].sequence_hash, StorageTier::Device))
    );
}

#[test]
fn a_continuation_chains_onto_its_parent_and_inherits_its_seed() {
    let mut m = KvMirror::new(W, bs(4));
    let salt = "tenant-a";
    let first = with_stored(stored(&[1, 2], None, &[1, 2, 3, 4, 5, 6, 7, 8], 4), |f| {
        *f.extra_keys = Some(vec![Some(vec![Value::from(salt)]), None]);
    });
    m.apply(&first);
    // The continuation carries no salt of its own (vLLM puts it on the first block only).
    let changes = m.apply(&stored(&[3], Some(2), &[9, 10, 11, 12, 13], 4));
    let seed = HashSeed::from_salt(Some(salt.as_bytes()));
    let all = compute_block_hashes(&(1..=12).collect::<Vec<_>>(), bs(4), seed);
    let KvEventKind::Stored { parent, blocks } = &changes[0].1 else {
        panic!("expected a Stored change, got {changes:?}");
    };
    assert_eq!(*parent, Some(all[1].sequence));
    assert_eq!(blocks[0].sequence_hash, all[2].sequence);
    assert_eq!(blocks[0].local_hash, all[2].local);
}

#[test]
fn chain_start_salts_follow_vllm_extra_keys_then_lora() {
    let tokens = [5u32, 6, 7, 8];
    let seed_of = |e: EngineEvent| {
        let mut m = KvMirror::new(W, bs(4));
        let changes = m.apply(&e);
        let KvEventKind::Stored { blocks, .. } = &changes[0].1 else {
            panic!("expected Stored");
        };
        blocks[0].sequence_hash
    };
    let expect = |salt: Option<&str>| {
        chain(
            None,
            &tokens,
            4,
            HashSeed::from_salt(salt.map(str::as_bytes)),
        )[0]
        .sequence_hash
    };
    let base = || stored(&[1], None, &tokens, 4);
    assert_eq!(seed_of(base()), expect(None));
    // vLLM: lora keys + mm keys + [cache_salt] + prompt-embedding digests.
    let full = with_stored(base(), |f| {
        *f.lora_name = Some("adapter".into());
        *f.extra_keys = Some(vec![Some(vec![
            Value::from("adapter"),
            Value::Array(vec![Value::from("mm-hash"), Value::from(0)]),
            Value::from("salt-1"),
            Value::Binary(vec![1, 2, 3]),
        ])]);
    });
    assert_eq!(seed_of(full), expect(Some("salt-1")));
    // LoRA without a salt: the only string is the LoRA name.
    let lora_only = with_stored(base(), |f| {
        *f.lora_name = Some("adapter".into());
        *f.extra_keys = Some(vec![Some(vec![Value::from("adapter")])]);
    });
    assert_eq!(seed_of(lora_only), expect(Some("adapter")));
    let lora_name = with_stored(base(), |f| *f.lora_name = Some("adapter".into()));
    assert_eq!(seed_of(lora_name), expect(Some("adapter")));
    let lora_id = with_stored(base(), |f| *f.lora_id = Some(42));
    assert_eq!(seed_of(lora_id), expect(Some("42")));
    let empty_keys = with_stored(base(), |f| *f.extra_keys = Some(vec![None]));
    assert_eq!(seed_of(empty_keys), expect(None));
}

#[test]
fn a_trailing_partial_block_is_ignored_and_short_tokens_are_counted() {
    let mut m = KvMirror::new(W, bs(4));
    let changes = m.apply(&stored(&[1, 2], None, &(0..10).collect::<Vec<_>>(), 4));
    assert_eq!(m.len(), 2);
    assert_eq!(m.stats().token_count_mismatch, 0);
    assert_eq!(changes.len(), 1);
    let changes = m.apply(&stored(&[3, 4], None, &(20..26).collect::<Vec<_>>(), 4));
    assert_eq!(m.stats().token_count_mismatch, 1);
    let KvEventKind::Stored { blocks, .. } = &changes[0].1 else {
        panic!("expected Stored");
    };
    assert_eq!(blocks.len(), 1);
    assert!(m.lookup(&h(4)).is_none());
}

#[test]
fn removals_name_tandem_hashes_and_unknown_ones_are_counted() {
    let mut m = KvMirror::new(W, bs(2));
    let tokens = [1u32, 2, 3, 4];
    let c = chain(None, &tokens, 2, HashSeed::UNSALTED);
    m.apply(&stored(&[1, 2], None, &tokens, 2));
    assert_eq!(
        m.apply(&removed(&[2, 99], Some("GPU"))),
        vec![(
            StorageTier::Device,
            KvEventKind::Removed {
                blocks: vec![c[1].sequence_hash]
            }
        )]
    );
    assert_eq!(m.stats().unknown_removed, 1);
    // A removal for another medium than the block's is ignored.
    assert!(m.apply(&removed(&[1], Some("CPU"))).is_empty());
    assert_eq!(m.stats().tier_mismatch_removed, 1);
    assert_eq!(m.len(), 1);
    assert!(m.apply(&removed(&[], None)).is_empty());
}

#[test]
fn a_block_stored_in_another_tier_moves() {
    let mut m = KvMirror::new(W, bs(2));
    let tokens = [1u32, 2, 3, 4];
    let c = chain(None, &tokens, 2, HashSeed::UNSALTED);
    m.apply(&stored(&[1, 2], None, &tokens, 2));
    // vLLM's CPU offloading stores the tail block on the host.
    let offload = with_stored(stored(&[2], Some(1), &[3, 4], 2), |f| {
        *f.medium = Some("cpu".into());
    });
    assert_eq!(
        m.apply(&offload),
        vec![
            (
                StorageTier::Device,
                KvEventKind::Removed {
                    blocks: vec![c[1].sequence_hash]
                }
            ),
            (
                StorageTier::Host,
                KvEventKind::Stored {
                    parent: Some(c[0].sequence_hash),
                    blocks: vec![c[1]]
                }
            ),
        ]
    );
    assert_eq!(m.stats().tier_moves, 1);
    // The GPU copy's eviction no longer applies; the host one's does.
    assert!(m.apply(&removed(&[2], Some("GPU"))).is_empty());
    assert_eq!(
        m.apply(&removed(&[2], Some("CPU"))),
        vec![(
            StorageTier::Host,
            KvEventKind::Removed {
                blocks: vec![c[1].sequence_hash]
            }
        )]
    );
}

#[test]
fn storing_a_held_block_again_changes_nothing_and_splits_the_chain() {
    let mut m = KvMirror::new(W, bs(2));
    let tokens = [1u32, 2, 3, 4, 5, 6];
    let c = chain(None, &tokens, 2, HashSeed::UNSALTED);
    m.apply(&stored(&[2], Some(1), &[3, 4], 2)); // unknown parent: dropped
    assert_eq!(m.stats().unknown_parent, 1);
    m.apply(&stored(&[1, 2], None, &tokens[..4], 2));
    assert!(m.apply(&stored(&[1, 2], None, &tokens[..4], 2)).is_empty());
    // Blocks 1 and 2 held, 3 new: one Stored of block 3 under block 2.
    assert_eq!(
        m.apply(&stored(&[1, 2, 3], None, &tokens, 2)),
        vec![(
            StorageTier::Device,
            KvEventKind::Stored {
                parent: Some(c[1].sequence_hash),
                blocks: vec![c[2]]
            }
        )]
    );
}

#[test]
fn clears_cover_the_tiers_that_held_blocks_and_empty_the_mirror() {
    let mut m = KvMirror::new(W, bs(2));
    assert!(m.apply(&EngineEvent::AllBlocksCleared).is_empty());
    m.apply(&stored(&[1], None, &[1, 2], 2));
    m.apply(&with_stored(stored(&[5], None, &[7, 8], 2), |f| {
        *f.medium = Some("CPU".into());
    }));
    assert_eq!(
        m.apply(&EngineEvent::AllBlocksCleared),
        vec![
            (StorageTier::Device, KvEventKind::Cleared),
            (StorageTier::Host, KvEventKind::Cleared)
        ]
    );
    assert!(m.is_empty());
    assert!(m.dump().is_empty());
    // Children of forgotten blocks are unknown-parent now.
    assert!(m.apply(&stored(&[2], Some(1), &[3, 4], 2)).is_empty());
    assert_eq!(m.stats().unknown_parent, 1);
}

#[test]
fn another_block_size_is_an_error_and_skips_the_event() {
    let mut m = KvMirror::new(W, bs(16));
    assert!(m.apply(&stored(&[1], None, &[1, 2, 3, 4], 4)).is_empty());
    assert_eq!(m.stats().block_size_mismatch, 1);
    assert!(m.is_empty());
}

#[test]
fn media_map_to_tiers() {
    assert_eq!(tier_of_medium(None), StorageTier::Device);
    assert_eq!(tier_of_medium(Some("GPU")), StorageTier::Device);
    assert_eq!(tier_of_medium(Some("cpu")), StorageTier::Host);
    assert_eq!(tier_of_medium(Some("Disk")), StorageTier::Disk);
    assert_eq!(tier_of_medium(Some("NVMe-oF")), StorageTier::Device);
}

#[test]
fn two_engine_blocks_with_one_tandem_hash_are_counted_once() {
    // Same tokens, different engine hashes (vLLM hashes multimodal identifiers too).
    let mut m = KvMirror::new(W, bs(2));
    let c = chain(None, &[9, 9], 2, HashSeed::UNSALTED);
    assert_eq!(m.apply(&stored(&[1], None, &[9, 9], 2)).len(), 1);
    assert!(m.apply(&stored(&[2], None, &[9, 9], 2)).is_empty());
    assert!(m.apply(&removed(&[1], None)).is_empty());
    assert_eq!(
        m.apply(&removed(&[2], None)),
        vec![(
            StorageTier::Device,
            KvEventKind::Removed {
                blocks: vec![c[0].sequence_hash]
            }
        )]
    );
}

#[test]
fn hybrid_models_follow_one_prefix_closed_group() {
    let mut m = KvMirror::new(W, bs(2));
    let sliding = with_stored(stored(&[1], None, &[1, 2], 2), |f| {
        *f.group_idx = Some(0);
        *f.kv_cache_spec_kind = Some("sliding_window".into());
        *f.kv_cache_spec_sliding_window = Some(128);
    });
    assert!(m.apply(&sliding).is_empty());
    let full = with_stored(stored(&[1], None, &[1, 2], 2), |f| {
        *f.group_idx = Some(1);
        *f.kv_cache_spec_kind = Some("full_attention".into());
    });
    assert_eq!(m.apply(&full).len(), 1);
    let removal_of_group_0 = EngineEvent::BlockRemoved {
        block_hashes: vec![h(1)],
        medium: None,
        group_idx: Some(0),
    };
    assert!(m.apply(&removal_of_group_0).is_empty());
    assert_eq!(m.len(), 1);
    assert_eq!(m.stats().other_group_events, 2);
    assert!(
        m.apply(&EngineEvent::Unknown {
            tag: "BlockUpdated".into()
        })
        .is_empty()
    );
    assert_eq!(m.stats().unknown_events, 1);
}

#[test]
fn the_mirror_is_bounded() {
    let mut m = KvMirror::new(W, bs(1)).with_max_blocks(3);
    m.apply(&stored(&[1, 2, 3], None, &[1, 2, 3], 1));
    let changes = m.apply(&stored(&[4], Some(3), &[4], 1));
    assert_eq!(changes, vec![(StorageTier::Device, KvEventKind::Cleared)]);
    assert_eq!(m.stats().overflows, 1);
    assert!(m.is_empty());
}

/// A consumer's view: the set of (tier, block) the events say are held.
#[derive(Default, Debug, PartialEq, Eq)]
struct Model {
    held: HashSet<(StorageTier, SequenceHash)>,
    parents: HashMap<SequenceHash, Option<SequenceHash>>,
}

impl Model {
    fn apply(&mut self, tier: StorageTier, kind: &KvEventKind) {
        match kind {
            KvEventKind::Stored { parent, blocks } => {
                let mut prev = *parent;
                for b in blocks {
                    self.held.insert((tier, b.sequence_hash));
                    self.parents.insert(b.sequence_hash, prev);
                    prev = Some(b.sequence_hash);
                }
            }
            KvEventKind::Removed { blocks } => {
                for b in blocks {
                    self.held.remove(&(tier, *b));
                }
            }
            KvEventKind::Cleared => self.held.retain(|(t, _)| *t != tier),
        }
    }
}

#[test]
fn a_dump_equals_replaying_the_stream() {
    let mut rng = Rng::seed_from_u64(7);
    let size = 2u32;
    let mut m = KvMirror::new(W, bs(size));
    let mut stream = Model::default();
    // Engine-side truth: prompts as chains of engine hashes.
    let mut next_hash = 1i64;
    let mut chains: Vec<Vec<(i64, [u32; 2])>> = Vec::new();
    let media = [None, Some("GPU"), Some("CPU"), Some("DISK")];
    for step in 0..2000 {
        let roll = rng.below(10);
        let event = if roll < 5 || chains.is_empty() {
            // Extend a chain or start one (shared prefixes: few distinct tokens).
            let pick = rng.below(chains.len() + 1);
            let medium = media[rng.below(media.len())].map(str::to_string);
            let mut blocks = Vec::new();
            for _ in 0..=rng.below(3) {
                let t = [rng.below(3) as u32, rng.below(3) as u32];
                blocks.push((next_hash, t));
                next_hash += 1;
            }
            let parent = if pick < chains.len() {
                chains[pick].last().map(|b| b.0)
            } else {
                None
            };
            let tokens: Vec<u32> = blocks.iter().flat_map(|b| b.1).collect();
            let hashes: Vec<i64> = blocks.iter().map(|b| b.0).collect();
            if pick < chains.len() {
                chains[pick].extend(blocks);
            } else {
                chains.push(blocks);
            }
            with_stored(stored(&hashes, parent, &tokens, size), |f| {
                *f.medium = medium
            })
        } else if roll < 8 {
            // Evict a chain's tail (prefix-closed, like vLLM's LRU over freed blocks).
            let pick = rng.below(chains.len());
            let Some((hash, _)) = chains[pick].pop() else {
                continue;
            };
            if chains[pick].is_empty() {
                chains.swap_remove(pick);
            }
            let medium = media[rng.below(media.len())];
            removed(&[hash], medium)
        } else if roll < 9 {
            // Store a chain's tail again, maybe in another tier (offloading, onloading).
            let pick = rng.below(chains.len());
            let n = chains[pick].len();
            let (hash, tokens) = chains[pick][n - 1];
            let parent = n.checked_sub(2).map(|i| chains[pick][i].0);
            let medium = media[rng.below(media.len())].map(str::to_string);
            with_stored(stored(&[hash], parent, &tokens, size), |f| {
                *f.medium = medium
            })
        } else if step % 7 == 0 {
            chains.clear();
            EngineEvent::AllBlocksCleared
        } else {
            continue;
        };
        for (tier, kind) in m.apply(&event) {
            stream.apply(tier, &kind);
        }
    }
    let mut dumped = Model::default();
    let dump = m.dump();
    for (tier, kind) in &dump {
        // Parents before children within a tier.
        if let KvEventKind::Stored {
            parent: Some(p), ..
        } = kind
            && stream.held.contains(&(*tier, *p))
        {
            assert!(dumped.held.contains(&(*tier, *p)), "parent after child");
        }
        dumped.apply(*tier, kind);
    }
    assert_eq!(dumped.held, stream.held);
    assert!(!dumped.held.is_empty());
    for (tier, seq) in &dumped.held {
        assert_eq!(dumped.parents[seq], stream.parents[seq], "{tier:?}");
    }
    assert!(m.stats().tier_moves > 0);
}

// --- codec ------------------------------------------------------------------------------------

fn sample_batch(bytes_hashes: bool) -> EngineBatch {
    let hash = |v: i64| {
        if bytes_hashes {
            EngineHash::Bytes(v.to_be_bytes().to_vec())
        } else {
            EngineHash::Int(v)
        }
    };
    EngineBatch {
        ts: 1_722_000_000.125,
        events: vec![
            EngineEvent::BlockStored {
                block_hashes: vec![hash(-5), hash(i64::MAX), EngineHash::Uint(u64::MAX)],
                parent_block_hash: Some(hash(-300_000)),
                token_ids: (0..48).map(|t| t * 70_000).collect(),
                block_size: 16,
                lora_id: Some(3),
                medium: Some("GPU".into()),
                lora_name: Some("a-lora-name-that-is-longer-than-31-bytes".into()),
                extra_keys: Some(vec![
                    Some(vec![
                        Value::from("salt"),
                        Value::Array(vec![Value::from("mm"), Value::from(-1)]),
                        Value::Binary(vec![0; 300]),
                        Value::F64(0.5),
                        Value::Boolean(true),
                        Value::Nil,
                    ]),
                    None,
                    None,
                ]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                kv_cache_spec_sliding_window: Some(4096),
            },
            EngineEvent::BlockStored {
                block_hashes: vec![hash(1)],
                parent_block_hash: None,
                token_ids: vec![1; 16],
                block_size: 16,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
            },
            EngineEvent::BlockRemoved {
                block_hashes: (0..20).map(hash).collect(),
                medium: Some("CPU".into()),
                group_idx: Some(1),
            },
            EngineEvent::BlockRemoved {
                block_hashes: vec![],
                medium: None,
                group_idx: None,
            },
            EngineEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    }
}

#[test]
fn both_shapes_round_trip() {
    for shape in [WireShape::ArrayLike, WireShape::Map] {
        for bytes_hashes in [false, true] {
            let batch = sample_batch(bytes_hashes);
            let encoded = encode_batch(&batch, shape);
            assert_eq!(decode_batch(&encoded).unwrap(), batch, "{shape:?}");
        }
    }
    let no_rank = EngineBatch {
        data_parallel_rank: None,
        ..sample_batch(false)
    };
    for shape in [WireShape::ArrayLike, WireShape::Map] {
        assert_eq!(
            decode_batch(&encode_batch(&no_rank, shape)).unwrap(),
            no_rank
        );
    }
}

/// A fixstr (the spec's `101xxxxx` head), for readable golden bytes.
fn fixstr(s: &str) -> Vec<u8> {
    assert!(s.len() < 32);
    let mut out = vec![0xa0 | s.len() as u8];
    out.extend_from_slice(s.as_bytes());
    out
}

fn golden_array() -> (EngineBatch, Vec<u8>) {
    let batch = EngineBatch {
        ts: 1.5,
        events: vec![
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Int(-1), EngineHash::Uint(u64::MAX)],
                medium: Some("GPU".into()),
                group_idx: None,
            },
            EngineEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    };
    let mut b = vec![0x93]; // fixarray(3): ts, events, data_parallel_rank
    b.extend([0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]); // float64 1.5
    b.push(0x92); // 2 events
    b.push(0x94); // BlockRemoved: tag + 3 fields, defaults written
    b.extend(fixstr("BlockRemoved"));
    b.extend([0x92, 0xff, 0xcf]); // [-1 (negative fixint), uint64 ...
    b.extend([0xff; 8]); // ... 2^64 - 1]
    b.extend(fixstr("GPU"));
    b.push(0xc0); // group_idx nil
    b.push(0x91); // AllBlocksCleared: tag only
    b.extend(fixstr("AllBlocksCleared"));
    b.push(0x00); // data_parallel_rank 0
    (batch, b)
}

fn golden_map() -> (EngineBatch, Vec<u8>) {
    let batch = EngineBatch {
        ts: 1.5,
        events: vec![EngineEvent::BlockStored {
            block_hashes: vec![EngineHash::Bytes(vec![0xab, 0xcd])],
            parent_block_hash: Some(EngineHash::Int(300)),
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: None,
            medium: Some("CPU".into()),
            lora_name: None,
            extra_keys: Some(vec![Some(vec![Value::from("s")])]),
            group_idx: Some(0),
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }],
        data_parallel_rank: None,
    };
    let mut b = vec![0x82]; // fixmap(2): data_parallel_rank None omitted
    b.extend(fixstr("ts"));
    b.extend([0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
    b.extend(fixstr("events"));
    b.push(0x91);
    b.push(0x8a); // fixmap(10): type + 7 required + extra_keys + group_idx
    b.extend(fixstr("type"));
    b.extend(fixstr("BlockStored"));
    b.extend(fixstr("block_hashes"));
    b.extend([0x91, 0xc4, 0x02, 0xab, 0xcd]); // [bin8 of 2 bytes]
    b.extend(fixstr("parent_block_hash"));
    b.extend([0xcd, 0x01, 0x2c]); // uint16 300
    b.extend(fixstr("token_ids"));
    b.extend([0x92, 0x01, 0x02]);
    b.extend(fixstr("block_size"));
    b.push(0x02);
    b.extend(fixstr("lora_id"));
    b.push(0xc0);
    b.extend(fixstr("medium"));
    b.extend(fixstr("CPU"));
    b.extend(fixstr("lora_name"));
    b.push(0xc0);
    b.extend(fixstr("extra_keys"));
    b.extend([0x91, 0x91]); // [("s",)]
    b.extend(fixstr("s"));
    b.extend(fixstr("group_idx"));
    b.push(0x00);
    (batch, b)
}

#[test]
fn golden_bytes_from_the_msgpack_spec() {
    for (batch, bytes) in [golden_array(), golden_map()] {
        let shape = if bytes[0] == 0x93 {
            WireShape::ArrayLike
        } else {
            WireShape::Map
        };
        assert_eq!(encode_batch(&batch, shape), bytes, "{shape:?}");
        assert_eq!(decode_batch(&bytes).unwrap(), batch);
    }
}

#[test]
fn older_schemas_and_mixed_shapes_decode() {
    // SGLang / first vLLM: [ts, events], BlockStored(hashes, parent, tokens, size, lora_id),
    // BlockRemoved(hashes).
    let mut b = vec![0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x92];
    b.push(0x96);
    b.extend(fixstr("BlockStored"));
    b.extend([0x91, 0xd3]); // [int64 -2^63]
    b.extend(i64::MIN.to_be_bytes());
    b.extend([0x05, 0x92, 0x01, 0x02, 0x02, 0x07]); // parent 5, tokens, size 2, lora_id 7
    b.push(0x92);
    b.extend(fixstr("BlockRemoved"));
    b.extend([0x91, 0x05]);
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.data_parallel_rank, None);
    assert_eq!(
        batch.events[0],
        EngineEvent::BlockStored {
            block_hashes: vec![EngineHash::Int(i64::MIN)],
            parent_block_hash: Some(EngineHash::Int(5)),
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: Some(7),
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    );
    assert_eq!(batch.events[1], removed(&[5], None));

    // A positional batch around map events, keys out of order, unknown keys and positions.
    let mut b = vec![0x94, 0x01, 0x91]; // [ts as int, [event], rank, extra]
    b.push(0x86);
    b.extend(fixstr("cache_salt"));
    b.extend(fixstr("ignored"));
    b.extend(fixstr("block_size"));
    b.push(0x01);
    b.extend(fixstr("token_ids"));
    b.extend([0x91, 0x09]);
    b.extend(fixstr("parent_block_hash"));
    b.push(0xc0);
    b.extend(fixstr("type"));
    b.extend(fixstr("BlockStored"));
    b.extend(fixstr("block_hashes"));
    b.extend([0x91, 0x2a]);
    b.extend([0x03, 0x81, 0xa1, b'k', 0x90]); // rank 3, an unknown trailing element
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.ts, 1.0);
    assert_eq!(batch.data_parallel_rank, Some(3));
    assert_eq!(batch.events, vec![stored(&[42], None, &[9], 1)]);
}

#[test]
fn malformed_batches_are_typed_errors() {
    use super::EventsError;
    let schema = |b: &[u8]| matches!(decode_batch(b), Err(EventsError::Schema { .. }));
    let msgpack = |b: &[u8]| matches!(decode_batch(b), Err(EventsError::Msgpack { .. }));
    assert!(msgpack(&[]));
    assert!(msgpack(&[0x92, 0xcb, 0x3f]));
    assert!(msgpack(&[0xc1]));
    assert!(schema(&[0xc0]));
    assert!(schema(&[0x91, 0x00]));
    // Trailing bytes after a valid batch.
    let mut b = encode_batch(&golden_array().0, WireShape::ArrayLike);
    b.push(0);
    assert!(msgpack(&b));
    // A map event without its parent field must not become a sequence start.
    let mut b = vec![0x92, 0x00, 0x91, 0x84];
    b.extend(fixstr("type"));
    b.extend(fixstr("BlockStored"));
    b.extend(fixstr("block_hashes"));
    b.push(0x90);
    b.extend(fixstr("token_ids"));
    b.push(0x90);
    b.extend(fixstr("block_size"));
    b.push(0x01);
    assert!(schema(&b));
    // A token id over 2^32.
    let mut b = vec![0x92, 0x00, 0x91, 0x95];
    b.extend(fixstr("BlockStored"));
    b.extend([0x90, 0xc0, 0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0, 0x01]);
    assert!(schema(&b));
    // Invalid UTF-8 in a tag.
    assert!(msgpack(&[0x92, 0x00, 0x91, 0x91, 0xa1, 0xff]));
    // A lying array length reserves nothing and fails cleanly.
    assert!(msgpack(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]));
    // An unknown event class is kept, not an error.
    let mut b = vec![0x92, 0x00, 0x91, 0x92];
    b.extend(fixstr("BlockTouched"));
    b.push(0x07);
    assert_eq!(
        decode_batch(&b).unwrap().events,
        vec![EngineEvent::Unknown {
            tag: "BlockTouched".into()
        }]
    );
    let too_big = vec![0u8; super::MAX_PAYLOAD_BYTES + 1];
    assert!(matches!(
        decode_batch(&too_big),
        Err(EventsError::TooLarge { .. })
    ));
}

#[test]
fn garbage_never_panics() {
    let mut rng = Rng::seed_from_u64(0x5eed);
    let valid: Vec<Vec<u8>> = [WireShape::ArrayLike, WireShape::Map]
        .iter()
        .flat_map(|&s| {
            [
                encode_batch(&sample_batch(false), s),
                encode_batch(&sample_batch(true), s),
            ]
        })
        .chain([golden_array().1, golden_map().1])
        .collect();
    let mut mirror = KvMirror::new(W, bs(16));
    let mut decoded = 0;
    for i in 0..20_000 {
        let mut bytes = if i % 4 == 0 {
            (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect()
        } else {
            valid[rng.below(valid.len())].clone()
        };
        match rng.below(4) {
            0 if !bytes.is_empty() => {
                let cut = rng.below(bytes.len());
                bytes.truncate(cut);
            }
            1 | 2 if !bytes.is_empty() => {
                for _ in 0..=rng.below(4) {
                    let at = rng.below(bytes.len());
                    bytes[at] = rng.next_u64() as u8;
                }
            }
            _ => {}
        }
        if let Ok(batch) = decode_batch(&bytes) {
            decoded += 1;
            for e in &batch.events {
                mirror.apply(e);
            }
        }
    }
    assert!(decoded > 100, "mutations should leave some batches valid");
    let _ = mirror.dump();
}

// --- sequence rules and log -------------------------------------------------------------------

#[test]
fn sequence_rules() {
    let mut t = SeqTracker::default();
    assert_eq!(t.classify(0, false), Verdict::Accept);
    assert_eq!(t.classify(4, false), Verdict::Gap { from: 0 });
    t.accept(0);
    assert_eq!(t.classify(1, false), Verdict::Accept);
    t.accept(1);
    assert_eq!(t.classify(5, false), Verdict::Gap { from: 2 });
    // A replay covered 2..=6; live 5 (queued meanwhile) is a duplicate, 7 is next.
    t.repaired(7);
    assert_eq!(t.classify(5, false), Verdict::Duplicate);
    t.duplicate(5);
    assert_eq!(t.classify(6, false), Verdict::Duplicate);
    t.duplicate(6);
    assert_eq!(t.classify(7, false), Verdict::Accept);
    t.accept(7);
    assert_eq!(t.classify(0, false), Verdict::Restart);
    assert_eq!(t.classify(7, false), Verdict::Restart);
    assert_eq!(t.classify(9, true), Verdict::Rejoin);
    assert_eq!(t.classify(8, true), Verdict::Accept);
    t.reset();
    assert!(!t.joined());
    assert_eq!(t.classify(0, false), Verdict::Accept);
}

#[test]
fn the_log_numbers_without_holes_and_keeps_a_bounded_ring() {
    let mut log = RelayLog::new(W, 3);
    assert_eq!(log.since(0), Some(vec![]));
    let ev = |n: usize| -> Vec<(StorageTier, KvEventKind)> {
        (0..n)
            .map(|_| (StorageTier::Device, KvEventKind::Cleared))
            .collect()
    };
    let first = log.push(ev(2));
    assert_eq!(first.iter().map(|e| e.event_id).collect::<Vec<_>>(), [1, 2]);
    assert!(log.push(Vec::new()).is_empty());
    log.push(ev(3));
    assert_eq!(log.last_id(), 5);
    assert_eq!(log.since(5), Some(vec![]));
    assert_eq!(
        log.since(2)
            .unwrap()
            .iter()
            .map(|e| e.event_id)
            .collect::<Vec<_>>(),
        [3, 4, 5]
    );
    assert_eq!(log.since(1), None);
    // Bounded by blocks too; the newest event always stays.
    let mut log = RelayLog::new(W, 100).with_max_blocks(2);
    log.push(ev(5));
    assert_eq!(log.since(3).map(|e| e.len()), Some(2));
    assert_eq!(log.since(2), None);

    let mut m = KvMirror::new(W, bs(2));
    let changes = m.apply(&stored(&[1, 2], None, &[1, 2, 3, 4], 2));
    let mut log = RelayLog::new(W, 10);
    log.push(changes.clone());
    let dump = log.dump(&m);
    assert_eq!(dump.last_event_id, 1);
    assert_eq!(dump.worker_id, W);
    assert_eq!(dump.events.len(), 1);
    assert_eq!(dump.events[0].event_id, 1);
    assert_eq!(dump.events[0].kind, changes[0].1);
    assert_eq!(
        seqs(match &dump.events[0].kind {
            KvEventKind::Stored { blocks, .. } => blocks,
            _ => panic!("expected Stored"),
        }),
        seqs(&chain(None, &[1, 2, 3, 4], 2, HashSeed::UNSALTED))
    );
}
