//! Identifiers shared by every crate.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A worker's identity, unique in a namespace for the life of its registration.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct WorkerId(pub u64);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A request's identity, unique per frontend for the life of the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{:x}", self.0)
    }
}

/// A LoRA adapter, by name: xxh3-64 of the name, for routing tables that hold many.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AdapterId(pub u64);

impl AdapterId {
    pub fn of(name: &str) -> AdapterId {
        AdapterId(xxhash_rust::xxh3::xxh3_64(name.as_bytes()))
    }
}

/// xxh3-64 of one full block's token ids: names the block's content, not its position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalBlockHash(pub u64);

/// Chained hash naming a whole prefix up to and including one block. The index is keyed by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SequenceHash(pub u64);

/// Where a cached KV block lives. Ordered from fastest to slowest: a prefix walk over a worker
/// that keeps its tiers prefix-closed meets Device blocks first, then Host, then Disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum StorageTier {
    Device,
    Host,
    Disk,
}

impl StorageTier {
    /// All tiers, fastest first.
    pub const ALL: [StorageTier; 3] = [StorageTier::Device, StorageTier::Host, StorageTier::Disk];

    /// Dense index (0 = Device, 1 = Host, 2 = Disk) for per-tier arrays.
    pub const fn index(self) -> usize {
        match self {
            StorageTier::Device => 0,
            StorageTier::Host => 1,
            StorageTier::Disk => 2,
        }
    }

    /// Inverse of [`StorageTier::index`].
    pub const fn from_index(i: usize) -> Option<StorageTier> {
        match i {
            0 => Some(StorageTier::Device),
            1 => Some(StorageTier::Host),
            2 => Some(StorageTier::Disk),
            _ => None,
        }
    }
}

impl fmt::Display for StorageTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StorageTier::Device => "device",
            StorageTier::Host => "host",
            StorageTier::Disk => "disk",
        })
    }
}
