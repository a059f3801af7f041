//! The paged KV block pool with a prefix cache and optional host and disk tiers.
//!
//! Device blocks are referenced by running sequences (reference counted, so a cached prefix is
//! shared), free, or *cached and unreferenced*: still reusable by a later prefix hit, kept in an
//! LRU list and evicted only when a block is needed. Tiers are exclusive and a block moves down
//! them as it is evicted: from device to host memory (its bytes copied), from host to disk
//! ([`DiskStore`], attached with [`BlockPool::attach_disk`]; straight from device without a
//! host tier), and off the last tier; each lower tier evicts its own LRU when full. A prefix
//! hit on a host or disk block brings it back to device; a disk block that no longer reads back
//! intact is a miss (dropped, the request computes it).
//!
//! # Prefix closure
//! The pool guarantees, after every public operation: the set of blocks cached on device is
//! prefix-closed (a cached block's parent is cached on device), and so are device ∪ host and
//! device ∪ host ∪ disk. The global index relies on it to find a worker's leading match by
//! binary search instead of one lookup per block. Why it holds:
//! - a referenced block's parent is referenced (a sequence holds its whole prefix);
//! - a sequence releases its blocks tail first, so in each LRU list a child always stands
//!   before its parent (a parent is released at least as late as any of its children);
//! - eviction takes the LRU front, so children leave a tier before their parent, and arrive in
//!   the next tier before it; a lower tier's block never has a child in a higher tier;
//! - a disk miss drops the block's cached descendants on disk with it.
//!
//! [`BlockPool::check_invariants`] verifies all of this; the property tests call it after
//! every operation.

mod disk_tier;
mod ops;
#[cfg(test)]
mod tests;

use hashbrown::HashMap;
use tandem_protocol::{
    BlockHashes, BlockSize, KvDump, KvEvent, KvEventKind, LocalBlockHash, RequestId, SequenceHash,
    StorageTier, StoredBlock, WorkerId,
};

use crate::arena::KvArena;
use crate::disk::{DiskBlock, DiskStore};
use crate::event_log::{EventLog, EventsTooOld};
use crate::lru::LruList;

/// Sizes of a pool.
#[derive(Clone, Debug)]
pub struct BlockPoolConfig {
    pub worker_id: WorkerId,
    pub block_size: BlockSize,
    /// Device (GPU) blocks; at least 1.
    pub device_blocks: u32,
    /// Host blocks; 0 means no host tier.
    pub host_blocks: u32,
    /// Bytes per block in the arenas (0 for timing-only simulation).
    pub bytes_per_block: usize,
    /// Recent events kept for `events_since` (default 4096).
    pub event_ring: usize,
}

impl BlockPoolConfig {
    pub fn new(worker_id: WorkerId, device_blocks: u32) -> Self {
        BlockPoolConfig {
            worker_id,
            block_size: BlockSize::DEFAULT,
            device_blocks,
            host_blocks: 0,
            bytes_per_block: 0,
            event_ring: 4096,
        }
    }
}

/// Errors of the block pool.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("a pool needs at least one device block")]
    NoDeviceBlocks,
    #[error("device arena: {0}")]
    ArenaSize(#[from] crate::arena::ArenaSizeMismatch),
    #[error("out of KV blocks: need {needed}, {available} can be freed")]
    OutOfBlocks { needed: usize, available: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(RequestId),
    #[error("sequence {0} is already allocated")]
    DuplicateSequence(RequestId),
    #[error("block {0} cannot be held: it is not referenced, or it is cached")]
    NotHoldable(u32),
    #[error("block {0} is not held")]
    NotHeld(u32),
    #[error("block {0} is held for a transfer that may still write it: it cannot be committed")]
    CommitHeld(u32),
    #[error("sequence {seq} has {held} blocks, cannot commit {asked} full blocks")]
    CommitBeyondTable {
        seq: RequestId,
        held: usize,
        asked: usize,
    },
}

/// Leading cached blocks of a prefix, by tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

impl PrefixHit {
    pub fn total(&self) -> usize {
        self.device + self.host + self.disk
    }
}

/// Identity of a cached block, kept to emit its events and dump it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CachedInfo {
    pub(crate) hash: BlockHashes,
    pub(crate) parent: Option<SequenceHash>,
    /// Block position in its sequence; orders dumps parents first.
    pub(crate) position: u32,
}

impl CachedInfo {
    fn disk(&self) -> DiskBlock {
        DiskBlock {
            hash: self.hash,
            parent: self.parent,
            position: self.position,
        }
    }

    fn stored(&self) -> StoredBlock {
        StoredBlock {
            sequence_hash: self.hash.sequence,
            local_hash: self.hash.local,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Location {
    Device(u32),
    Host(u32),
    Disk(u32),
}

#[derive(Clone, Debug, Default)]
pub(crate) struct DeviceBlock {
    pub(crate) refs: u32,
    pub(crate) cached: Option<CachedInfo>,
}

/// A sequence's block table: `blocks[i]` holds tokens `i*bs .. (i+1)*bs`; the first
/// `committed` are full and cached (or adopted from the cache).
#[derive(Clone, Debug, Default)]
pub(crate) struct SeqBlocks {
    pub(crate) blocks: Vec<u32>,
    pub(crate) committed: usize,
}

/// The block pool of one worker. See the module docs for its invariants.
#[derive(Debug)]
pub struct BlockPool {
    pub(crate) cfg: BlockPoolConfig,
    pub(crate) device: Vec<DeviceBlock>,
    pub(crate) device_free: Vec<u32>,
    pub(crate) device_lru: LruList,
    pub(crate) host: Vec<Option<CachedInfo>>,
    pub(crate) host_free: Vec<u32>,
    pub(crate) host_lru: LruList,
    pub(crate) disk: Vec<Option<CachedInfo>>,
    pub(crate) disk_free: Vec<u32>,
    pub(crate) disk_lru: LruList,
    pub(crate) disk_store: Option<Box<dyn DiskStore>>,
    pub(crate) cached: HashMap<SequenceHash, Location>,
    pub(crate) seqs: HashMap<RequestId, SeqBlocks>,
    /// Extra references on device blocks that a KV transfer may still write (see
    /// [`BlockPool::hold`]), with their counts.
    pub(crate) held: HashMap<u32, u32>,
    pub(crate) device_arena: KvArena,
    pub(crate) host_arena: KvArena,
    pub(crate) log: EventLog,
    pub(crate) stats: PoolStats,
}

/// Counters since the pool was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Device blocks evicted (moved to host or dropped).
    pub device_evictions: u64,
    /// Host blocks evicted (moved to disk or dropped).
    pub host_evictions: u64,
    /// Host blocks brought back to device by a prefix hit.
    pub host_promotions: u64,
    /// Disk blocks dropped, to make room or because they could not be written.
    pub disk_evictions: u64,
    /// Disk blocks brought back to device by a prefix hit.
    pub disk_promotions: u64,
    /// Disk blocks that did not read back intact (missing, corrupt): dropped, not used.
    pub disk_misses: u64,
    /// Blocks reused from the cache by `acquire_prefix`.
    pub prefix_hit_blocks: u64,
}

impl BlockPool {
    /// A pool whose device arena lives in `storage` (e.g. memory registered with a KV
    /// transport), of exactly `device_blocks × bytes_per_block` bytes.
    pub fn with_device_storage(
        cfg: BlockPoolConfig,
        storage: Box<dyn crate::arena::ArenaStorage>,
    ) -> Result<Self, PoolError> {
        let arena =
            KvArena::with_storage(storage, cfg.device_blocks as usize, cfg.bytes_per_block)?;
        let mut pool = BlockPool::new(cfg)?;
        pool.device_arena = arena;
        Ok(pool)
    }

    pub fn new(cfg: BlockPoolConfig) -> Result<Self, PoolError> {
        if cfg.device_blocks == 0 {
            return Err(PoolError::NoDeviceBlocks);
        }
        let d = cfg.device_blocks as usize;
        let h = cfg.host_blocks as usize;
        Ok(BlockPool {
            device: vec![DeviceBlock::default(); d],
            // Reversed so that block 0 is handed out first (stable, readable tests).
            device_free: (0..cfg.device_blocks).rev().collect(),
            device_lru: LruList::new(d),
            host: vec![None; h],
            host_free: (0..cfg.host_blocks).rev().collect(),
            host_lru: LruList::new(h),
            disk: Vec::new(),
            disk_free: Vec::new(),
            disk_lru: LruList::new(0),
            disk_store: None,
            cached: HashMap::new(),
            seqs: HashMap::new(),
            held: HashMap::new(),
            device_arena: KvArena::new(d, cfg.bytes_per_block),
            host_arena: KvArena::new(h, cfg.bytes_per_block),
            log: EventLog::new(cfg.worker_id, cfg.event_ring),
            stats: PoolStats::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &BlockPoolConfig {
        &self.cfg
    }

    pub fn worker_id(&self) -> WorkerId {
        self.cfg.worker_id
    }

    pub fn block_size(&self) -> BlockSize {
        self.cfg.block_size
    }

    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Total device blocks.
    pub fn device_capacity(&self) -> usize {
        self.device.len()
    }

    /// Device blocks referenced by sequences.
    pub fn active_blocks(&self) -> usize {
        self.device.len() - self.device_free.len() - self.device_lru.len()
    }

    /// Device blocks that an allocation can take now (free + cached unreferenced).
    pub fn available_blocks(&self) -> usize {
        self.device_free.len() + self.device_lru.len()
    }

    /// Number of cached blocks in a tier.
    pub fn cached_count(&self, tier: StorageTier) -> usize {
        match tier {
            StorageTier::Device => self.device.iter().filter(|b| b.cached.is_some()).count(),
            StorageTier::Host => self.host.len() - self.host_free.len(),
            StorageTier::Disk => self.disk.len() - self.disk_free.len(),
        }
    }

    /// Slots of a tier (0: the pool has no such tier).
    pub fn tier_capacity(&self, tier: StorageTier) -> usize {
        match tier {
            StorageTier::Device => self.device.len(),
            StorageTier::Host => self.host.len(),
            StorageTier::Disk => self.disk.len(),
        }
    }

    /// Cached block hashes of a tier (any order).
    pub fn cached_hashes(&self, tier: StorageTier) -> Vec<SequenceHash> {
        self.cached
            .iter()
            .filter(|(_, loc)| {
                matches!(
                    (tier, loc),
                    (StorageTier::Device, Location::Device(_))
                        | (StorageTier::Host, Location::Host(_))
                        | (StorageTier::Disk, Location::Disk(_))
                )
            })
            .map(|(h, _)| *h)
            .collect()
    }

    /// Where a block is cached, if it is.
    pub fn tier_of(&self, hash: SequenceHash) -> Option<StorageTier> {
        self.cached.get(&hash).map(|l| match l {
            Location::Device(_) => StorageTier::Device,
            Location::Host(_) => StorageTier::Host,
            Location::Disk(_) => StorageTier::Disk,
        })
    }

    /// How many leading blocks of `hashes` are cached, by tier. Device blocks come first:
    /// the device set is prefix-closed.
    pub fn lookup(&self, hashes: &[SequenceHash]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        for h in hashes {
            match self.cached.get(h) {
                Some(Location::Device(_)) => hit.device += 1,
                Some(Location::Host(_)) => hit.host += 1,
                Some(Location::Disk(_)) => hit.disk += 1,
                None => break,
            }
        }
        hit
    }

    /// The device block ids of a sequence, in token order.
    pub fn block_table(&self, seq: RequestId) -> Option<&[u32]> {
        self.seqs.get(&seq).map(|s| s.blocks.as_slice())
    }

    /// Full blocks of a sequence committed to the cache so far.
    pub fn committed_blocks(&self, seq: RequestId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.committed)
    }

    pub fn device_arena(&self) -> &KvArena {
        &self.device_arena
    }

    pub fn device_arena_mut(&mut self) -> &mut KvArena {
        &mut self.device_arena
    }

    pub fn host_arena(&self) -> &KvArena {
        &self.host_arena
    }

    /// Id of the latest event (0 before any).
    pub fn last_event_id(&self) -> u64 {
        self.log.last_id()
    }

    /// Events after `after`, or an error when the ring no longer has them all.
    pub fn events_since(&self, after: u64) -> Result<Vec<KvEvent>, EventsTooOld> {
        self.log.since(after)
    }

    /// The whole cache as `Stored` events (device, host, then disk, parents first within a
    /// tier), as of the latest event.
    pub fn dump(&self) -> KvDump {
        let worker_id = self.log.worker_id();
        let last_event_id = self.log.last_id();
        let mut device: Vec<CachedInfo> = self.device.iter().filter_map(|b| b.cached).collect();
        let mut host: Vec<CachedInfo> = self.host.iter().flatten().copied().collect();
        let mut disk: Vec<CachedInfo> = self.disk.iter().flatten().copied().collect();
        let mut events = Vec::with_capacity(device.len() + host.len() + disk.len());
        for (tier, infos) in [
            (StorageTier::Device, &mut device),
            (StorageTier::Host, &mut host),
            (StorageTier::Disk, &mut disk),
        ] {
            infos.sort_by_key(|i| (i.position, i.hash.sequence));
            events.extend(infos.iter().map(|i| KvEvent {
                worker_id,
                event_id: last_event_id,
                tier,
                kind: KvEventKind::Stored {
                    parent: i.parent,
                    blocks: vec![i.stored()],
                },
            }));
        }
        KvDump {
            worker_id,
            last_event_id,
            events,
        }
    }
}

/// Convenience for tests and the simulator: the hashes of a prompt's full blocks.
pub fn sequence_hashes(hashes: &[BlockHashes]) -> Vec<SequenceHash> {
    hashes.iter().map(|h| h.sequence).collect()
}

/// A `BlockHashes` from a bare u64, for tests and synthetic workloads that hash by position.
pub fn synthetic_hash(sequence: u64, local: u64) -> BlockHashes {
    BlockHashes {
        local: LocalBlockHash(local),
        sequence: SequenceHash(sequence),
    }
}
