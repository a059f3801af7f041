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

mod codec;

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
fn chain_start_seeds_follow_vllm_extra_keys_and_lora_as_a_request_would() {
    let tokens = [5u32, 6, 7, 8];
    let seed_of = |e: EngineEvent| {
        let mut m = KvMirror::new(W, bs(4));
        let changes = m.apply(&e);
        let KvEventKind::Stored { blocks, .. } = &changes[0].1 else {
            panic!("expected Stored");
        };
        blocks[0].sequence_hash
    };
    // What the frontend hashes for a request with this salt on this adapter.
    let expect = |salt: Option<&str>, adapter: Option<&str>| {
        chain(
            None,
            &tokens,
            4,
            HashSeed::for_request(salt.map(str::as_bytes), adapter),
        )[0]
        .sequence_hash
    };
    let base = || stored(&[1], None, &tokens, 4);
    assert_eq!(seed_of(base()), expect(None, None));
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
    assert_eq!(seed_of(full), expect(Some("salt-1"), Some("adapter")));
    // A salt without LoRA: the salt alone, as before LoRA-aware seeds.
    let salted = with_stored(base(), |f| {
        *f.extra_keys = Some(vec![Some(vec![Value::from("salt-1")])]);
    });
    assert_eq!(seed_of(salted), expect(Some("salt-1"), None));
    assert_eq!(
        expect(Some("salt-1"), None),
        chain(None, &tokens, 4, HashSeed::from_salt(Some(b"salt-1")))[0].sequence_hash
    );
    // LoRA without a salt: the only string is the LoRA name, which is not a salt.
    let lora_only = with_stored(base(), |f| {
        *f.lora_name = Some("adapter".into());
        *f.extra_keys = Some(vec![Some(vec![Value::from("adapter")])]);
    });
    assert_eq!(seed_of(lora_only), expect(None, Some("adapter")));
    let lora_name = with_stored(base(), |f| *f.lora_name = Some("adapter".into()));
    assert_eq!(seed_of(lora_name), expect(None, Some("adapter")));
    // The name wins over the id; the id alone names the adapter in decimal.
    let both = with_stored(base(), |f| {
        *f.lora_name = Some("adapter".into());
        *f.lora_id = Some(42);
    });
    assert_eq!(seed_of(both), expect(None, Some("adapter")));
    let lora_id = with_stored(base(), |f| *f.lora_id = Some(42));
    assert_eq!(seed_of(lora_id), expect(None, Some("42")));
    let empty_name = with_stored(base(), |f| *f.lora_name = Some(String::new()));
    assert_eq!(seed_of(empty_name), expect(None, None));
    let empty_keys = with_stored(base(), |f| *f.extra_keys = Some(vec![None]));
    assert_eq!(seed_of(empty_keys), expect(None, None));
    // A LoRA chain never matches the base model's, another adapter's, or a salt that
    // happens to be the adapter's name.
    assert_ne!(expect(None, Some("adapter")), expect(None, None));
    assert_ne!(expect(None, Some("adapter")), expect(None, Some("other")));
    assert_ne!(expect(None, Some("adapter")), expect(Some("adapter"), None));
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
