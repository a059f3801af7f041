//! The disk tier's file (`--kv-disk-dir`): [`FileDiskStore`], the engine's
//! [`DiskStore`] over one file of fixed-size block records, read and written in place through
//! the page cache.
//!
//! A record is a 64-byte header then the block's bytes. The header names the block (its
//! sequence and local hashes, its parent and position), its length, the xxh3 of its bytes and
//! the xxh3 of the header itself. A read checks all of it against the block the pool expects,
//! so a torn write, a flipped bit or a record of another block is a miss, never wrong KV. A
//! cleared slot has its header zeroed. Beside the file, `kv-disk.json` names what the records
//! are KV of (the model, its KV shape, the block size): a directory left by another model
//! starts empty, since the same tokens hash alike whatever model computed them.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tandem_engine::{DiskBlock, DiskStore};
use tandem_protocol::{BlockHashes, LocalBlockHash, SequenceHash};
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: u32 = u32::from_le_bytes(*b"TKVB");
const VERSION: u32 = 1;
const HEADER: usize = 64;
const BLOCKS_FILE: &str = "kv-blocks.bin";
const META_FILE: &str = "kv-disk.json";

/// Where and how big a worker's disk tier is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvDiskConfig {
    pub dir: PathBuf,
    /// The file's size at most, bytes (headers included).
    pub bytes: u64,
}

/// The disk tier in a file (see the module docs).
#[derive(Debug)]
pub struct FileDiskStore {
    file: File,
    path: PathBuf,
    slots: u32,
    block_bytes: usize,
    recovered: Vec<(u32, DiskBlock)>,
    /// A record's worth of buffer, reused.
    record: Vec<u8>,
}

/// The meta file's content.
#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Meta {
    version: u32,
    /// What the records are KV of.
    fingerprint: String,
    block_bytes: usize,
}

impl FileDiskStore {
    /// Opens (or creates) the tier in `cfg.dir` for blocks of `block_bytes` of the KV named by
    /// `fingerprint`, as many slots as `cfg.bytes` holds. Records a previous run of the same
    /// fingerprint left are recovered ([`DiskStore::take_recovered`]); anything else there
    /// is discarded.
    pub fn open(cfg: &KvDiskConfig, fingerprint: &str, block_bytes: usize) -> io::Result<Self> {
        let record = HEADER + block_bytes;
        let slots = u32::try_from(cfg.bytes / record as u64).unwrap_or(u32::MAX);
        if slots == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "--kv-disk-mb holds no block: a block takes {record} bytes on disk, \
                     {} were given",
                    cfg.bytes
                ),
            ));
        }
        std::fs::create_dir_all(&cfg.dir)?;
        let meta = Meta {
            version: VERSION,
            fingerprint: fingerprint.to_string(),
            block_bytes,
        };
        let meta_path = cfg.dir.join(META_FILE);
        let same = std::fs::read(&meta_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Meta>(&b).ok())
            .is_some_and(|m| m == meta);
        let path = cfg.dir.join(BLOCKS_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(!same)
            .open(&path)?;
        if !same {
            tracing::info!(dir = %cfg.dir.display(), "KV disk tier: starting empty (new, or left by another model or block size)");
            // The meta goes out after the file is emptied: a crash between the two leaves
            // an empty file under the new meta, never old records under it.
            file.sync_all()?;
            std::fs::write(
                &meta_path,
                serde_json::to_vec(&meta).map_err(io::Error::other)?,
            )?;
        }
        file.set_len(u64::from(slots) * record as u64)?;
        let mut store = FileDiskStore {
            file,
            path,
            slots,
            block_bytes,
            recovered: Vec::new(),
            record: vec![0; record],
        };
        if same {
            store.recover()?;
        }
        Ok(store)
    }

    fn offset(&self, slot: u32) -> u64 {
        u64::from(slot) * (HEADER + self.block_bytes) as u64
    }

    /// Reads every slot's header: the blocks a previous run left.
    fn recover(&mut self) -> io::Result<()> {
        let mut header = [0u8; HEADER];
        for slot in 0..self.slots {
            self.file.read_exact_at(&mut header, self.offset(slot))?;
            if let Some((block, _)) = decode(&header, self.block_bytes) {
                self.recovered.push((slot, block));
            }
        }
        tracing::info!(
            file = %self.path.display(),
            blocks = self.recovered.len(),
            slots = self.slots,
            "KV disk tier: recovered"
        );
        Ok(())
    }

    fn failed(&self, op: &str, e: &io::Error) {
        tracing::warn!(file = %self.path.display(), error = %e, "KV disk tier: {op} failed; the block is not kept");
    }
}

/// The header of `block` with `bytes`.
fn encode(block: &DiskBlock, bytes: &[u8]) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&block.hash.sequence.0.to_le_bytes());
    h[16..24].copy_from_slice(&block.hash.local.0.to_le_bytes());
    h[24..32].copy_from_slice(&block.parent.map_or(0, |p| p.0).to_le_bytes());
    h[32..36].copy_from_slice(&u32::from(block.parent.is_some()).to_le_bytes());
    h[36..40].copy_from_slice(&block.position.to_le_bytes());
    h[40..48].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    h[48..56].copy_from_slice(&xxh3_64(bytes).to_le_bytes());
    let sum = xxh3_64(&h[..56]);
    h[56..64].copy_from_slice(&sum.to_le_bytes());
    h
}

/// The block a header names and its bytes' checksum, if it is an intact header of a record
/// of `block_bytes`.
fn decode(h: &[u8; HEADER], block_bytes: usize) -> Option<(DiskBlock, u64)> {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    if u32_at(0) != MAGIC || u32_at(4) != VERSION || u64_at(56) != xxh3_64(&h[..56]) {
        return None;
    }
    if u64_at(40) != block_bytes as u64 {
        return None;
    }
    let parent = (u32_at(32) == 1).then(|| SequenceHash(u64_at(24)));
    let block = DiskBlock {
        hash: BlockHashes {
            sequence: SequenceHash(u64_at(8)),
            local: LocalBlockHash(u64_at(16)),
        },
        parent,
        position: u32_at(36),
    };
    Some((block, u64_at(48)))
}

impl DiskStore for FileDiskStore {
    fn slots(&self) -> u32 {
        self.slots
    }

    fn write(&mut self, slot: u32, block: &DiskBlock, bytes: &[u8]) -> bool {
        if bytes.len() != self.block_bytes || slot >= self.slots {
            return false;
        }
        self.record[..HEADER].copy_from_slice(&encode(block, bytes));
        self.record[HEADER..].copy_from_slice(bytes);
        let at = self.offset(slot);
        match self.file.write_all_at(&self.record, at) {
            Ok(()) => true,
            Err(e) => {
                self.failed("write", &e);
                false
            }
        }
    }

    fn read(&mut self, slot: u32, block: &DiskBlock, out: &mut [u8]) -> bool {
        if out.len() != self.block_bytes || slot >= self.slots {
            return false;
        }
        let at = self.offset(slot);
        if let Err(e) = self.file.read_exact_at(&mut self.record, at) {
            self.failed("read", &e);
            return false;
        }
        let header: &[u8; HEADER] = self.record[..HEADER].try_into().expect("a header");
        match decode(header, self.block_bytes) {
            Some((b, sum)) if b == *block && xxh3_64(&self.record[HEADER..]) == sum => {
                out.copy_from_slice(&self.record[HEADER..]);
                true
            }
            _ => false,
        }
    }

    fn clear(&mut self, slot: u32) {
        if slot < self.slots
            && let Err(e) = self.file.write_all_at(&[0u8; HEADER], self.offset(slot))
        {
            self.failed("clear", &e);
        }
    }

    fn take_recovered(&mut self) -> Vec<(u32, DiskBlock)> {
        std::mem::take(&mut self.recovered)
    }
}

/// The fingerprint of a worker's KV: what its disk records are KV of.
pub fn fingerprint(model: &str, shape: &tandem_engine::KvShape, block_tokens: usize) -> String {
    format!(
        "model={model} layers={} kv_heads={} head_dim={} dtype_bytes={} block_tokens={block_tokens}",
        shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
    )
}

/// The directory's blocks file (for tests that damage it).
pub fn blocks_file(dir: &Path) -> PathBuf {
    dir.join(BLOCKS_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(seq: u64, parent: Option<u64>, position: u32) -> DiskBlock {
        DiskBlock {
            hash: BlockHashes {
                sequence: SequenceHash(seq),
                local: LocalBlockHash(seq ^ 7),
            },
            parent: parent.map(SequenceHash),
            position,
        }
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-disk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn blocks_read_back_only_intact_and_as_themselves_and_survive_a_reopen() {
        let d = dir("roundtrip");
        let cfg = KvDiskConfig {
            dir: d.clone(),
            bytes: 4 * (HEADER as u64 + 32),
        };
        let mut s = FileDiskStore::open(&cfg, "m", 32).unwrap();
        assert_eq!(s.slots(), 4);
        assert!(s.take_recovered().is_empty());
        let (a, b) = (block(1, None, 0), block(2, Some(1), 1));
        assert!(s.write(0, &a, &[1; 32]));
        assert!(s.write(3, &b, &[2; 32]));
        let mut out = [0u8; 32];
        assert!(s.read(0, &a, &mut out));
        assert_eq!(out, [1; 32]);
        assert!(!s.read(0, &b, &mut out), "another block's record is a miss");
        assert!(!s.read(1, &a, &mut out), "an empty slot is a miss");
        drop(s);
        // A flipped byte in a's bytes: a miss; b is intact.
        let file = OpenOptions::new()
            .write(true)
            .open(blocks_file(&d))
            .unwrap();
        file.write_all_at(&[9], HEADER as u64 + 5).unwrap();
        drop(file);
        let mut s = FileDiskStore::open(&cfg, "m", 32).unwrap();
        let mut recovered = s.take_recovered();
        recovered.sort_by_key(|(slot, _)| *slot);
        assert_eq!(recovered, vec![(0, a), (3, b)]);
        assert!(!s.read(0, &a, &mut out), "corrupt bytes are a miss");
        assert!(s.read(3, &b, &mut out));
        s.clear(3);
        drop(s);
        let mut s = FileDiskStore::open(&cfg, "m", 32).unwrap();
        assert_eq!(
            s.take_recovered(),
            vec![(0, a)],
            "a cleared slot stays cleared"
        );
        drop(s);
        // Another model's KV in the directory: it starts empty.
        let mut s = FileDiskStore::open(&cfg, "another model", 32).unwrap();
        assert!(s.take_recovered().is_empty());
        assert!(!s.read(0, &a, &mut out));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_budget_below_one_block_is_a_clear_error() {
        let d = dir("small");
        let cfg = KvDiskConfig {
            dir: d.clone(),
            bytes: 10,
        };
        let e = FileDiskStore::open(&cfg, "m", 32).unwrap_err();
        assert!(e.to_string().contains("--kv-disk-mb holds no block"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
