//! The engine's device arena in a KV-transfer [`Region`]: the memory a decode worker exposes
//! on its transport (so prefill workers write received KV straight into the blocks the engine
//! reads), and the memory a worker keeps in GPU memory (`--kv-memory cuda`).
//!
//! Every access the engine makes holds the block's lock in the region, so the transport's
//! own writers (the TCP receiver, the in-process transport) never overlap it; writes that
//! arrive over UCX go to blocks the engine does not touch until their transfer is fenced
//! (see `tandem-decode-worker`'s remote prefill).

use std::sync::Arc;

use tandem_engine::{ArenaStorage, DeviceMemory};
use tandem_kv_transfer::{MemoryKind, Region, TransferError};

use crate::digest::KvDigest;

/// Where a worker's KV arena lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvMemory {
    /// Page-aligned host memory (from the transport when there is one).
    #[default]
    Host,
    /// CUDA device memory on this device (feature `cuda`; the driver is checked at start).
    Cuda { ordinal: usize },
}

impl std::str::FromStr for KvMemory {
    type Err = String;

    /// `host`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(KvMemory::Host),
            "cuda" => Ok(KvMemory::Cuda { ordinal: 0 }),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| KvMemory::Cuda { ordinal })
                .ok_or_else(|| format!("`{s}`: expected host, cuda or cuda:N")),
        }
    }
}

/// An engine arena over a region. Host regions are accessed in place under the block lock;
/// device regions through a one-block staging buffer.
#[derive(Debug)]
pub struct RegionStorage {
    region: Arc<Region>,
    /// One block of host memory for device regions (reused by every access).
    staging: parking_lot::Mutex<Vec<u8>>,
}

impl RegionStorage {
    pub fn new(region: Arc<Region>) -> Self {
        let staging = match region.memory_kind() {
            MemoryKind::Host => Vec::new(),
            MemoryKind::Cuda => vec![0; region.bytes_per_block()],
        };
        RegionStorage {
            region,
            staging: parking_lot::Mutex::new(staging),
        }
    }

    fn block_of(&self, offset: usize, len: usize) -> u32 {
        debug_assert_eq!(len, self.region.bytes_per_block());
        debug_assert_eq!(offset % len.max(1), 0);
        (offset / self.region.bytes_per_block()) as u32
    }
}

/// A device copy failed: the GPU is unusable (an Xid, ECC or driver fault), and so is this
/// worker, whose KV lives there. It exits, like an engine on a failed GPU; its lease lapses and
/// the frontend moves its streams elsewhere.
#[cold]
fn device_failed(op: &str, e: &TransferError) -> ! {
    tracing::error!(error = %e, "KV arena {op} in GPU memory failed: the worker cannot continue");
    std::process::exit(70)
}

impl ArenaStorage for RegionStorage {
    fn len(&self) -> usize {
        self.region.len_bytes()
    }

    fn device(&self) -> Option<DeviceMemory> {
        let (ordinal, base) = self.region.cuda_memory()?;
        Some(DeviceMemory {
            ordinal,
            base,
            len: self.region.len_bytes(),
        })
    }

    fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        let block = self.block_of(offset, len);
        match self.region.memory_kind() {
            MemoryKind::Host => {
                let guard = self
                    .region
                    .read_lock_block(block)
                    .expect("arena blocks are within the region (checked by the arena)");
                f(&guard);
            }
            MemoryKind::Cuda => {
                let mut staging = self.staging.lock();
                if let Err(e) = self.region.read_block_into(block, &mut staging) {
                    device_failed("read", &e);
                }
                f(&staging);
            }
        }
    }

    fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]])) {
        match self.region.memory_kind() {
            MemoryKind::Host => {
                // Shared locks on all of them at once: a writer takes one block at a time
                // (the region's protocol), so holding several cannot deadlock with one.
                let guards: Vec<_> = offsets
                    .iter()
                    .map(|&o| {
                        self.region
                            .read_lock_block(self.block_of(o, len))
                            .expect("arena blocks are within the region (checked by the arena)")
                    })
                    .collect();
                let blocks: Vec<&[u8]> = guards.iter().map(|g| &**g).collect();
                f(&blocks);
            }
            MemoryKind::Cuda => {
                let mut copies = Vec::with_capacity(offsets.len());
                for &o in offsets {
                    let mut staging = vec![0u8; len];
                    if let Err(e) = self
                        .region
                        .read_block_into(self.block_of(o, len), &mut staging)
                    {
                        device_failed("read", &e);
                    }
                    copies.push(staging);
                }
                let blocks: Vec<&[u8]> = copies.iter().map(Vec::as_slice).collect();
                f(&blocks);
            }
        }
    }

    fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        let block = self.block_of(offset, len);
        match self.region.memory_kind() {
            MemoryKind::Host => {
                let mut guard = self
                    .region
                    .lock_block(block)
                    .expect("arena blocks are within the region (checked by the arena)");
                f(&mut guard);
            }
            MemoryKind::Cuda => {
                let staging = self.staging.get_mut();
                if let Err(e) = self.region.read_block_into(block, staging) {
                    device_failed("read", &e);
                }
                f(staging);
                if let Err(e) = self.region.write_block(block, staging) {
                    device_failed("write", &e);
                }
            }
        }
    }
}

/// The digest of `blocks` of `region`, in order, read in place (host) or through one
/// block-sized buffer (device).
pub fn region_digest(region: &Region, blocks: &[u32]) -> Result<KvDigest, TransferError> {
    let mut digest = KvDigest::default();
    digest_blocks(region, blocks, &mut digest)?;
    Ok(digest)
}

/// Folds `blocks` of `region`, in order, into `digest` (a transfer checked as it lands).
pub fn digest_blocks(
    region: &Region,
    blocks: &[u32],
    digest: &mut KvDigest,
) -> Result<(), TransferError> {
    for &b in blocks {
        digest_block(region, b, digest)?;
    }
    Ok(())
}

/// Folds block `block` of `region` into `digest`, read in place (host) or through a
/// block-sized buffer (device).
pub fn digest_block(
    region: &Region,
    block: u32,
    digest: &mut KvDigest,
) -> Result<(), TransferError> {
    match region.memory_kind() {
        MemoryKind::Host => digest.update(&region.read_lock_block(block)?),
        MemoryKind::Cuda => digest.update(&region.read_block(block)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_memory_parses() {
        assert_eq!("host".parse::<KvMemory>(), Ok(KvMemory::Host));
        assert_eq!(
            "cuda".parse::<KvMemory>(),
            Ok(KvMemory::Cuda { ordinal: 0 })
        );
        assert_eq!(
            "cuda:3".parse::<KvMemory>(),
            Ok(KvMemory::Cuda { ordinal: 3 })
        );
        for bad in ["", "gpu", "cuda:", "cuda:x", "cuda:-1"] {
            assert!(bad.parse::<KvMemory>().is_err(), "{bad}");
        }
    }

    #[test]
    fn an_engine_arena_in_a_region_reads_and_writes_blocks_in_place() {
        let region = Region::host(4, 8).unwrap();
        let mut storage = RegionStorage::new(region.clone());
        assert_eq!(storage.len(), 32);
        storage.write(16, 8, &mut |b| b.copy_from_slice(&[7; 8]));
        assert_eq!(region.read_block(2).unwrap(), vec![7; 8]);
        region.write_block(3, &[9; 8]).unwrap();
        let mut seen = Vec::new();
        storage.read(24, 8, &mut |b| seen.extend_from_slice(b));
        assert_eq!(seen, vec![9; 8]);

        let mut expected = KvDigest::default();
        expected.update(&[9; 8]);
        expected.update(&[7; 8]);
        let got = region_digest(&region, &[3, 2]).unwrap();
        assert_eq!((got.value(), got.blocks()), (expected.value(), 2));
        assert!(region_digest(&region, &[4]).is_err(), "past the region");
    }

    #[test]
    fn many_blocks_read_at_once_keep_a_writer_out_until_the_reader_is_done() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let region = Region::host(4, 8).unwrap();
        region.write_block(1, &[1; 8]).unwrap();
        region.write_block(3, &[3; 8]).unwrap();
        let storage = RegionStorage::new(region.clone());
        let (started, released) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|scope| {
            storage.read_many(&[24, 8, 24], 8, &mut |blocks| {
                assert_eq!(blocks, [&[3u8; 8][..], &[1; 8], &[3; 8]]);
                // A writer to one of the blocks, which must finish only after the reader
                // has let go of them all.
                scope.spawn(|| {
                    started.store(true, SeqCst);
                    region.write_block(1, &[5; 8]).unwrap();
                    assert!(released.load(SeqCst), "the write went through a read lock");
                });
                while !started.load(SeqCst) {
                    std::thread::yield_now();
                }
                // The writer is at the lock (or about to be): give it every chance to pass.
                for _ in 0..1000 {
                    std::thread::yield_now();
                }
                assert_eq!(blocks[1], &[1; 8]);
                released.store(true, SeqCst);
            });
        });
        assert_eq!(region.read_block(1).unwrap(), vec![5; 8]);
    }
}
