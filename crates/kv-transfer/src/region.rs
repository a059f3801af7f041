//! KV memory regions: `num_blocks × bytes_per_block` contiguous bytes, block-major.
//!
//! A [`Region`] is shared (`Arc`) between its owner, who reads and writes blocks through the
//! safe methods here, and the transports, which let remote peers write into it. Every access
//! made by Rust code in this process (the owner's reads and writes, the TCP and local
//! transports' copies, a source block being sent) holds that block's lock — shared for
//! reads, exclusive for writes — so a write never overlaps another access and no safe API
//! hands out overlapping `&mut`. Writes that arrive through UCX are
//! made by the NIC, the kernel (CMA) or UCX's own code, outside Rust's view: like RDMA, they
//! rely on the protocol, which reserves a destination block for one writer and has nobody else
//! touch it until the write's flush completes (crate docs, "Memory contract").
//!
//! This is the only module, besides the UCX and CUDA FFI, that uses `unsafe`: it owns the raw
//! allocation and turns it into slices under a block lock.

#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::descriptor::MemoryKind;
use crate::error::TransferError;

/// Alignment of host regions: a page, so that registration (pinning, CMA, RDMA) covers whole
/// pages and block 0 starts on one.
pub const HOST_ALIGN: usize = 4096;

static NEXT_REGION_ID: AtomicU64 = AtomicU64::new(1);

/// A block-major KV memory region (see the module docs for the access rules).
pub struct Region {
    id: u64,
    num_blocks: u32,
    bytes_per_block: usize,
    memory: Memory,
    /// One lock per block, taken by every in-process access (see [`BlockGuard`]).
    locks: Box<[AtomicU32]>,
}

enum Memory {
    Host(HostAlloc),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::DeviceAlloc),
}

struct HostAlloc {
    ptr: NonNull<u8>,
    owner: HostOwner,
}

enum HostOwner {
    /// From the global allocator with this layout.
    Global(Layout),
    /// Allocated by a transport (UCX shared memory); released through it.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    External(External),
}

/// Host memory a transport allocated (so that peers on the same host can map it); the region
/// calls `release` once when dropped.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) struct External {
    /// Which transport instance allocated it, and its key there.
    pub(crate) owner: u64,
    pub(crate) key: u64,
    pub(crate) release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        match &mut self.owner {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed exactly once, here.
            HostOwner::Global(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), *layout) },
            HostOwner::External(ext) => {
                if let Some(release) = ext.release.take() {
                    release();
                }
            }
        }
    }
}

// SAFETY: the region owns its allocation; all in-process access to the bytes goes through the
// per-block locks (atomics), so sharing `&Region` across threads cannot create a data race
// between Rust accessors. The raw pointer is never exposed mutably without a lock held.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("memory", &self.memory_kind())
            .field("num_blocks", &self.num_blocks)
            .field("bytes_per_block", &self.bytes_per_block)
            .finish()
    }
}

fn checked_len(num_blocks: u32, bytes_per_block: usize) -> Result<usize, TransferError> {
    if num_blocks == 0 || bytes_per_block == 0 {
        return Err(TransferError::InvalidArgument(
            "a region needs at least one block of at least one byte".into(),
        ));
    }
    (num_blocks as usize)
        .checked_mul(bytes_per_block)
        .filter(|&n| n <= isize::MAX as usize - HOST_ALIGN)
        .ok_or_else(|| TransferError::InvalidArgument("region size overflows".into()))
}

impl Region {
    fn with_memory(num_blocks: u32, bytes_per_block: usize, memory: Memory) -> Arc<Region> {
        Arc::new(Region {
            id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
            num_blocks,
            bytes_per_block,
            memory,
            locks: (0..num_blocks).map(|_| AtomicU32::new(FREE)).collect(),
        })
    }

    /// Zeroed, page-aligned host memory.
    pub fn host(num_blocks: u32, bytes_per_block: usize) -> Result<Arc<Region>, TransferError> {
        let len = checked_len(num_blocks, bytes_per_block)?;
        let layout = Layout::from_size_align(len, HOST_ALIGN)
            .map_err(|e| TransferError::InvalidArgument(e.to_string()))?;
        // SAFETY: `layout` has a non-zero size (checked_len rejects empty regions).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            TransferError::Overloaded(format!("cannot allocate a {len}-byte region"))
        })?;
        Ok(Self::with_memory(
            num_blocks,
            bytes_per_block,
            Memory::Host(HostAlloc {
                ptr,
                owner: HostOwner::Global(layout),
            }),
        ))
    }

    /// A host region over memory a transport allocated.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `num_blocks × bytes_per_block` bytes,
    /// zero-initialised or at least initialised, aligned to [`HOST_ALIGN`], accessed by no Rust
    /// code other than through this region, and stay valid until `external.release` is called.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) unsafe fn external(
        num_blocks: u32,
        bytes_per_block: usize,
        ptr: NonNull<u8>,
        external: External,
    ) -> Result<Arc<Region>, TransferError> {
        checked_len(num_blocks, bytes_per_block)?;
        Ok(Self::with_memory(
            num_blocks,
            bytes_per_block,
            Memory::Host(HostAlloc {
                ptr,
                owner: HostOwner::External(external),
            }),
        ))
    }

    /// `(owner, key)` of transport-allocated memory.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) fn external_key(&self) -> Option<(u64, u64)> {
        match &self.memory {
            Memory::Host(HostAlloc {
                owner: HostOwner::External(e),
                ..
            }) => Some((e.owner, e.key)),
            _ => None,
        }
    }

    /// Zeroed CUDA device memory on device `ordinal`. Fails with
    /// [`TransferError::CudaUnavailable`] when no driver or device is present, and with
    /// [`TransferError::Unsupported`] when built without the `cuda` feature.
    pub fn cuda(
        ordinal: usize,
        num_blocks: u32,
        bytes_per_block: usize,
    ) -> Result<Arc<Region>, TransferError> {
        let len = checked_len(num_blocks, bytes_per_block)?;
        #[cfg(feature = "cuda")]
        {
            let mem = crate::cuda::DeviceAlloc::new(ordinal, len)?;
            Ok(Self::with_memory(
                num_blocks,
                bytes_per_block,
                Memory::Cuda(mem),
            ))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ordinal, len);
            Err(TransferError::Unsupported(
                "CUDA regions need tandem-kv-transfer built with the `cuda` feature".into(),
            ))
        }
    }

    /// Process-unique id (registries and listener tables key regions by it).
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    pub fn len_bytes(&self) -> usize {
        self.num_blocks as usize * self.bytes_per_block
    }

    pub fn memory_kind(&self) -> MemoryKind {
        match &self.memory {
            Memory::Host(_) => MemoryKind::Host,
            #[cfg(feature = "cuda")]
            Memory::Cuda(_) => MemoryKind::Cuda,
        }
    }

    // Without the `cuda` feature the match has one arm.
    #[allow(clippy::infallible_destructuring_match, irrefutable_let_patterns)]
    fn host_memory(&self) -> Option<&HostAlloc> {
        match &self.memory {
            Memory::Host(host) => Some(host),
            #[cfg(feature = "cuda")]
            Memory::Cuda(_) => None,
        }
    }

    fn check(&self, block: u32, len: usize) -> Result<usize, TransferError> {
        if block >= self.num_blocks {
            return Err(TransferError::OutOfRange {
                block,
                num_blocks: self.num_blocks,
            });
        }
        if len != self.bytes_per_block {
            return Err(TransferError::BlockSize {
                expected: self.bytes_per_block as u64,
                got: len as u64,
            });
        }
        Ok(block as usize * self.bytes_per_block)
    }

    /// Where bytes `range` of `block` start in the region, once both are in bounds.
    pub(crate) fn check_part(
        &self,
        block: u32,
        range: &Range<usize>,
    ) -> Result<usize, TransferError> {
        if block >= self.num_blocks {
            return Err(TransferError::OutOfRange {
                block,
                num_blocks: self.num_blocks,
            });
        }
        if range.start > range.end || range.end > self.bytes_per_block {
            return Err(TransferError::BadPart {
                start: range.start as u64,
                end: range.end as u64,
                bytes_per_block: self.bytes_per_block as u64,
            });
        }
        Ok(block as usize * self.bytes_per_block + range.start)
    }

    /// Takes `block` for writing: no reader and no other writer.
    fn lock(&self, block: u32) {
        let lock = &self.locks[block as usize];
        let mut spins = 0u32;
        while lock
            .compare_exchange_weak(FREE, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            // Contention means a write meets another access to one block, which the protocol
            // rules out; wait politely rather than fail, since it resolves in one block copy.
            backoff(&mut spins);
        }
    }

    fn unlock(&self, block: u32) {
        self.locks[block as usize].store(FREE, Ordering::Release);
    }

    /// Takes `block` for reading: readers share it (a source block queued for sending and
    /// the engine reading the same prefix block), a writer excludes them.
    fn lock_shared(&self, block: u32) {
        let lock = &self.locks[block as usize];
        let mut spins = 0u32;
        loop {
            let readers = lock.load(Ordering::Relaxed);
            if readers < WRITER - 1
                && lock
                    .compare_exchange_weak(
                        readers,
                        readers + 1,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                return;
            }
            backoff(&mut spins);
        }
    }

    fn unlock_shared(&self, block: u32) {
        self.locks[block as usize].fetch_sub(1, Ordering::Release);
    }

    /// Locks a host block for reading until the guard drops: other readers may hold it at
    /// the same time, writers wait. [`TransferError::Unsupported`] for device memory.
    pub fn read_lock_block(&self, block: u32) -> Result<BlockReadGuard<'_>, TransferError> {
        let offset = self.check(block, self.bytes_per_block)?;
        let host = self.host_memory().ok_or_else(|| {
            TransferError::Unsupported(
                "direct access to device memory; use read_block_into/write_block".into(),
            )
        })?;
        self.lock_shared(block);
        // SAFETY: `offset + bytes_per_block <= len` (checked above).
        let ptr = unsafe { host.ptr.as_ptr().add(offset) };
        Ok(BlockReadGuard {
            region: self,
            block,
            ptr,
        })
    }

    /// Locks a host block and gives exclusive access to its bytes until the guard drops.
    /// [`TransferError::Unsupported`] for device memory (use the copy methods).
    pub fn lock_block(&self, block: u32) -> Result<BlockGuard<'_>, TransferError> {
        let offset = self.check(block, self.bytes_per_block)?;
        let host = self.host_memory().ok_or_else(|| {
            TransferError::Unsupported(
                "direct access to device memory; use read_block_into/write_block".into(),
            )
        })?;
        self.lock(block);
        // SAFETY: `offset + bytes_per_block <= len` (checked above) so the pointer stays inside
        // the allocation.
        let ptr = unsafe { host.ptr.as_ptr().add(offset) };
        Ok(BlockGuard {
            region: self,
            block,
            ptr,
        })
    }

    /// Copies `src` (exactly one block) into `block`.
    pub fn write_block(&self, block: u32, src: &[u8]) -> Result<(), TransferError> {
        self.check(block, src.len())?;
        self.write_part(block, 0, src)
    }

    /// Copies `src` into bytes `offset..offset + src.len()` of `block` (a part of it: one
    /// layer's K/V, say).
    pub fn write_part(&self, block: u32, offset: usize, src: &[u8]) -> Result<(), TransferError> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
        let at = self.check_part(block, &(offset..offset.saturating_add(src.len())))?;
        match &self.memory {
            Memory::Host(_) => {
                self.lock_block(block)?[offset..offset + src.len()].copy_from_slice(src);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Cuda(dev) => {
                self.lock(block);
                let r = dev.htod(at, src);
                self.unlock(block);
                r
            }
        }
    }

    /// Copies `block` into `dst` (exactly one block long).
    pub fn read_block_into(&self, block: u32, dst: &mut [u8]) -> Result<(), TransferError> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
        let offset = self.check(block, dst.len())?;
        match &self.memory {
            Memory::Host(_) => {
                dst.copy_from_slice(&self.read_lock_block(block)?);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Cuda(dev) => {
                self.lock_shared(block);
                let r = dev.dtoh(dst, offset);
                self.unlock_shared(block);
                r
            }
        }
    }

    /// A copy of `block`.
    pub fn read_block(&self, block: u32) -> Result<Vec<u8>, TransferError> {
        let mut out = vec![0; self.bytes_per_block];
        self.read_block_into(block, &mut out)?;
        Ok(out)
    }

    /// Copies `src`'s block `src_block` into this region's `block`, whatever memory either
    /// lives in. Both blocks are locked (in a global order, so two opposite copies cannot
    /// deadlock); copying a block onto itself does nothing.
    pub fn copy_block_from(
        &self,
        block: u32,
        src: &Region,
        src_block: u32,
    ) -> Result<(), TransferError> {
        self.check(block, src.bytes_per_block)?;
        self.copy_part_from(block, src, src_block, 0..src.bytes_per_block)
    }

    /// [`copy_block_from`](Self::copy_block_from) of bytes `range` of the blocks only (the
    /// same range in both: a part of a block, as a prefill computes it layer by layer).
    pub fn copy_part_from(
        &self,
        block: u32,
        src: &Region,
        src_block: u32,
        range: Range<usize>,
    ) -> Result<(), TransferError> {
        let dst_off = self.check_part(block, &range)?;
        let src_off = src.check_part(src_block, &range)?;
        if self.id == src.id && block == src_block {
            return Ok(());
        }
        // The destination for writing, the source for reading, in one global order.
        let dst_first = (self.id, block) < (src.id, src_block);
        if dst_first {
            self.lock(block);
            src.lock_shared(src_block);
        } else {
            src.lock_shared(src_block);
            self.lock(block);
        }
        let result = copy_bytes(&self.memory, dst_off, &src.memory, src_off, range.len());
        src.unlock_shared(src_block);
        self.unlock(block);
        result
    }

    /// Copies bytes `offset..offset + dst.len()` of `block` into `dst`.
    pub fn read_part_into(
        &self,
        block: u32,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), TransferError> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
        let at = self.check_part(block, &(offset..offset.saturating_add(dst.len())))?;
        match &self.memory {
            Memory::Host(_) => {
                dst.copy_from_slice(&self.read_lock_block(block)?[offset..offset + dst.len()]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Cuda(dev) => {
                self.lock_shared(block);
                let r = dev.dtoh(dst, at);
                self.unlock_shared(block);
                r
            }
        }
    }

    /// Locks `block` for reading for as long as the returned lease lives: a transport holds
    /// one while it sends a source block (a queued TCP batch: until the batch is written), so
    /// the owner's writes wait instead of tearing it while its reads go on — the engine
    /// reading a prefix block that a transfer has queued must not wait for the transfer,
    /// which itself waits for the engine's next step.
    pub(crate) fn lease_block(self: &Arc<Self>, block: u32) -> Result<BlockLease, TransferError> {
        self.check(block, self.bytes_per_block)?;
        self.lock_shared(block);
        Ok(BlockLease {
            region: Arc::clone(self),
            block,
        })
    }

    /// For a region in GPU memory, its device and the device address of block 0: a model
    /// computing on that device reads and writes the region's blocks in place with its own
    /// kernels (under the same rule as the transports: a block being written by a transfer
    /// is not touched until the transfer is fenced). None for host memory.
    pub fn cuda_memory(&self) -> Option<(usize, u64)> {
        match &self.memory {
            Memory::Host(_) => None,
            #[cfg(feature = "cuda")]
            Memory::Cuda(d) => Some((d.ordinal(), d.device_ptr())),
        }
    }

    /// Address of block 0 as the FFI sees it: a host pointer or a CUDA device pointer. For UCX
    /// registration and puts only; never dereferenced by Rust code outside this module.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) fn base_address(&self) -> u64 {
        match &self.memory {
            Memory::Host(h) => h.ptr.as_ptr() as u64,
            #[cfg(feature = "cuda")]
            Memory::Cuda(d) => d.device_ptr(),
        }
    }
}

/// Copies `len` bytes between two regions' memories. Callers hold both blocks' locks.
fn copy_bytes(
    dst: &Memory,
    dst_off: usize,
    src: &Memory,
    src_off: usize,
    len: usize,
) -> Result<(), TransferError> {
    match (dst, src) {
        (Memory::Host(d), Memory::Host(s)) => {
            // SAFETY: both ranges lie inside their allocations (offsets checked by the caller
            // against the block size) and the two blocks are distinct (the caller returns early
            // for a block copied onto itself), so the ranges do not overlap; both locks are held.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.ptr.as_ptr().add(src_off),
                    d.ptr.as_ptr().add(dst_off),
                    len,
                )
            };
            Ok(())
        }
        #[cfg(feature = "cuda")]
        (Memory::Cuda(d), Memory::Host(s)) => {
            // SAFETY: in bounds (see above); the source block's lock is held, so no Rust code
            // writes it while this shared slice lives.
            let bytes = unsafe { std::slice::from_raw_parts(s.ptr.as_ptr().add(src_off), len) };
            d.htod(dst_off, bytes)
        }
        #[cfg(feature = "cuda")]
        (Memory::Host(d), Memory::Cuda(s)) => {
            // SAFETY: in bounds; the destination block's lock is held, so this is the only
            // reference to those bytes.
            let bytes = unsafe { std::slice::from_raw_parts_mut(d.ptr.as_ptr().add(dst_off), len) };
            s.dtoh(bytes, src_off)
        }
        #[cfg(feature = "cuda")]
        (Memory::Cuda(d), Memory::Cuda(s)) => d.dtod(dst_off, s, src_off, len),
    }
}

/// Exclusive access to one host block; unlocks on drop. `Send`, so a transport may hold it
/// across an `.await` (the TCP receiver reads a block straight from the socket into it).
pub struct BlockGuard<'a> {
    region: &'a Region,
    block: u32,
    ptr: *mut u8,
}

// SAFETY: the guard is a lock token plus a pointer into memory the region keeps alive for 'a;
// the lock is an atomic flag, not tied to the locking thread.
unsafe impl Send for BlockGuard<'_> {}
// SAFETY: `&BlockGuard` only gives `&[u8]`.
unsafe impl Sync for BlockGuard<'_> {}

impl fmt::Debug for BlockGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockGuard")
            .field("region", &self.region.id)
            .field("block", &self.block)
            .finish()
    }
}

impl Deref for BlockGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at `bytes_per_block` bytes inside the live allocation, and the
        // block lock held by this guard excludes every other in-process accessor.
        unsafe { std::slice::from_raw_parts(self.ptr, self.region.bytes_per_block) }
    }
}

impl DerefMut for BlockGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only live slice from this guard.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.region.bytes_per_block) }
    }
}

impl Drop for BlockGuard<'_> {
    fn drop(&mut self) {
        self.region.unlock(self.block);
    }
}

/// An owned lock on one block of an `Arc<Region>` (see [`Region::lease_block`]).
pub(crate) struct BlockLease {
    region: Arc<Region>,
    block: u32,
}

impl fmt::Debug for BlockLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockLease")
            .field("region", &self.region.id)
            .field("block", &self.block)
            .finish()
    }
}

impl BlockLease {
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// FFI address of the leased block (host or device pointer).
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) fn address(&self) -> u64 {
        self.region.base_address() + self.block as u64 * self.region.bytes_per_block as u64
    }

    /// The block's bytes, for host memory; `None` for device memory.
    pub(crate) fn host_bytes(&self) -> Option<&[u8]> {
        match &self.region.memory {
            // SAFETY: in bounds (checked when leased); the lease holds the block lock, so no
            // Rust code writes these bytes while the slice lives.
            Memory::Host(h) => Some(unsafe {
                std::slice::from_raw_parts(
                    h.ptr
                        .as_ptr()
                        .add(self.block as usize * self.region.bytes_per_block),
                    self.region.bytes_per_block,
                )
            }),
            #[cfg(feature = "cuda")]
            Memory::Cuda(_) => None,
        }
    }

    /// Copies the block into `dst` (any memory kind), under the lease's lock.
    pub(crate) fn copy_into(&self, dst: &mut [u8]) -> Result<(), TransferError> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
        let off = self.region.check(self.block, dst.len())?;
        match &self.region.memory {
            Memory::Host(_) => {
                dst.copy_from_slice(self.host_bytes().unwrap_or_default());
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Memory::Cuda(d) => d.dtoh(dst, off),
        }
    }
}

impl Drop for BlockLease {
    fn drop(&mut self) {
        self.region.unlock_shared(self.block);
    }
}

/// Shared access to one host block; unlocks on drop (see [`Region::read_lock_block`]).
pub struct BlockReadGuard<'a> {
    region: &'a Region,
    block: u32,
    ptr: *const u8,
}

// SAFETY: as for `BlockGuard`: a lock token and a pointer the region keeps alive for 'a; it
// only gives `&[u8]`.
unsafe impl Send for BlockReadGuard<'_> {}
// SAFETY: `&BlockReadGuard` only gives `&[u8]`.
unsafe impl Sync for BlockReadGuard<'_> {}

impl fmt::Debug for BlockReadGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockReadGuard")
            .field("region", &self.region.id)
            .field("block", &self.block)
            .finish()
    }
}

impl Deref for BlockReadGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at `bytes_per_block` bytes inside the live allocation, and the
        // shared lock held by this guard excludes every in-process writer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.region.bytes_per_block) }
    }
}

impl Drop for BlockReadGuard<'_> {
    fn drop(&mut self) {
        self.region.unlock_shared(self.block);
    }
}

/// A free block lock; [`WRITER`] when a writer holds it; any other value counts readers.
const FREE: u32 = 0;
const WRITER: u32 = u32::MAX;

/// One wait of a contended block lock: spin briefly, then yield the thread.
fn backoff(spins: &mut u32) {
    if *spins < 100 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
    *spins = spins.saturating_add(1);
}

#[cfg(test)]
#[path = "region_tests.rs"]
mod tests;
