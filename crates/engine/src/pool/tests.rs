use proptest::prelude::*;
use tandem_protocol::{
    BlockHashes, BlockSize, HashSeed, KvEventKind, RequestId, StorageTier, WorkerId,
};

use super::*;
use crate::disk::{DiskBlock, DiskStore};

fn pool(device: u32, host: u32) -> BlockPool {
    let mut cfg = BlockPoolConfig::new(WorkerId(1), device);
    cfg.block_size = BlockSize::new(4).unwrap();
    cfg.host_blocks = host;
    cfg.bytes_per_block = 8;
    BlockPool::new(cfg).unwrap()
}

fn hashes(tokens: &[u32]) -> Vec<BlockHashes> {
    tandem_protocol::hashing::compute_block_hashes(
        tokens,
        BlockSize::new(4).unwrap(),
        HashSeed::UNSALTED,
    )
}

/// Runs a whole sequence through the pool: acquire its prefix, allocate, commit, free.
fn run_seq(p: &mut BlockPool, id: u64, tokens: &[u32]) -> Result<PrefixHit, PoolError> {
    let hs = hashes(tokens);
    let seq = RequestId(id);
    let hit = p.acquire_prefix(seq, &hs, hs.len())?;
    if let Err(e) = p.allocate(seq, tokens.len()) {
        p.free(seq)?;
        return Err(e);
    }
    p.commit(seq, &hs)?;
    p.free(seq)?;
    Ok(hit)
}

#[test]
fn zero_device_blocks_is_an_error() {
    assert_eq!(
        BlockPool::new(BlockPoolConfig::new(WorkerId(1), 0)).unwrap_err(),
        PoolError::NoDeviceBlocks
    );
}

#[test]
fn prefix_is_reused_with_reference_counts() {
    let mut p = pool(8, 0);
    let a: Vec<u32> = (0..12).collect();
    assert_eq!(run_seq(&mut p, 1, &a).unwrap(), PrefixHit::default());
    let hs = hashes(&a);
    let hit = p.acquire_prefix(RequestId(2), &hs, 3).unwrap();
    assert_eq!(
        hit,
        PrefixHit {
            device: 3,
            host: 0,
            disk: 0
        }
    );
    let hit2 = p.acquire_prefix(RequestId(3), &hs, 2).unwrap();
    assert_eq!(hit2.device, 2);
    assert_eq!(p.active_blocks(), 3);
    let t2 = p.block_table(RequestId(2)).unwrap().to_vec();
    assert_eq!(p.block_table(RequestId(3)).unwrap(), &t2[..2]);
    p.free(RequestId(2)).unwrap();
    assert_eq!(
        p.active_blocks(),
        2,
        "blocks shared with seq 3 stay referenced"
    );
    p.free(RequestId(3)).unwrap();
    assert_eq!(p.active_blocks(), 0);
    assert_eq!(
        p.cached_count(StorageTier::Device),
        3,
        "unreferenced blocks stay cached"
    );
    p.check_invariants().unwrap();
}

#[test]
fn partial_blocks_are_not_cached() {
    let mut p = pool(8, 0);
    let a: Vec<u32> = (0..6).collect();
    run_seq(&mut p, 1, &a).unwrap();
    assert_eq!(p.cached_count(StorageTier::Device), 1);
    p.check_invariants().unwrap();
}

#[test]
fn eviction_is_lru_and_tail_first() {
    let mut p = pool(4, 0);
    let a: Vec<u32> = (0..12).collect(); // 3 blocks
    run_seq(&mut p, 1, &a).unwrap();
    let b: Vec<u32> = (100..108).collect(); // 2 blocks: one free block + evict one
    run_seq(&mut p, 2, &b).unwrap();
    // a's tail (block 2) was evicted, its head kept.
    let ha = hashes(&a);
    assert_eq!(
        p.lookup(&sequence_hashes(&ha)),
        PrefixHit {
            device: 2,
            host: 0,
            disk: 0
        }
    );
    let evs = p.events_since(0).unwrap();
    let removed: Vec<_> = evs
        .iter()
        .filter_map(|e| match &e.kind {
            KvEventKind::Removed { blocks } => Some(blocks.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(removed, vec![vec![ha[2].sequence]]);
    p.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut p = pool(2, 0);
    p.allocate(RequestId(1), 8).unwrap();
    let before = p.last_event_id();
    assert_eq!(
        p.allocate(RequestId(2), 4),
        Err(PoolError::OutOfBlocks {
            needed: 1,
            available: 0
        })
    );
    assert!(p.block_table(RequestId(2)).is_none());
    assert_eq!(p.last_event_id(), before);
    p.check_invariants().unwrap();
}

#[test]
fn held_blocks_stay_out_of_the_free_list_until_released() {
    let mut p = pool(4, 0);
    let seq = RequestId(1);
    p.allocate(seq, 8).unwrap();
    let blocks = p.block_table(seq).unwrap().to_vec();
    // Not referenced, or past the pool: refused, nothing held.
    assert_eq!(p.hold(&[blocks[0], 3]), Err(PoolError::NotHoldable(3)));
    assert_eq!(p.hold(&[99]), Err(PoolError::NotHoldable(99)));
    assert_eq!(p.held_blocks(), 0);
    p.hold(&blocks).unwrap();
    // The transfer's destination may still change: committing it is refused.
    let hs = hashes(&[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(p.commit(seq, &hs), Err(PoolError::CommitHeld(blocks[0])));
    p.free(seq).unwrap();
    p.check_invariants().unwrap();
    assert_eq!(
        p.available_blocks(),
        2,
        "the two held blocks are not available"
    );
    assert!(matches!(
        p.allocate(RequestId(2), 12),
        Err(PoolError::OutOfBlocks {
            needed: 3,
            available: 2
        })
    ));
    assert_eq!(
        p.release_hold(&[blocks[0], blocks[0]]),
        Err(PoolError::NotHeld(blocks[0]))
    );
    p.release_hold(&blocks).unwrap();
    assert_eq!(p.held_blocks(), 0);
    assert_eq!(p.available_blocks(), 4);
    assert_eq!(p.release_hold(&blocks), Err(PoolError::NotHeld(blocks[0])));
    p.check_invariants().unwrap();
}

#[test]
fn acquire_and_allocate_is_all_or_nothing() {
    // 4 device blocks, 8 host slots. `a` (2 blocks) ends up on host, `b` (2 blocks) on device,
    // cached and unreferenced.
    let mut p = pool(4, 8);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (100..108).collect();
    let c: Vec<u32> = (200..216).collect();
    run_seq(&mut p, 1, &a).unwrap();
    run_seq(&mut p, 2, &c).unwrap(); // evicts a to host
    run_seq(&mut p, 3, &b).unwrap();
    let mut a_long = a.clone();
    a_long.extend(300..306); // 14 tokens: a's 2 blocks + 1 full + 1 partial
    let ha = hashes(&a_long);
    assert_eq!(
        p.lookup(&sequence_hashes(&ha)),
        PrefixHit {
            device: 0,
            host: 2,
            disk: 0
        }
    );
    // Hold 1 block elsewhere: 3 available, 4 needed (2 promotions + 2 fresh).
    p.allocate(RequestId(8), 4).unwrap();
    let before = (p.last_event_id(), p.available_blocks(), p.stats());
    assert_eq!(
        p.acquire_and_allocate(RequestId(4), &ha, 3, 14),
        Err(PoolError::OutOfBlocks {
            needed: 4,
            available: 3
        })
    );
    assert_eq!(
        (p.last_event_id(), p.available_blocks(), p.stats()),
        before,
        "a refused reservation promotes, evicts and publishes nothing"
    );
    assert!(p.block_table(RequestId(4)).is_none());
    p.check_invariants().unwrap();
    p.free(RequestId(8)).unwrap();
    let hit = p.acquire_and_allocate(RequestId(4), &ha, 3, 14).unwrap();
    assert_eq!(
        hit,
        PrefixHit {
            device: 0,
            host: 2,
            disk: 0
        }
    );
    assert_eq!(p.block_table(RequestId(4)).unwrap().len(), 4);
    assert_eq!(p.committed_blocks(RequestId(4)), Some(2));
    assert_eq!(
        p.acquire_and_allocate(RequestId(4), &ha, 3, 14),
        Err(PoolError::DuplicateSequence(RequestId(4)))
    );
    p.check_invariants().unwrap();
}

#[test]
fn host_tier_takes_evicted_blocks_and_gives_them_back() {
    let mut p = pool(3, 4);
    let a: Vec<u32> = (0..12).collect(); // 3 blocks fill the device
    run_seq(&mut p, 1, &a).unwrap();
    // Remember a's bytes as written by "the model".
    let ta: Vec<u32> = {
        let hs = hashes(&a);
        p.acquire_prefix(RequestId(9), &hs, 3).unwrap();
        p.block_table(RequestId(9)).unwrap().to_vec()
    };
    for (i, &b) in ta.iter().enumerate() {
        p.device_arena_mut()
            .with_block_mut(b, |blk| blk.fill(i as u8 + 1));
    }
    p.free(RequestId(9)).unwrap();
    let b: Vec<u32> = (100..112).collect();
    run_seq(&mut p, 2, &b).unwrap();
    let ha = sequence_hashes(&hashes(&a));
    assert_eq!(
        p.lookup(&ha),
        PrefixHit {
            device: 0,
            host: 3,
            disk: 0
        }
    );
    assert_eq!(p.stats().device_evictions, 3);
    p.check_invariants().unwrap();
    // A hit on host blocks brings them back, bytes intact.
    let hit = p.acquire_prefix(RequestId(3), &hashes(&a), 3).unwrap();
    assert_eq!(
        hit,
        PrefixHit {
            device: 0,
            host: 3,
            disk: 0
        }
    );
    let t = p.block_table(RequestId(3)).unwrap().to_vec();
    for (i, &blk) in t.iter().enumerate() {
        assert!(
            p.device_arena()
                .block_bytes(blk)
                .iter()
                .all(|&x| x == i as u8 + 1),
            "block {i} bytes"
        );
    }
    assert_eq!(
        p.lookup(&ha),
        PrefixHit {
            device: 3,
            host: 0,
            disk: 0
        }
    );
    p.check_invariants().unwrap();
}

/// A pool of `device` and `host` blocks with a disk tier of `disk` slots in memory.
fn pool_with_disk(device: u32, host: u32, disk: u32) -> BlockPool {
    let mut p = pool(device, host);
    p.attach_disk(Box::new(crate::disk::MemoryDiskStore::new(disk)));
    p
}

/// Fills each block of the cached prefix of `tokens` with its index + `base`, as a model
/// would have written them.
fn write_prefix(p: &mut BlockPool, id: u64, tokens: &[u32], base: u8) {
    let hs = hashes(tokens);
    p.acquire_prefix(RequestId(id), &hs, hs.len()).unwrap();
    let table = p.block_table(RequestId(id)).unwrap().to_vec();
    for (i, &b) in table.iter().enumerate() {
        p.device_arena_mut()
            .with_block_mut(b, |blk| blk.fill(i as u8 + base));
    }
    p.free(RequestId(id)).unwrap();
}

#[test]
fn blocks_move_down_through_host_to_disk_and_come_back_intact() {
    for host in [0, 2] {
        let mut p = pool_with_disk(3, host, 8);
        let a: Vec<u32> = (0..12).collect();
        run_seq(&mut p, 1, &a).unwrap();
        write_prefix(&mut p, 9, &a, 1);
        // Two more sequences push a out of the device (and the host, when there is one).
        run_seq(&mut p, 2, &(100..112).collect::<Vec<_>>()).unwrap();
        run_seq(&mut p, 3, &(200..212).collect::<Vec<_>>()).unwrap();
        let ha = sequence_hashes(&hashes(&a));
        let hit = p.lookup(&ha);
        assert_eq!(hit.total(), 3, "host {host}: {hit:?}");
        assert!(hit.disk > 0, "host {host}: {hit:?}");
        p.check_invariants().unwrap();
        let events = p.events_since(0).unwrap();
        assert!(
            events.iter().any(
                |e| e.tier == StorageTier::Disk && matches!(e.kind, KvEventKind::Stored { .. })
            ),
            "disk blocks are announced"
        );
        let hit = p.acquire_prefix(RequestId(4), &hashes(&a), 3).unwrap();
        assert_eq!(hit.total(), 3, "host {host}: {hit:?}");
        assert!(p.stats().disk_promotions > 0);
        let t = p.block_table(RequestId(4)).unwrap().to_vec();
        for (i, &b) in t.iter().enumerate() {
            assert!(
                p.device_arena()
                    .block_bytes(b)
                    .iter()
                    .all(|&x| x == i as u8 + 1),
                "host {host}: block {i} bytes"
            );
        }
        assert_eq!(p.lookup(&ha).device, 3);
        p.check_invariants().unwrap();
    }
}

/// A store whose reads of chosen slots come back wrong (a bad sector, a torn record).
#[derive(Debug)]
struct BadSectors(crate::disk::MemoryDiskStore, Vec<u32>);

impl DiskStore for BadSectors {
    fn slots(&self) -> u32 {
        self.0.slots()
    }
    fn write(&mut self, slot: u32, block: &DiskBlock, bytes: &[u8]) -> bool {
        self.0.write(slot, block, bytes)
    }
    fn read(&mut self, slot: u32, block: &DiskBlock, out: &mut [u8]) -> bool {
        if self.1.contains(&slot) {
            self.0.corrupt(slot);
        }
        self.0.read(slot, block, out)
    }
    fn clear(&mut self, slot: u32) {
        self.0.clear(slot)
    }
    fn take_recovered(&mut self) -> Vec<(u32, DiskBlock)> {
        self.0.take_recovered()
    }
}

#[test]
fn a_disk_block_that_does_not_read_back_is_a_miss_and_takes_its_descendants() {
    let mut p = pool(3, 0);
    // Slots are handed out from 0: a's three blocks go to slots 0, 1, 2 (leaf first), so
    // slot 1 holds its middle block.
    p.attach_disk(Box::new(BadSectors(
        crate::disk::MemoryDiskStore::new(8),
        vec![1],
    )));
    let a: Vec<u32> = (0..12).collect();
    run_seq(&mut p, 1, &a).unwrap();
    write_prefix(&mut p, 9, &a, 1);
    run_seq(&mut p, 2, &(100..112).collect::<Vec<_>>()).unwrap();
    let ha = sequence_hashes(&hashes(&a));
    assert_eq!(
        p.lookup(&ha),
        PrefixHit {
            device: 0,
            host: 0,
            disk: 3
        }
    );
    // The first block comes back; the second does not read back: the prefix ends there,
    // and the third (its child) is dropped with it.
    let hit = p.acquire_prefix(RequestId(3), &hashes(&a), 3).unwrap();
    assert_eq!(
        hit,
        PrefixHit {
            device: 0,
            host: 0,
            disk: 1
        }
    );
    assert_eq!(p.stats().disk_misses, 1);
    assert_eq!(
        p.lookup(&ha),
        PrefixHit {
            device: 1,
            host: 0,
            disk: 0
        }
    );
    // What is left on disk is the other sequence's leaf, evicted for the block that came
    // back.
    assert_eq!(p.cached_count(StorageTier::Disk), 1);
    p.check_invariants().unwrap();
    let removed: usize = p
        .events_since(0)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.kind {
            KvEventKind::Removed { blocks } if e.tier == StorageTier::Disk => Some(blocks.len()),
            _ => None,
        })
        .sum();
    assert_eq!(removed, 3, "each block that left the disk is announced");
}

#[test]
fn a_restarted_pool_recovers_its_disk_and_announces_it_closed_under_prefixes() {
    let mut first = pool(3, 0);
    let store = Box::new(crate::disk::MemoryDiskStore::new(8));
    first.attach_disk(store);
    let a: Vec<u32> = (0..12).collect();
    run_seq(&mut first, 1, &a).unwrap();
    write_prefix(&mut first, 9, &a, 1);
    run_seq(&mut first, 2, &(100..112).collect::<Vec<_>>()).unwrap();
    assert_eq!(first.cached_count(StorageTier::Disk), 3);
    // The same disk seen by a new process (a copy of what the first pool's store holds,
    // `lose` missing): everything comes back, announced parents first.
    let reopen = |lose: Option<u32>| {
        let mut copy = crate::disk::MemoryDiskStore::new(8);
        for (slot, info) in first.disk.iter().enumerate() {
            if let Some(info) = info
                && Some(slot as u32) != lose
            {
                copy.write(slot as u32, &info.disk(), &[slot as u8; 8]);
            }
        }
        crate::disk::MemoryDiskStore::reopened(&copy)
    };
    let mut second = pool(3, 0);
    second.attach_disk(Box::new(reopen(None)));
    let ha = sequence_hashes(&hashes(&a));
    assert_eq!(
        second.lookup(&ha),
        PrefixHit {
            device: 0,
            host: 0,
            disk: 3
        }
    );
    second.check_invariants().unwrap();
    let stored: Vec<_> = second
        .events_since(0)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.kind {
            KvEventKind::Stored { parent, blocks } if e.tier == StorageTier::Disk => {
                Some((parent, blocks.len()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(stored.iter().map(|(_, n)| n).sum::<usize>(), 3);
    assert_eq!(stored[0].0, None, "the root first");
    // A lost record in the middle: its descendant is not brought back either.
    let middle = first
        .disk
        .iter()
        .position(|i| i.is_some_and(|i| i.position == 1))
        .unwrap() as u32;
    let mut third = pool(3, 0);
    third.attach_disk(Box::new(reopen(Some(middle))));
    assert_eq!(
        third.lookup(&ha),
        PrefixHit {
            device: 0,
            host: 0,
            disk: 1
        }
    );
    assert_eq!(third.cached_count(StorageTier::Disk), 1);
    third.check_invariants().unwrap();
}

#[test]
fn a_stopping_pool_spills_its_cache_to_disk_for_the_next_run() {
    for host in [0, 4] {
        let mut p = pool_with_disk(4, host, 16);
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..12).collect(), (100..108).collect());
        run_seq(&mut p, 1, &a).unwrap();
        write_prefix(&mut p, 9, &a, 1);
        run_seq(&mut p, 2, &b).unwrap();
        // b's two blocks are still in use by a running sequence: they stay.
        p.acquire_prefix(RequestId(5), &hashes(&b), 2).unwrap();
        p.spill_to_disk();
        p.check_invariants().unwrap();
        let ha = sequence_hashes(&hashes(&a));
        assert_eq!(
            p.lookup(&ha),
            PrefixHit {
                device: 0,
                host: 0,
                disk: 3
            },
            "host {host}"
        );
        assert_eq!(p.lookup(&sequence_hashes(&hashes(&b))).device, 2);
        // The disk now reads back a's bytes.
        p.free(RequestId(5)).unwrap();
        let hit = p.acquire_prefix(RequestId(6), &hashes(&a), 3).unwrap();
        assert_eq!(hit.disk, 3);
        let t = p.block_table(RequestId(6)).unwrap().to_vec();
        for (i, &blk) in t.iter().enumerate() {
            assert!(
                p.device_arena()
                    .block_bytes(blk)
                    .iter()
                    .all(|&x| x == i as u8 + 1)
            );
        }
    }
}

#[test]
fn commit_adopts_a_block_cached_by_another_sequence() {
    let mut p = pool(8, 0);
    let a: Vec<u32> = (0..8).collect();
    let hs = hashes(&a);
    // Two sequences compute the same prompt concurrently.
    for id in [1, 2] {
        p.acquire_prefix(RequestId(id), &hs, 2).unwrap();
        p.allocate(RequestId(id), 8).unwrap();
    }
    p.commit(RequestId(1), &hs).unwrap();
    p.commit(RequestId(2), &hs).unwrap();
    assert_eq!(p.block_table(RequestId(1)), p.block_table(RequestId(2)));
    assert_eq!(p.active_blocks(), 2);
    p.check_invariants().unwrap();
}

#[test]
fn dump_and_events_since_agree() {
    let mut p = pool(4, 2);
    for i in 0..6u32 {
        let t: Vec<u32> = (i * 100..i * 100 + 8).collect();
        run_seq(&mut p, u64::from(i), &t).unwrap();
    }
    let d = p.dump();
    assert_eq!(d.last_event_id, p.last_event_id());
    assert_eq!(
        d.events.len(),
        p.cached_count(StorageTier::Device) + p.cached_count(StorageTier::Host)
    );
    assert!(p.events_since(d.last_event_id).unwrap().is_empty());
}

#[test]
fn events_since_says_too_old() {
    let mut cfg = BlockPoolConfig::new(WorkerId(1), 2);
    cfg.block_size = BlockSize::new(4).unwrap();
    cfg.event_ring = 2;
    let mut p = BlockPool::new(cfg).unwrap();
    for i in 0..5u32 {
        let t: Vec<u32> = (i * 10..i * 10 + 4).collect();
        run_seq(&mut p, u64::from(i), &t).unwrap();
    }
    assert!(p.events_since(0).is_err());
    assert_eq!(p.events_since(p.last_event_id() - 2).unwrap().len(), 2);
}

#[test]
fn clear_cache_keeps_blocks_in_use() {
    let mut p = pool(4, 2);
    run_seq(&mut p, 1, &(0..8).collect::<Vec<_>>()).unwrap();
    let hs = hashes(&(50..58).collect::<Vec<_>>());
    p.acquire_prefix(RequestId(2), &hs, 2).unwrap();
    p.allocate(RequestId(2), 8).unwrap();
    p.commit(RequestId(2), &hs).unwrap();
    p.clear_cache();
    assert_eq!(p.cached_count(StorageTier::Device), 2);
    assert_eq!(p.cached_count(StorageTier::Host), 0);
    p.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence from a family of prompts sharing prefixes.
    Start {
        id: u8,
        family: u8,
        len: u8,
    },
    Grow {
        id: u8,
        extra: u8,
    },
    Finish {
        id: u8,
    },
    Clear,
    /// An aborted transfer into the sequence's uncommitted blocks: hold them, end the sequence.
    AbortTransfer {
        id: u8,
    },
    /// The oldest aborted transfer's writer is known to be done.
    Fence,
    /// A disk record lost behind the pool's back (its next read misses).
    LoseDisk {
        slot: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..6, 0u8..4, 1u8..40).prop_map(|(id, family, len)| Op::Start { id, family, len }),
        3 => (0u8..6, 1u8..9).prop_map(|(id, extra)| Op::Grow { id, extra }),
        4 => (0u8..6).prop_map(|id| Op::Finish { id }),
        1 => Just(Op::Clear),
        2 => (0u8..6).prop_map(|id| Op::AbortTransfer { id }),
        2 => Just(Op::Fence),
        1 => (0u8..16).prop_map(|slot| Op::LoseDisk { slot }),
    ]
}

/// Prompts of one family share leading tokens, so prefixes overlap at varying depths.
fn family_tokens(family: u8, len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if i < 12 {
                u32::from(family) * 1000 + i
            } else {
                salt * 7 + i
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn random_operations_keep_every_invariant(
        ops in proptest::collection::vec(op(), 1..120),
        device in 2u32..24,
        host in prop_oneof![Just(0u32), 1u32..12],
        disk in prop_oneof![Just(0u32), 1u32..16],
    ) {
        let mut p = if disk > 0 { pool_with_disk(device, host, disk) } else { pool(device, host) };
        let mut live: std::collections::HashMap<u8, Vec<u32>> = Default::default();
        let mut holds: std::collections::VecDeque<Vec<u32>> = Default::default();
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Start { id, family, len } => {
                    if live.contains_key(&id) { continue; }
                    let tokens = family_tokens(family, len as usize, step as u32 % 3);
                    let hs = hashes(&tokens);
                    let seq = RequestId(u64::from(id));
                    p.acquire_prefix(seq, &hs, hs.len()).unwrap();
                    if p.allocate(seq, tokens.len()).is_err() {
                        p.free(seq).unwrap();
                    } else {
                        p.commit(seq, &hs).unwrap();
                        live.insert(id, tokens);
                    }
                }
                Op::Grow { id, extra } => {
                    if let Some(tokens) = live.get_mut(&id) {
                        let start = tokens.len() as u32;
                        let new: Vec<u32> = (start..start + u32::from(extra)).collect();
                        if p.allocate(RequestId(u64::from(id)), tokens.len() + new.len()).is_ok() {
                            tokens.extend(new);
                            p.commit(RequestId(u64::from(id)), &hashes(tokens)).unwrap();
                        }
                    }
                }
                Op::Finish { id } => {
                    if live.remove(&id).is_some() {
                        p.free(RequestId(u64::from(id))).unwrap();
                    }
                }
                Op::Clear => p.clear_cache(),
                Op::AbortTransfer { id } => {
                    if live.remove(&id).is_some() {
                        let seq = RequestId(u64::from(id));
                        let committed = p.committed_blocks(seq).unwrap();
                        let fresh = p.block_table(seq).unwrap()[committed..].to_vec();
                        p.hold(&fresh).unwrap();
                        p.free(seq).unwrap();
                        for &b in &fresh {
                            prop_assert!(!p.device_free.contains(&b), "held block {} freed", b);
                        }
                        holds.push_back(fresh);
                    }
                }
                Op::Fence => {
                    if let Some(h) = holds.pop_front() {
                        p.release_hold(&h).unwrap();
                    }
                }
                Op::LoseDisk { slot } => {
                    if let Some(store) = p.disk_store.as_mut()
                        && u32::from(slot) < store.slots()
                    {
                        store.clear(u32::from(slot));
                    }
                }
            }
            if let Err(e) = p.check_invariants() {
                return Err(TestCaseError::fail(format!("after step {step}: {e}")));
            }
        }
    }
}
