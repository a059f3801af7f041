//! CUDA device memory for regions (feature `cuda`), through cudarc's driver API with the
//! driver loaded at run time. Every call binds the device's primary context to the calling
//! thread first, so regions can be used from any thread (tokio workers, the UCX thread).

#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use crate::error::TransferError;

fn cuda_err(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> TransferError {
    move |e| TransferError::Cuda {
        op,
        detail: e.to_string(),
    }
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library and closes it again.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, or why there are none.
pub fn device_count() -> Result<usize, TransferError> {
    if !driver_present() {
        return Err(TransferError::CudaUnavailable(
            "the CUDA driver library (libcuda.so) is not present".into(),
        ));
    }
    result::init().map_err(|e| TransferError::CudaUnavailable(format!("cuInit: {e}")))?;
    let n = CudaContext::device_count()
        .map_err(|e| TransferError::CudaUnavailable(format!("device count: {e}")))?;
    Ok(n.max(0) as usize)
}

/// One `cuMemAlloc` allocation, freed on drop.
pub(crate) struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceAlloc {
    pub(crate) fn new(ordinal: usize, len: usize) -> Result<DeviceAlloc, TransferError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(TransferError::CudaUnavailable(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| TransferError::CudaUnavailable(format!("context: {e}")))?;
        // SAFETY: the context was just bound to this thread by `CudaContext::new`; the
        // allocation is freed once in `Drop`.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(cuda_err("cuMemAlloc"))?;
        let alloc = DeviceAlloc { ctx, ptr, len };
        // SAFETY: `ptr` is a fresh allocation of `len` bytes in the bound context.
        unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(cuda_err("cuMemsetD8"))?;
        Ok(alloc)
    }

    fn bind(&self) -> Result<(), TransferError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))
    }

    pub(crate) fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn check(&self, off: usize, len: usize) -> Result<(), TransferError> {
        if off.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(TransferError::InvalidArgument(format!(
                "device copy of {len} bytes at {off} past the end ({})",
                self.len
            )));
        }
        Ok(())
    }

    /// Host → device, synchronous.
    pub(crate) fn htod(&self, off: usize, src: &[u8]) -> Result<(), TransferError> {
        self.check(off, src.len())?;
        self.bind()?;
        // SAFETY: the destination range is inside the allocation (checked); `src` is a valid
        // host slice for the duration of this synchronous copy.
        unsafe { result::memcpy_htod_sync(self.ptr + off as u64, src) }
            .map_err(cuda_err("cuMemcpyHtoD"))
    }

    /// Device → host, synchronous.
    pub(crate) fn dtoh(&self, dst: &mut [u8], off: usize) -> Result<(), TransferError> {
        self.check(off, dst.len())?;
        self.bind()?;
        // SAFETY: the source range is inside the allocation (checked); `dst` is a valid,
        // exclusively borrowed host slice for the duration of this synchronous copy.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + off as u64) }
            .map_err(cuda_err("cuMemcpyDtoH"))
    }

    /// Device → device (possibly across devices: unified addressing), synchronous.
    pub(crate) fn dtod(
        &self,
        off: usize,
        src: &DeviceAlloc,
        src_off: usize,
        len: usize,
    ) -> Result<(), TransferError> {
        self.check(off, len)?;
        src.check(src_off, len)?;
        self.bind()?;
        // SAFETY: both ranges are inside their allocations (checked) and the caller holds both
        // blocks' locks.
        unsafe { result::memcpy_dtod_sync(self.ptr + off as u64, src.ptr + src_off as u64, len) }
            .map_err(cuda_err("cuMemcpyDtoD"))
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` in this context and is freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
