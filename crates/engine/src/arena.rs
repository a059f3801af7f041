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
/// remote prefill). Its length is fixed for its life.
pub trait ArenaStorage: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl ArenaStorage for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self
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
    fn bytes(&self) -> &[u8] {
        &self.buf[self.offset..self.offset + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.offset..self.offset + self.len]
    }
}

/// One tier's KV memory: `num_blocks × bytes_per_block` contiguous bytes.
pub struct KvArena {
    bytes_per_block: usize,
    num_blocks: usize,
    data: Box<dyn ArenaStorage>,
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
        }
    }

    /// An arena over `storage`, which must be exactly `num_blocks × bytes_per_block` bytes.
    pub fn with_storage(
        storage: Box<dyn ArenaStorage>,
        num_blocks: usize,
        bytes_per_block: usize,
    ) -> Result<Self, ArenaSizeMismatch> {
        let expected = num_blocks * bytes_per_block;
        let got = storage.bytes().len();
        if got != expected {
            return Err(ArenaSizeMismatch { expected, got });
        }
        Ok(KvArena {
            bytes_per_block,
            num_blocks,
            data: storage,
        })
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The whole region (what a transport registers).
    pub fn as_bytes(&self) -> &[u8] {
        self.data.bytes()
    }

    /// The whole region, mutable (what a transport writes into).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.data.bytes_mut()
    }

    /// Byte offset of a block in the region.
    pub fn offset_of(&self, block: u32) -> usize {
        block as usize * self.bytes_per_block
    }

    pub fn block(&self, block: u32) -> &[u8] {
        let o = self.offset_of(block);
        &self.data.bytes()[o..o + self.bytes_per_block]
    }

    pub fn block_mut(&mut self, block: u32) -> &mut [u8] {
        let o = self.offset_of(block);
        let n = self.bytes_per_block;
        &mut self.data.bytes_mut()[o..o + n]
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
    to.block_mut(to_block)
        .copy_from_slice(from.block(from_block));
}

#[cfg(test)]
mod tests {
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
        a.block_mut(1).copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(a.as_bytes(), &[0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        let mut b = KvArena::new(2, 4);
        copy_block(&a, 1, &mut b, 0);
        assert_eq!(b.block(0), &[1, 2, 3, 4]);
        let empty = KvArena::new(1000, 0);
        assert!(empty.as_bytes().is_empty());
        assert_eq!(a.as_bytes().as_ptr() as usize % PAGE, 0, "page-aligned");
        assert!(empty.block(999).is_empty());
    }
}
