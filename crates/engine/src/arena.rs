//! KV arenas: per memory tier one contiguous byte region, block-major, so that one block is
//! one contiguous range (what the transfer layer registers once and moves with one put).

/// The shape of a model's KV cache, from which the size of a block follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16).
    pub dtype_bytes: u32,
}

impl KvShape {
    /// A small shape for the mocker: 4 layers × 2 KV heads × 16 dims × 2 bytes, K and V:
    /// 512 bytes per token, 8 KiB per 16-token block. Big enough to exercise transfer paths,
    /// small enough for many workers on a laptop.
    pub const MOCKER_DEFAULT: KvShape = KvShape {
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 16,
        dtype_bytes: 2,
    };

    /// No bytes at all: timing-only simulation (`tandem sim` with thousands of workers).
    pub const TIMING_ONLY: KvShape = KvShape {
        num_layers: 0,
        num_kv_heads: 0,
        head_dim: 0,
        dtype_bytes: 0,
    };

    /// Bytes of K and V for one token in one layer.
    pub const fn bytes_per_token_layer(&self) -> usize {
        2 * self.num_kv_heads as usize * self.head_dim as usize * self.dtype_bytes as usize
    }

    /// Bytes of one token across all layers.
    pub const fn bytes_per_token(&self) -> usize {
        self.bytes_per_token_layer() * self.num_layers as usize
    }

    /// Bytes of one block of `block_size` tokens. Layout inside a block: layer-major, then
    /// token, then K and V heads (`[layer][token][kv][head][dim]`).
    pub const fn bytes_per_block(&self, block_size: usize) -> usize {
        self.bytes_per_token() * block_size
    }
}

/// The memory behind a KV arena: heap bytes by default, or a region a KV transport has
/// registered so that peers write blocks straight into it (the decode worker's side of a
/// remote prefill), possibly in GPU memory. Access is per block and scoped: the storage may
/// lock the block for the duration of the call (a transport writing other blocks of the same
/// region concurrently never overlaps it), or stage device memory through a host buffer.
/// Its size is fixed for its life. Reads may come from several threads at once (an engine's
/// attention reads blocks in parallel), writes only through `&mut`.
pub trait ArenaStorage: Send + Sync {
    /// Total bytes.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls `f` with the `len` bytes at `offset` (one whole block).
    fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8]));

    /// Calls `f` with the `len` bytes at `offset` (one whole block), writable; what `f`
    /// leaves there is the block's new content.
    fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8]));

    /// Calls `f` once with the `len` bytes at each of `offsets` (whole blocks), in order,
    /// all readable at once: what a forward pass reads for a layer's attention, taken once
    /// rather than block by block from every thread (a storage with locks takes each once).
    fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]]));

    /// Where the bytes live when they are GPU memory: a model computing on that device
    /// reads and writes blocks there in place, through its own kernels. None: host memory,
    /// reached only through the calls above.
    fn device(&self) -> Option<DeviceMemory> {
        None
    }
}

/// An arena's bytes in GPU memory: `len` bytes from device address `base` on CUDA device
/// `ordinal`, blocks at `base + block × bytes_per_block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub ordinal: usize,
    pub base: u64,
    pub len: usize,
}

impl ArenaStorage for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        f(&self[offset..offset + len]);
    }

    fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        f(&mut self[offset..offset + len]);
    }

    fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]])) {
        let blocks: Vec<&[u8]> = offsets.iter().map(|&o| &self[o..o + len]).collect();
        f(&blocks);
    }
}

/// Heap bytes starting on a page boundary. Large `Vec`s start 16 bytes past a page (the
/// allocator's header), and copies of KV-block-sized chunks at such an offset run several
/// times slower on some CPUs (crates/kv-transfer/BENCHMARKS.md, "Buffer alignment"); the
/// arena over-allocates by a page and starts at the first page boundary instead.
struct PageAligned {
    buf: Vec<u8>,
    offset: usize,
    len: usize,
}

use xxhash_rust::xxh3::xxh3_64_with_seed;

const PAGE: usize = 4096;

impl PageAligned {
    fn zeroed(len: usize) -> Self {
        if len == 0 {
            return PageAligned {
                buf: Vec::new(),
                offset: 0,
                len: 0,
            };
        }
        let buf = vec![0u8; len + PAGE];
        let offset = buf.as_ptr().align_offset(PAGE).min(PAGE);
        PageAligned { buf, offset, len }
    }
}

impl ArenaStorage for PageAligned {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        debug_assert!(offset + len <= self.len);
        let start = self.offset + offset;
        f(&self.buf[start..start + len]);
    }

    fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        debug_assert!(offset + len <= self.len);
        let start = self.offset + offset;
        f(&mut self.buf[start..start + len]);
    }

    fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]])) {
        let blocks: Vec<&[u8]> = offsets
            .iter()
            .map(|&o| {
                debug_assert!(o + len <= self.len);
                &self.buf[self.offset + o..self.offset + o + len]
            })
            .collect();
        f(&blocks);
    }
}

/// One tier's KV memory: `num_blocks × bytes_per_block` contiguous bytes.
pub struct KvArena {
    bytes_per_block: usize,
    num_blocks: usize,
    data: Box<dyn ArenaStorage>,
    /// [`read_back_hash`](Self::read_back_hash)'s memo: per block, the seed and hash last
    /// read, dropped when the block is written or handed out for new content ([`forget`]).
    /// Empty until first used.
    ///
    /// [`forget`]: Self::forget
    read_back: Vec<Option<(u64, u64)>>,
}

impl std::fmt::Debug for KvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvArena")
            .field("bytes_per_block", &self.bytes_per_block)
            .field("num_blocks", &self.num_blocks)
            .finish()
    }
}

impl KvArena {
    /// Zeroed, page-aligned arena. With `bytes_per_block == 0` it holds nothing and costs
    /// nothing.
    pub fn new(num_blocks: usize, bytes_per_block: usize) -> Self {
        KvArena {
            bytes_per_block,
            num_blocks,
            data: Box::new(PageAligned::zeroed(num_blocks * bytes_per_block)),
            read_back: Vec::new(),
        }
    }

    /// An arena over `storage`, which must be exactly `num_blocks × bytes_per_block` bytes.
    pub fn with_storage(
        storage: Box<dyn ArenaStorage>,
        num_blocks: usize,
        bytes_per_block: usize,
    ) -> Result<Self, ArenaSizeMismatch> {
        let expected = num_blocks * bytes_per_block;
        let got = storage.len();
        if got != expected {
            return Err(ArenaSizeMismatch { expected, got });
        }
        Ok(KvArena {
            bytes_per_block,
            num_blocks,
            data: storage,
            read_back: Vec::new(),
        })
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Total bytes.
    pub fn len_bytes(&self) -> usize {
        self.data.len()
    }

    /// Byte offset of a block in the region.
    pub fn offset_of(&self, block: u32) -> usize {
        block as usize * self.bytes_per_block
    }

    /// Runs `f` over the bytes of `block` (empty when the arena holds no bytes).
    ///
    /// # Panics
    /// When `block` is past the arena (a pool bookkeeping bug).
    pub fn with_block<R>(&self, block: u32, f: impl FnOnce(&[u8]) -> R) -> R {
        if self.bytes_per_block == 0 {
            return f(&[]);
        }
        assert!(
            (block as usize) < self.num_blocks,
            "block {block} past the arena"
        );
        let mut f = Some(f);
        let mut out = None;
        self.data
            .read(self.offset_of(block), self.bytes_per_block, &mut |b| {
                if let Some(f) = f.take() {
                    out = Some(f(b));
                }
            });
        out.expect("arena storage calls back exactly once")
    }

    /// Runs `f` over the bytes of every block of `blocks`, in that order, all at once (see
    /// [`with_block`](Self::with_block); empty slices when the arena holds no bytes).
    ///
    /// # Panics
    /// When a block is past the arena (a pool bookkeeping bug).
    pub fn with_blocks<R>(&self, blocks: &[u32], f: impl FnOnce(&[&[u8]]) -> R) -> R {
        if self.bytes_per_block == 0 {
            let empty: Vec<&[u8]> = vec![&[]; blocks.len()];
            return f(&empty);
        }
        let offsets: Vec<usize> = blocks
            .iter()
            .map(|&block| {
                assert!(
                    (block as usize) < self.num_blocks,
                    "block {block} past the arena"
                );
                self.offset_of(block)
            })
            .collect();
        let mut f = Some(f);
        let mut out = None;
        self.data
            .read_many(&offsets, self.bytes_per_block, &mut |b| {
                if let Some(f) = f.take() {
                    out = Some(f(b));
                }
            });
        out.expect("arena storage calls back exactly once")
    }

    /// Runs `f` over the bytes of `block`, writable (see [`with_block`](Self::with_block)).
    pub fn with_block_mut<R>(&mut self, block: u32, f: impl FnOnce(&mut [u8]) -> R) -> R {
        if self.bytes_per_block == 0 {
            return f(&mut []);
        }
        assert!(
            (block as usize) < self.num_blocks,
            "block {block} past the arena"
        );
        self.forget(block);
        let mut f = Some(f);
        let mut out = None;
        let offset = self.offset_of(block);
        self.data.write(offset, self.bytes_per_block, &mut |b| {
            if let Some(f) = f.take() {
                out = Some(f(b));
            }
        });
        out.expect("arena storage calls back exactly once")
    }

    /// `xxh3_64` of `block`'s bytes with `seed`, read from the storage the first time it is
    /// asked after the block was last written ([`with_block_mut`](Self::with_block_mut)) or
    /// handed out for new content ([`forget`](Self::forget)); a block read again with the
    /// same seed and unchanged bytes is not read again. A block written behind the arena's
    /// back (a KV transfer into its region) must be [`forget`](Self::forget)-ed first: the
    /// pool does so for every block it hands out.
    pub fn read_back_hash(&mut self, block: u32, seed: u64) -> u64 {
        if self.bytes_per_block == 0 {
            return xxh3_64_with_seed(&[], seed);
        }
        if self.read_back.is_empty() {
            self.read_back = vec![None; self.num_blocks];
        }
        if let Some((s, hash)) = self.read_back[block as usize]
            && s == seed
        {
            return hash;
        }
        let hash = self.with_block(block, |b| xxh3_64_with_seed(b, seed));
        self.read_back[block as usize] = Some((seed, hash));
        hash
    }

    /// Drops what [`read_back_hash`](Self::read_back_hash) remembers of `block`: its bytes
    /// are about to change.
    pub fn forget(&mut self, block: u32) {
        if let Some(m) = self.read_back.get_mut(block as usize) {
            *m = None;
        }
    }

    /// The arena's GPU memory, when its storage is on a device (see
    /// [`ArenaStorage::device`]).
    pub fn device(&self) -> Option<DeviceMemory> {
        self.data.device()
    }

    /// A copy of the bytes of `block`.
    pub fn block_bytes(&self, block: u32) -> Vec<u8> {
        self.with_block(block, <[u8]>::to_vec)
    }

    /// Overwrites `block` with `bytes` (exactly one block long).
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) {
        self.with_block_mut(block, |dst| dst.copy_from_slice(bytes));
    }
}

/// Storage of the wrong size for an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("arena storage holds {got} bytes, the arena needs {expected}")]
pub struct ArenaSizeMismatch {
    pub expected: usize,
    pub got: usize,
}

/// Copies one block between two arenas of equal block size (device ↔ host moves).
pub(crate) fn copy_block(from: &KvArena, from_block: u32, to: &mut KvArena, to_block: u32) {
    debug_assert_eq!(from.bytes_per_block, to.bytes_per_block);
    if from.bytes_per_block == 0 {
        return;
    }
    from.with_block(from_block, |src| to.write_block(to_block, src));
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn shape_sizes() {
        assert_eq!(KvShape::MOCKER_DEFAULT.bytes_per_token(), 512);
        assert_eq!(KvShape::MOCKER_DEFAULT.bytes_per_block(16), 8192);
        assert_eq!(KvShape::TIMING_ONLY.bytes_per_block(16), 0);
    }

    #[test]
    fn blocks_are_contiguous_and_disjoint() {
        let mut a = KvArena::new(3, 4);
        a.write_block(1, &[1, 2, 3, 4]);
        let all: Vec<u8> = (0..3).flat_map(|b| a.block_bytes(b)).collect();
        assert_eq!(all, &[0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        let mut b = KvArena::new(2, 4);
        copy_block(&a, 1, &mut b, 0);
        assert_eq!(b.block_bytes(0), &[1, 2, 3, 4]);
        let empty = KvArena::new(1000, 0);
        assert_eq!(empty.len_bytes(), 0);
        let first = a.with_block(0, |b| b.as_ptr() as usize);
        assert_eq!(first % PAGE, 0, "page-aligned");
        assert!(empty.block_bytes(999).is_empty());
        // Several blocks at once, in the order asked, a block twice if asked twice.
        let got = a.with_blocks(&[1, 0, 1], |bs| {
            bs.iter().map(|b| b.to_vec()).collect::<Vec<_>>()
        });
        assert_eq!(got, [vec![1, 2, 3, 4], vec![0; 4], vec![1, 2, 3, 4]]);
        assert_eq!(empty.with_blocks(&[3, 4], |bs| bs.len()), 2);
    }

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};

    /// Bytes shared with a writer outside the arena (as a KV transfer writes into a region),
    /// counting the arena's reads.
    pub(crate) struct Shared {
        pub(crate) bytes: Arc<Vec<AtomicU8>>,
        pub(crate) reads: Arc<AtomicUsize>,
    }

    impl Shared {
        /// `len` zero bytes; the bytes and the read count stay reachable from the clones.
        pub(crate) fn new(len: usize) -> Shared {
            Shared {
                bytes: Arc::new((0..len).map(|_| AtomicU8::new(0)).collect()),
                reads: Arc::new(AtomicUsize::new(0)),
            }
        }

        fn copy(&self, offset: usize, len: usize) -> Vec<u8> {
            self.bytes[offset..offset + len]
                .iter()
                .map(|b| b.load(Relaxed))
                .collect()
        }
    }

    impl ArenaStorage for Shared {
        fn len(&self) -> usize {
            self.bytes.len()
        }
        fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
            self.reads.fetch_add(1, Relaxed);
            f(&self.copy(offset, len));
        }
        fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
            let mut b = self.copy(offset, len);
            f(&mut b);
            for (dst, v) in self.bytes[offset..].iter().zip(b) {
                dst.store(v, Relaxed);
            }
        }
        fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]])) {
            let all: Vec<Vec<u8>> = offsets.iter().map(|&o| self.copy(o, len)).collect();
            f(&all.iter().map(Vec::as_slice).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_read_back_hash_is_read_once_per_write() {
        let storage = Shared::new(8);
        let (bytes, reads) = (storage.bytes.clone(), storage.reads.clone());
        let mut a = KvArena::with_storage(Box::new(storage), 2, 4).unwrap();
        let reads = || reads.load(Relaxed);
        let zero = a.read_back_hash(1, 7);
        assert_eq!(zero, xxh3_64_with_seed(&[0; 4], 7));
        assert_eq!((a.read_back_hash(1, 7), reads()), (zero, 1), "remembered");
        assert_ne!(a.read_back_hash(1, 8), zero, "another seed is read anew");
        assert_eq!(reads(), 2);
        // Written through the arena: read again.
        a.write_block(1, &[1, 2, 3, 4]);
        assert_eq!(a.read_back_hash(1, 7), xxh3_64_with_seed(&[1, 2, 3, 4], 7));
        assert_eq!(reads(), 3);
        // Written behind its back: remembered until forgotten.
        bytes[4..].iter().for_each(|b| b.store(9, Relaxed));
        assert_eq!(a.read_back_hash(1, 7), xxh3_64_with_seed(&[1, 2, 3, 4], 7));
        a.forget(1);
        assert_eq!(a.read_back_hash(1, 7), xxh3_64_with_seed(&[9; 4], 7));
        assert_eq!((reads(), a.read_back_hash(0, 7)), (4, zero), "blocks apart");
        let mut none = KvArena::new(4, 0);
        assert_eq!(none.read_back_hash(3, 7), xxh3_64_with_seed(&[], 7));
    }
}
