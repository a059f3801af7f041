//! Direct writes into a remote region that UCX has mapped into this process (`ucp_rkey_ptr`
//! on same-host shared memory): a put is then a plain copy on the caller's thread, with no
//! hand-off to the worker thread.

#![allow(unsafe_code)]

use crate::error::TransferError;
use crate::region::BlockLease;

/// A writable local mapping of a whole remote region.
#[derive(Debug)]
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; writes through it are raw copies into bytes that
// no Rust reference in this process covers (the crate's memory contract reserves a destination
// block for its one writer), so moving or sharing the pointer across threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only offers bounds-checked raw copies.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// # Safety
    /// `base .. base + len` must be a writable mapping that stays mapped for the life of this
    /// value (the writer owns it and releases the remote key only after dropping it).
    pub(crate) unsafe fn new(base: u64, len: usize) -> Mapping {
        Mapping {
            base: base as *mut u8,
            len,
        }
    }

    fn dst(&self, offset: usize, len: usize) -> Result<*mut u8, TransferError> {
        match offset.checked_add(len) {
            // SAFETY: `offset + len <= self.len`, so the pointer stays inside the mapping.
            Some(end) if end <= self.len => Ok(unsafe { self.base.add(offset) }),
            _ => Err(TransferError::InvalidArgument(format!(
                "{len} bytes at {offset} past the remote region ({} bytes)",
                self.len
            ))),
        }
    }

    /// Copies `src` to `offset` in the remote region.
    pub(crate) fn write(&self, offset: usize, src: &[u8]) -> Result<(), TransferError> {
        let dst = self.dst(offset, src.len())?;
        // SAFETY: `dst` has `src.len()` writable bytes (checked); `copy` tolerates overlap (the
        // source may be a block of the same memory when a process writes to itself).
        unsafe { std::ptr::copy(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies a leased local block (host or device) to `offset` in the remote region.
    pub(crate) fn write_lease(
        &self,
        offset: usize,
        lease: &BlockLease,
    ) -> Result<(), TransferError> {
        let len = lease.region().bytes_per_block();
        match lease.host_bytes() {
            Some(bytes) => self.write(offset, bytes),
            None => {
                let dst = self.dst(offset, len)?;
                // SAFETY: `dst` has `len` writable bytes (checked) that no Rust reference in
                // this process covers (memory contract); the slice lives only for the copy.
                let slice = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                lease.copy_into(slice)
            }
        }
    }
}
