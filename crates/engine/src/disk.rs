//! The disk tier's storage: the third tier of a block pool (after device and host memory),
//! behind a trait so the pool stays free of I/O. The workers' store is a file of checksummed
//! block records (`tandem-worker`'s `FileDiskStore`); [`MemoryDiskStore`] is its in-memory twin
//! for tests and the simulator.
//!
//! A store never hands back wrong KV: a read names the block it expects, and a record that is
//! missing, torn, corrupt or of another block is a miss, which the pool turns into "not
//! cached" (the request computes the block instead).

use tandem_protocol::{BlockHashes, SequenceHash};

/// A block on disk and what it is: what a restarted worker needs to put it back into its pool
/// and announce it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DiskBlock {
    pub hash: BlockHashes,
    pub parent: Option<SequenceHash>,
    /// The block's position in its sequence (0: the first).
    pub position: u32,
}

/// Slots of one KV block each, on some medium.
pub trait DiskStore: Send + std::fmt::Debug {
    /// How many blocks the store holds at most.
    fn slots(&self) -> u32;

    /// Keeps `bytes` (one block) as `block` in `slot`; false when it could not (a full or
    /// failing disk): the pool then holds nothing there.
    fn write(&mut self, slot: u32, block: &DiskBlock, bytes: &[u8]) -> bool;

    /// Fills `out` with slot `slot`'s bytes when it holds `block` intact (the identity and the
    /// checksum it was written with); false is a miss.
    fn read(&mut self, slot: u32, block: &DiskBlock, out: &mut [u8]) -> bool;

    /// Slot `slot` holds nothing any more, across a restart too.
    fn clear(&mut self, slot: u32);

    /// The blocks the store held when it was opened (a restarted worker's cache), by slot;
    /// empty after the first call.
    fn take_recovered(&mut self) -> Vec<(u32, DiskBlock)>;
}

/// A [`DiskStore`] in memory, checksummed like the file store, with corruption on demand.
#[derive(Debug, Default)]
pub struct MemoryDiskStore {
    slots: Vec<Option<(DiskBlock, Vec<u8>, u64)>>,
    recovered: Vec<(u32, DiskBlock)>,
}

impl MemoryDiskStore {
    pub fn new(slots: u32) -> Self {
        MemoryDiskStore {
            slots: vec![None; slots as usize],
            recovered: Vec::new(),
        }
    }

    /// A store holding what `other` holds, as a restarted worker finds its disk.
    pub fn reopened(other: &MemoryDiskStore) -> Self {
        let recovered = other
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|(b, _, _)| (i as u32, *b)))
            .collect();
        MemoryDiskStore {
            slots: other.slots.clone(),
            recovered,
        }
    }

    /// Flips one byte of slot `slot`'s bytes (a bad sector, a torn write).
    pub fn corrupt(&mut self, slot: u32) {
        if let Some((_, bytes, _)) = &mut self.slots[slot as usize]
            && let Some(b) = bytes.first_mut()
        {
            *b ^= 0x5a;
        }
    }

    /// Loses slot `slot` (a deleted record).
    pub fn lose(&mut self, slot: u32) {
        self.slots[slot as usize] = None;
    }

    /// Slots holding a block.
    pub fn filled(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

impl DiskStore for MemoryDiskStore {
    fn slots(&self) -> u32 {
        self.slots.len() as u32
    }

    fn write(&mut self, slot: u32, block: &DiskBlock, bytes: &[u8]) -> bool {
        self.slots[slot as usize] = Some((*block, bytes.to_vec(), checksum(bytes)));
        true
    }

    fn read(&mut self, slot: u32, block: &DiskBlock, out: &mut [u8]) -> bool {
        match &self.slots[slot as usize] {
            Some((b, bytes, sum))
                if b == block && bytes.len() == out.len() && checksum(bytes) == *sum =>
            {
                out.copy_from_slice(bytes);
                true
            }
            _ => false,
        }
    }

    fn clear(&mut self, slot: u32) {
        self.slots[slot as usize] = None;
    }

    fn take_recovered(&mut self) -> Vec<(u32, DiskBlock)> {
        std::mem::take(&mut self.recovered)
    }
}
