//! The async side's view of the UCX worker thread: the commands it takes and the handle that
//! sends them and wakes the thread (`thread.rs` starts it).

#![allow(unsafe_code)]

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use tokio::sync::{OwnedSemaphorePermit, oneshot};

use super::completion::Completion;
use super::sys::{UcpLib, ucp_worker_h};
use crate::error::TransferError;
use crate::region::{BlockLease, External, HOST_ALIGN, Region};

pub(crate) type Reply<T> = oneshot::Sender<Result<T, TransferError>>;

/// Per-writer state shared with the async side: the first failure of a pipelined put.
#[derive(Debug, Default)]
pub(crate) struct WriterState {
    error: Mutex<Option<TransferError>>,
}

impl WriterState {
    pub(crate) fn error(&self) -> Option<TransferError> {
        self.error.lock().clone()
    }

    pub(crate) fn fail(&self, e: TransferError) {
        let mut slot = self.error.lock();
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

/// A borrowed source buffer. The async side guarantees it outlives the operation: it waits
/// for the put's completion, and blocks in `Drop` if its future is dropped early.
pub(crate) struct RawBuf {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

// SAFETY: the pointer is only handed to UCX on the worker thread while the owner waits for the
// completion (see above); the bytes are never accessed by two Rust threads.
unsafe impl Send for RawBuf {}

pub(crate) enum PutSource {
    Borrowed(RawBuf),
    /// Bytes the operation owns (a part of a block copied out of it), where they are, and
    /// the writer's in-flight permit: all travel with the pending operation, so the buffer
    /// outlives the put and the permit comes back when it completes.
    Owned {
        buf: RawBuf,
        _bytes: Vec<u8>,
        _permit: OwnedSemaphorePermit,
    },
    /// Consecutive locked blocks of one local region, put to consecutive remote blocks with
    /// one operation, and the writer's in-flight permits (one per block), released (with the
    /// locks) when the put completes.
    Run {
        leases: Vec<BlockLease>,
        _permit: OwnedSemaphorePermit,
    },
}

/// What a successful connect gives the writer.
#[derive(Debug)]
pub(crate) struct Connected {
    pub(crate) writer: u64,
    /// The remote region mapped into this process, when UCX can (same-host shared memory).
    pub(crate) direct: Option<super::direct::Mapping>,
}

pub(crate) enum Command {
    /// Allocates `len` bytes of host memory with `ucp_mem_map(ALLOCATE)` (shared memory that
    /// same-host peers map directly); replies with its address and key.
    Alloc {
        len: usize,
        reply: Reply<(u64, u64)>,
    },
    /// Unmaps (frees) an allocation made by `Alloc`.
    Free {
        key: u64,
    },
    Expose {
        region: Arc<Region>,
        reply: Reply<Vec<u8>>,
    },
    Withdraw {
        region_id: u64,
        reply: Reply<()>,
    },
    Connect {
        peer: Vec<u8>,
        rkey: Vec<u8>,
        remote_base: u64,
        remote_len: u64,
        state: Arc<WriterState>,
        reply: Reply<Connected>,
    },
    Put {
        writer: u64,
        remote_addr: u64,
        src: PutSource,
        done: Option<Arc<Completion>>,
    },
    Flush {
        writer: u64,
        done: Arc<Completion>,
    },
    Release {
        writer: u64,
    },
}

/// What the senders and the thread share to avoid lost wake-ups (see `Engine::sleep`).
pub(super) struct Wake {
    /// The worker, for `ucp_worker_signal`; `None` once the thread is about to destroy it.
    pub(super) worker: Mutex<Option<WorkerPtr>>,
    pub(super) queued: AtomicUsize,
    pub(super) sleeping: AtomicBool,
}

pub(super) struct WorkerPtr(pub(super) &'static UcpLib, pub(super) ucp_worker_h);

// SAFETY: the pointer is only used for `ucp_worker_signal`, which UCX documents as callable
// from any thread, and only under `Wake::worker`'s lock, which the thread clears before it
// destroys the worker (`Engine`'s `Drop`, which also runs on unwinding).
unsafe impl Send for WorkerPtr {}

impl Wake {
    fn signal(&self) {
        let worker = self.worker.lock();
        if let Some(w) = worker.as_ref() {
            // SAFETY: the worker is alive while it is in the slot (see `WorkerPtr`).
            unsafe { w.0.ucp_worker_signal(w.1) };
        }
    }
}

/// The async side's handle: sends commands and wakes the thread; stops it when dropped.
pub(crate) struct EngineHandle {
    /// Process-unique id of this engine (tags the memory it allocates).
    pub(crate) instance: u64,
    pub(super) tx: Option<mpsc::Sender<Command>>,
    pub(super) wake: Arc<Wake>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
    pub(crate) worker_address: Vec<u8>,
    pub(crate) cuda_memory: bool,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("instance", &self.instance)
            .field("worker_address_len", &self.worker_address.len())
            .finish_non_exhaustive()
    }
}

impl EngineHandle {
    pub(crate) fn send(&self, cmd: Command) -> Result<(), TransferError> {
        let tx = self.tx.as_ref().ok_or(TransferError::Closed)?;
        self.wake.queued.fetch_add(1, Ordering::SeqCst);
        if tx.send(cmd).is_err() {
            self.wake.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(TransferError::Closed);
        }
        if self.wake.sleeping.load(Ordering::SeqCst) {
            self.wake.signal();
        }
        Ok(())
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        // Closing the channel tells the thread to shut down.
        drop(self.tx.take());
        self.wake.signal();
        if let Some(t) = self.thread.take() {
            // The last handle can be dropped on the thread itself (a put's source region that
            // owned UCX memory): it then shuts down on its own, without being joined.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Wraps memory from [`Command::Alloc`] in a region that frees it (through the engine) when
/// dropped, and keeps the engine alive until then.
pub(crate) fn region_from_alloc(
    engine: &Arc<EngineHandle>,
    num_blocks: u32,
    bytes_per_block: usize,
    address: u64,
    key: u64,
) -> Result<Arc<Region>, TransferError> {
    let free = {
        let engine = Arc::clone(engine);
        move || {
            let _ = engine.send(Command::Free { key });
        }
    };
    let ptr = match std::ptr::NonNull::new(address as *mut u8) {
        Some(p) if address.is_multiple_of(HOST_ALIGN as u64) => p,
        _ => {
            free();
            return Err(TransferError::Ucx {
                op: "mem map (allocate)",
                detail: format!("unaligned allocation at {address:#x}"),
            });
        }
    };
    let external = External {
        owner: engine.instance,
        key,
        release: Some(Box::new(free)),
    };
    let len = num_blocks as usize * bytes_per_block;
    // SAFETY: UCX mapped at least `len` writable bytes at `address` (checked in `Ucp::alloc`);
    // nothing else uses them yet. Zeroing also initialises memory UCX took from the heap.
    unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
    // SAFETY: the `len` bytes are readable, writable, initialised (zeroed above) and
    // page-aligned (checked above); only this region accesses them from Rust, and they stay
    // mapped until the region's release sends `Free`.
    unsafe { Region::external(num_blocks, bytes_per_block, ptr, external) }
}
